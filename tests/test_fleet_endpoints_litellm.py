"""One endpoint over the fleet, for real (docs/recipes.md, "One endpoint over the fleet"): two
`hotfit serve` on loopback (the real llama-server on the deterministic tool-call fixture), their
`hotfit --json status` rendered by `hotfit fleet endpoints` into the LiteLLM proxy's config, and
the real LiteLLM proxy (PyPI ``litellm[proxy]``) in front: a tool call through the proxy comes
back parsed; with one server stopped, every request still succeeds through the other.

``litellm[proxy]`` is not in the test extra (a 756 MB environment of 120 packages, 4.5 min to
install here): the test finds the ``litellm`` command on PATH, in the virtualenv or at
``HOTFIT_LITELLM``, and skips without it unless ``HOTFIT_REQUIRE_LITELLM`` is set.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from hotfit.planner.probe import Device, ProbeResult
from hotfit.pipeline.endpoints import API_KEY_ENV
from tests.e2e_support import HOST_TOTAL_BYTES, GiB, write_probe, write_provisioned_home
from tests.gguf_fixtures import PROBE_TOOL, free_port, pinned_template, require_llama_server
from tests.polling import wait_until
from tests.serve_support import REPO, READY_LIMIT_S, healthy, hotfit_serve, stop

TIER = "e2e"

MODEL = "fx-agent"
REQUIRE_ENV = "HOTFIT_REQUIRE_LITELLM"


def litellm_command() -> str:
    found = os.environ.get("HOTFIT_LITELLM") or shutil.which(
        "litellm", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if found:
        return found
    why = "litellm not installed (pip install 'litellm[proxy]' somewhere; HOTFIT_LITELLM=<its litellm command>)"
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(f"{why}; {REQUIRE_ENV} is set")
    pytest.skip(why)


def hotfit(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hotfit", "--home", str(home), "--log-format", "json", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def wait_proxy(proc: subprocess.Popen[bytes], base: str) -> None:
    # a hang guard, twice the server's: the proxy imports a lot; looked at twice a second meanwhile
    wait_until(lambda: healthy(base, "/health/liveliness"), "the LiteLLM proxy to come up",
               timeout_s=READY_LIMIT_S * 2, proc=proc, interval_s=0.5)


def ask(client: Any) -> tuple[Any, str]:
    """A tool-call request through the proxy: the answer, and the api_base LiteLLM sent it to (its
    ``x-litellm-model-api-base`` response header)."""
    messages: Any = [{"role": "user", "content": "Echo the word hello with the tool."}]
    tools: Any = [PROBE_TOOL]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, tools=tools,
                                                           tool_choice="required", temperature=0)
    return raw.parse(), raw.headers.get("x-litellm-model-api-base", "")


@pytest.mark.llama
def test_litellm_proxy_over_two_hotfit_serves_answers_tool_calls_and_survives_one_stopping(tmp_path: Path) -> None:
    import openai

    require_llama_server()
    litellm = litellm_command()
    key = "fleet-key-" + os.urandom(8).hex()
    key_file = tmp_path / "api-key"
    key_file.write_text(key + "\n")
    probe = write_probe(tmp_path / "probe.json", 8 * GiB)
    with ExitStack() as stack:
        servers, statuses = [], []
        for name in ("node-a", "node-b"):
            made = write_provisioned_home(tmp_path / name, ProbeResult(
                devices=(Device(0, "cpu", "fixture host", HOST_TOTAL_BYTES, 8 * GiB),)), name=MODEL,
                template_text=pinned_template().read_text(encoding="utf-8"))
            servers.append(stack.enter_context(hotfit_serve(made.home, free_port(), probe, key_file)))
            status = hotfit(made.home, "--json", "status")
            assert status.returncode == 0, status.stderr[-2000:]
            statuses.append(tmp_path / f"{name}.json")
            statuses[-1].write_text(status.stdout)
        rendered = hotfit(tmp_path / "x", "fleet", "endpoints", *map(str, statuses))
        assert rendered.returncode == 0, rendered.stderr[-2000:]
        config = tmp_path / "litellm.yaml"
        config.write_text(rendered.stdout)
        deployments = json.loads(rendered.stdout.split("\n", 2)[2])["model_list"]
        assert [d["model_name"] for d in deployments] == [MODEL, MODEL]
        port = free_port()
        master = "sk-" + os.urandom(24).hex()  # the proxy's own key (it refuses to start without one)
        env = {**os.environ, API_KEY_ENV: key, "LITELLM_MASTER_KEY": master, "LITELLM_TELEMETRY": "False",
               "LITELLM_LOCAL_MODEL_COST_MAP": "True", "NO_PROXY": "127.0.0.1,localhost"}
        proxy = subprocess.Popen([litellm, "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
                                 env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        stack.callback(stop, proxy)
        base = f"http://127.0.0.1:{port}"
        wait_proxy(proxy, base)
        # the proxy took hotfit's values: the window and tool support, per deployment
        request = urllib.request.Request(f"{base}/model/info", headers={"Authorization": f"Bearer {master}"})
        with urllib.request.urlopen(request, timeout=30) as resp:
            infos = json.loads(resp.read())["data"]
        assert sorted(i["model_info"]["max_input_tokens"] for i in infos) == [
            d["model_info"]["max_input_tokens"] for d in deployments]
        assert all(i["model_info"]["supports_function_calling"] is True for i in infos)

        client = openai.OpenAI(base_url=f"{base}/v1", api_key=master, max_retries=0, timeout=180)
        answer, routed = ask(client)
        [call] = answer.choices[0].message.tool_calls
        assert call.function.name == "hotfit_probe" and json.loads(call.function.arguments) == {"text": ""}
        bases = [d["litellm_params"]["api_base"] for d in deployments]
        assert routed.rstrip("/") in [b.rstrip("/") for b in bases]

        stop(servers[0])  # one machine goes away: every request still succeeds, through the other
        stopped_port = json.loads(statuses[0].read_text())["serving"]["port"]
        for _ in range(4):
            answer, routed = ask(client)
            assert answer.choices[0].message.tool_calls[0].function.name == "hotfit_probe"
            assert f":{stopped_port}/" not in routed + "/", routed

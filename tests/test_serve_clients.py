"""`hotfit serve` as a fleet's clients meet it (docs/recipes.md, "Clients"): the model is listed
under its registry name (llama-server ``--alias``), ``/metrics`` is on, and the openai SDK and
LangChain's ``ChatOpenAI(...).bind_tools`` get a parsed tool call from the served tool-call
fixture — with the real llama-server, behind the API key from ``--api-key-file``.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hotfit.backends.llama_server.flags import ServerFeatures, llama_server_argv, parse_server_features
from hotfit.planner.probe import Device, ProbeResult
from tests.e2e_support import HOST_TOTAL_BYTES, GiB, write_probe, write_provisioned_home
from tests.gguf_fixtures import PROBE_TOOL, free_port, pinned_template, require_llama_server
from tests.serve_support import hotfit_serve

MODEL = "fx-agent"
FEATURES = ServerFeatures(log_jsonl=True, fit=True, ngl_all=True, api_key_env=True, api_key_file=True,
                          cache_ram=True, offline=True, verbosity=True, flash_attn_values=True,
                          alias=True, metrics=True)


# ----------------------------------------------------------------------------- flags (pure)


def test_alias_and_metrics_are_read_from_help() -> None:
    help_text = ("-a,    --alias STRING                   set model name aliases, comma-separated\n"
                 "--metrics                               enable prometheus compatible metrics endpoint\n")
    features = parse_server_features(help_text)
    assert features.alias and features.metrics
    older = parse_server_features("--port PORT   port to listen\n--metrics-port N\n")
    assert not older.alias and not older.metrics  # --metrics-port is not --metrics


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A home as `hotfit auto` leaves it, for the tool-call fixture on the host (CPU)."""
    root = tmp_path_factory.mktemp("serve-clients")
    probe = ProbeResult(devices=(Device(0, "cpu", "fixture host", HOST_TOTAL_BYTES, 8 * GiB),))
    made = write_provisioned_home(root / "home", probe, name=MODEL)
    return {"home": made.home, "root": root, "plan": made.plan, "model": made.model, "template": made.template}


def test_argv_names_the_model_and_turns_metrics_on(home: dict) -> None:
    argv = llama_server_argv(home["plan"], home["model"], None, 8080, binary=Path("/bin/llama-server"),
                             features=FEATURES, alias=MODEL, metrics=True)
    assert argv[argv.index("--alias") + 1] == MODEL and argv.count("--metrics") == 1
    # the load stage's probe session passes neither; a build without the flags gets neither
    plain = llama_server_argv(home["plan"], home["model"], None, 8080, binary=Path("/bin/llama-server"),
                              features=FEATURES)
    assert "--alias" not in plain and "--metrics" not in plain
    old = ServerFeatures(**{**FEATURES.__dict__, "alias": False, "metrics": False})
    bare = llama_server_argv(home["plan"], home["model"], None, 8080, binary=Path("/bin/llama-server"),
                             features=old, alias=MODEL, metrics=True)
    assert "--alias" not in bare and "--metrics" not in bare


# ----------------------------------------------------------------------------- the real server


@pytest.fixture(scope="module")
def served(home: dict) -> Iterator[dict[str, Any]]:
    """`hotfit serve` on the fixture with an API key file; yields its base URL and key."""
    require_llama_server()
    home["template"].write_text(pinned_template().read_text(encoding="utf-8"))  # makes tool calls parse
    key = "test-key-" + os.urandom(8).hex()
    key_file = home["root"] / "api-key"
    key_file.write_text(key + "\n")
    port = free_port()
    probe = write_probe(home["root"] / "probe.json", 8 * GiB)
    with hotfit_serve(home["home"], port, probe, key_file):
        yield {"base": f"http://127.0.0.1:{port}", "key": key, "key_file": key_file, "home": home["home"]}


def get(served: dict, path: str) -> tuple[int, str]:
    req = urllib.request.Request(served["base"] + path, headers={"Authorization": f"Bearer {served['key']}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.status, resp.read().decode()


@pytest.mark.llama
def test_models_lists_the_registry_name(served: dict) -> None:
    status, body = get(served, "/v1/models")
    assert status == 200
    ids = [m["id"] for m in json.loads(body)["data"]]
    assert ids == [MODEL]  # not the GGUF's path


@pytest.mark.llama
def test_metrics_endpoint_is_on(served: dict) -> None:
    status, body = get(served, "/metrics")
    assert status == 200
    assert "# TYPE llamacpp:prompt_tokens_total counter" in body
    with pytest.raises(urllib.error.HTTPError) as denied:  # behind the API key, like the API
        urllib.request.urlopen(served["base"] + "/metrics", timeout=30)
    assert denied.value.code == 401


def _question() -> str:
    return "Echo the word hello with the tool."


@pytest.mark.llama
def test_openai_sdk_gets_a_parsed_tool_call(served: dict) -> None:
    import openai
    client = openai.OpenAI(base_url=served["base"] + "/v1", api_key=served["key"], max_retries=0, timeout=120)
    messages: Any = [{"role": "user", "content": _question()}]  # plain dicts, as a client writes them
    tools: Any = [PROBE_TOOL]  # (the SDK types them as its own TypedDicts)
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="required",
                                            temperature=0)
    assert answer.model == MODEL
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls is not None
    [call] = choice.message.tool_calls
    assert call.function.name == "hotfit_probe" and json.loads(call.function.arguments) == {"text": ""}


@pytest.mark.llama
def test_langchain_bind_tools_gets_a_parsed_tool_call(served: dict) -> None:
    import langchain_openai
    chat = langchain_openai.ChatOpenAI(model=MODEL, base_url=served["base"] + "/v1", api_key=served["key"],
                                       temperature=0, max_retries=0, timeout=120)
    message = chat.bind_tools([PROBE_TOOL], tool_choice="required").invoke(_question())
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("hotfit_probe", {"text": ""})]
    assert message.invalid_tool_calls == []


@pytest.mark.llama
def test_print_client_config_reads_the_running_serve(served: dict) -> None:
    """Without --host/--port: the running serve's port, key file and opened window, and the openai
    SDK configured from exactly that gets its tool call (docs/recipes.md, "Clients configured by hotfit")."""
    import io

    import openai

    from hotfit.pipeline.cli import main

    out = io.StringIO()
    assert main(["--home", str(served["home"]), "serve", "--print-client-config", "openai"], out=out) == 0
    config = json.loads(out.getvalue())
    assert config["base_url"] == served["base"] + "/v1" and config["model"] == MODEL
    assert config["api_key_file"] == str(served["key_file"].resolve())
    _, props = get(served, "/props")
    assert config["context_window_tokens"] == json.loads(props)["default_generation_settings"]["n_ctx"]
    client = openai.OpenAI(base_url=config["base_url"], api_key=Path(config["api_key_file"]).read_text().strip(),
                           max_retries=0, timeout=120)
    messages: Any = [{"role": "user", "content": _question()}]
    tools: Any = [PROBE_TOOL]
    answer = client.chat.completions.create(model=config["model"], messages=messages, tools=tools,
                                            tool_choice="required", temperature=0)
    assert answer.choices[0].message.tool_calls[0].function.name == "hotfit_probe"

"""Clients configured by hotfit (docs/recipes.md, "Clients configured by hotfit"):
``hotfit serve --print-client-config litellm|openai`` for one machine and ``hotfit fleet endpoints``
for many, every value from hotfit's state — the manifest (alias, opened window, the tool-call
probe's verdict and speed) and the serve.pid record or the serve options (host, port, key file).
The real LiteLLM proxy in front of two real `hotfit serve` is tests/test_fleet_endpoints_litellm.py.
"""

from __future__ import annotations

import io
import json
import socket
from pathlib import Path
from typing import Any


from hotfit.planner.probe import Device, ProbeResult
from hotfit.pipeline.cli import main
from hotfit.pipeline.endpoints import API_KEY_ENV, ServedEndpoint, api_base, litellm_config
from hotfit.pipeline.manifest import read_manifest, write_manifest
from tests.e2e_support import HOST_TOTAL_BYTES, GiB, write_provisioned_home
from tests.gguf_fixtures import tool_template_text


def provisioned(home: Path, *, window: int = 49152, speed: float | None = 21.4, passed: bool = True) -> Path:
    probe = ProbeResult(devices=(Device(0, "cpu", "fixture host", HOST_TOTAL_BYTES, 8 * GiB),))
    made = write_provisioned_home(home, probe, kv_cache_type="q8_0", opened_context_tokens=window,
                                  template_text=tool_template_text())
    manifest = read_manifest(made.home / "manifest.json", strict=True)
    assert manifest is not None
    verdict = {"passed": passed, "tool": "hotfit_probe", "generation_tokens_per_s": speed}
    write_manifest(made.home / "manifest.json", manifest.__class__(**{**manifest.__dict__, "probe_verdict": verdict}))
    return made.home


def cli(home: Path, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(["--home", str(home), "--log-format", "json", *args], out=out)
    return code, out.getvalue()


def test_print_client_config_litellm_is_every_value_from_state(tmp_path: Path) -> None:
    home = provisioned(tmp_path / "home")
    key = tmp_path / "api-key"
    key.write_text("k" * 32)
    code, out = cli(home, "--json", "serve", "--print-client-config", "litellm", "--host", "10.1.2.3",
                    "--port", "8181", "--api-key-file", str(key))
    assert code == 0, out
    (entry,) = json.loads(out)["model_list"]
    assert entry["model_name"] == "fx-agent"  # the alias llama-server serves under
    assert entry["litellm_params"] == {"model": "openai/fx-agent", "api_base": "http://10.1.2.3:8181/v1",
                                       "api_key": f"os.environ/{API_KEY_ENV}", "weight": 21}
    assert entry["model_info"]["max_input_tokens"] == 49152  # the window hotfit verified, not the GGUF's
    assert entry["model_info"]["supports_function_calling"] is True
    # the text form is the proxy's config.yaml, saying where the key comes from
    code, text = cli(home, "serve", "--print-client-config", "litellm", "--port", "8181",
                     "--api-key-file", str(key))
    assert code == 0 and f'export {API_KEY_ENV}="$(cat {key.resolve()})"' in text
    assert json.loads(text.split("\n", 2)[2])["model_list"][0]["litellm_params"]["api_base"] == \
        "http://127.0.0.1:8181/v1"


def test_print_client_config_openai_and_a_server_on_every_address(tmp_path: Path) -> None:
    home = provisioned(tmp_path / "home", window=65536, speed=None, passed=False)
    code, out = cli(home, "serve", "--print-client-config", "openai", "--host", "0.0.0.0")
    assert code == 0, out
    config = json.loads(out)
    assert config == {"base_url": f"http://{socket.getfqdn()}:8080/v1", "model": "fx-agent", "api_key_file": None,
                      "context_window_tokens": 65536, "supports_function_calling": False,
                      "generation_tokens_per_s": None, "machine": socket.getfqdn()}
    assert api_base("::1", 9, "m") == "http://[::1]:9/v1" and api_base("::", 9, "m") == "http://m:9/v1"


def test_print_client_config_without_a_provisioning_says_so(tmp_path: Path) -> None:
    code, out = cli(tmp_path / "empty", "--json", "serve", "--print-client-config", "openai")
    assert code == 2 and "hotfit auto" in json.loads(out)["error"]["hint"]


def test_litellm_config_orders_and_names_each_machine() -> None:
    eps = [ServedEndpoint("m2", "qwen", "http://m2:8080/v1", None, 40960, True),
           ServedEndpoint("m1", "qwen", "http://m1:8080/v1", None, 32768, True),
           ServedEndpoint("m3", "gemma", "http://m3:8080/v1", None, 65536, False)]
    config: dict[str, Any] = litellm_config(eps)
    assert [(m["model_name"], m["model_info"]["hotfit_machine"]) for m in config["model_list"]] == [
        ("gemma", "m3"), ("qwen", "m1"), ("qwen", "m2")]
    assert all(m["litellm_params"]["api_key"] == "none" for m in config["model_list"])
    assert config["router_settings"]["num_retries"] >= 1



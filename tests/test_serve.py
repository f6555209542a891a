"""hotfit serve: the verified parameters, re-checked against the device as it is now."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from hotfit.pipeline.cli import main
from hotfit.pipeline.serve import decide_window
from hotfit.pipeline.systemd_unit import UnitSpec, systemd_unit
from hotfit.core.errors import NoModelQualifies
from hotfit.pipeline.manifest import Manifest, read_manifest, write_manifest
from hotfit.planner.probe import Device, ProbeResult
from hotfit.registry.kv import parse_kv_cache_type
from hotfit.registry.select import MIN_AGENTIC_HOT_CONTEXT, device_budget, model_fit
from hotfit.stages.plan import build_plan
from tests.e2e_support import HOST_TOTAL_BYTES, GiB, write_probe, write_provisioned_home
from tests.gguf_fixtures import free_port, pinned_template, require_llama_server, tool_template_text

REPO = Path(__file__).resolve().parent.parent
F16 = parse_kv_cache_type("f16")


def probe_with(free_bytes: int, *, kind: str = "cpu", name: str = "fixture host") -> ProbeResult:
    return ProbeResult(devices=(Device(0, kind, name, HOST_TOTAL_BYTES, free_bytes),))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def provisioned(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A home as `hotfit auto` leaves it: verified model + template in place and a manifest."""
    root = tmp_path_factory.mktemp("serve")
    # the template: only the window tests read it without a server
    made = write_provisioned_home(root / "home", probe_with(8 * GiB), template_text=tool_template_text())
    assert made.plan.hot_context_tokens == 65536
    return {"home": made.home, "root": root, "entry": made.entry, "plan": made.plan, "manifest": made.manifest}


def free_for_tokens(entry, tokens: int) -> int:
    """The least free memory of the probe device at which ``entry`` holds ``tokens``."""
    lo, hi = 0, HOST_TOTAL_BYTES
    while lo < hi:
        mid = (lo + hi) // 2
        fit = model_fit(entry, device_budget("cpu", HOST_TOTAL_BYTES, mid).usable_bytes, F16)
        if fit.hot_context_tokens >= tokens:
            hi = mid
        else:
            lo = mid + 1
    return lo


def test_manifest_round_trips_the_plan(provisioned: dict) -> None:
    read = read_manifest(provisioned["home"] / "manifest.json")
    assert read.to_json() == json.loads(json.dumps(provisioned["manifest"].to_json()))
    from hotfit.pipeline.manifest import plan_from_json

    assert plan_from_json(read.plan) == provisioned["plan"]
    assert plan_from_json(read.plan).plan_id == provisioned["plan"].plan_id


def test_window_kept_while_the_device_still_holds_it(provisioned: dict) -> None:
    decision = decide_window(provisioned["manifest"], provisioned["plan"], probe_with(8 * GiB))
    assert decision.context_tokens == 65536 and not decision.replanned


def test_window_replanned_against_the_device_as_it_is_now(provisioned: dict) -> None:
    entry = provisioned["entry"]
    free = free_for_tokens(entry, 40000)
    decision = decide_window(provisioned["manifest"], provisioned["plan"], probe_with(free))
    assert decision.replanned
    assert MIN_AGENTIC_HOT_CONTEXT <= decision.context_tokens < 65536
    assert decision.context_tokens == model_fit(entry, device_budget("cpu", HOST_TOTAL_BYTES, free).usable_bytes,
                                                F16).hot_context_tokens
    assert "re-planned window" in decision.message and str(decision.context_tokens) in decision.message


def test_below_the_floor_fails_closed(provisioned: dict) -> None:
    free = free_for_tokens(provisioned["entry"], MIN_AGENTIC_HOT_CONTEXT) - 1
    with pytest.raises(NoModelQualifies) as err:
        decide_window(provisioned["manifest"], provisioned["plan"], probe_with(free))
    assert err.value.exit_code == 3 and "32768" in str(err.value)
    # exactly at the floor it still serves, at the floor
    at_floor = decide_window(provisioned["manifest"], provisioned["plan"], probe_with(free + 1))
    assert at_floor.context_tokens >= MIN_AGENTIC_HOT_CONTEXT and at_floor.replanned


def test_missing_device_fails_closed(provisioned: dict) -> None:
    other = ProbeResult(devices=(Device(0, "nvidia", "some GPU", 24 * GiB, 20 * GiB),))
    with pytest.raises(NoModelQualifies):
        decide_window(provisioned["manifest"], provisioned["plan"], other)


def run_cli(home: Path, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(["--home", str(home), "--log-format", "json", "serve", *args], out=out)
    return code, out.getvalue()


def test_print_command_uses_the_verified_parameters(provisioned: dict, tmp_path: Path) -> None:
    require_llama_server()
    home = provisioned["home"]
    code, out = run_cli(home, "--print-command", "--json", "--port", "9999",
                        "--probe-file", str(write_probe(tmp_path / "p.json", 8 * GiB)))
    assert code == 0
    data = json.loads(out)
    argv = data["argv"]
    assert data["replanned"] is False and data["context_tokens"] == 65536
    assert argv[argv.index("-c") + 1] == "65536" and argv[argv.index("-ctk") + 1] == "f16"
    assert argv[argv.index("-m") + 1] == provisioned["manifest"].model_path
    assert argv[argv.index("--chat-template-file") + 1] == provisioned["manifest"].template_path
    assert argv[argv.index("--port") + 1] == "9999" and argv[argv.index("-np") + 1] == "1"
    assert "--api-key" not in argv  # never a key in argv

    tight = write_probe(tmp_path / "tight.json", free_for_tokens(provisioned["entry"], 40000))
    code, out = run_cli(home, "--print-command", "--json", "--probe-file", str(tight))
    data = json.loads(out)
    assert code == 0 and data["replanned"] is True and 32768 <= data["context_tokens"] < 65536
    assert data["argv"][data["argv"].index("-c") + 1] == str(data["context_tokens"])


def test_systemd_unit_runs_hotfit_serve(provisioned: dict) -> None:
    code, out = run_cli(provisioned["home"], "--print-systemd-unit", "--port", "8181")
    assert code == 0
    exec_line = next(line for line in out.splitlines() if line.startswith("ExecStart="))
    assert " serve " in exec_line and "--port 8181" in exec_line and str(provisioned["home"]) in exec_line
    assert "Environment=CONTENOX_LLAMA_KV_CACHE_TYPE=f16" in out
    assert "RestartPreventExitStatus=2 3 5" in out
    unit = systemd_unit(UnitSpec(["/usr/bin/hotfit", "serve"], {"A": "b c"}, "x", user="hotfit",
                                 home=Path("/var/lib/hotfit"), device_kind="cpu"))
    assert 'Environment="A=b c"' in unit  # one word, as systemd.syntax quotes it


def test_nothing_provisioned_is_a_usage_error(tmp_path: Path) -> None:
    code, _ = run_cli(tmp_path / "empty", "--print-command")
    assert code == 2


def test_missing_model_file_is_reported(provisioned: dict, tmp_path: Path) -> None:
    home = tmp_path / "home"
    manifest = provisioned["manifest"]
    broken = Manifest(**{**manifest.__dict__, "model_path": str(tmp_path / "gone.gguf")})
    write_manifest(home / "manifest.json", broken)
    code, _ = run_cli(home, "--print-command")
    assert code == 2


@pytest.mark.llama
def test_serve_starts_llama_server_with_the_window(provisioned: dict, tmp_path: Path) -> None:
    require_llama_server()
    pinned_template()  # the real server renders the provisioned template: the pinned one must be there
    port = free_port()
    probe = write_probe(tmp_path / "p.json", 8 * GiB)
    proc = subprocess.Popen([sys.executable, "-m", "hotfit", "--home", str(provisioned["home"]), "--log-format",
                             "json", "serve", "--port", str(port), "--probe-file", str(probe)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        props = None
        while time.monotonic() < deadline and props is None:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/props", timeout=2) as resp:
                    props = json.loads(resp.read())
            except OSError:
                time.sleep(0.1)
        assert props is not None, "llama-server did not come up"
        assert props["default_generation_settings"]["n_ctx"] == 65536
        # serve exec'd llama-server: the process we started *is* the server, so signals reach it
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[0].endswith(b"llama-server")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode is not None


_GOOD_TOP = {"schema": 1, "run_id": "r", "plan_id": "p", "written_at": "w", "entry_name": "e",
             "kv_cache_type": "f16", "planned_hot_context_tokens": 1}


@pytest.mark.parametrize("text", [
    "[]", "null", '"x"', "{bad",
    json.dumps({**_GOOD_TOP, "model_path": None}),
    json.dumps({**_GOOD_TOP, "model_path": "/m.gguf", "measured": [1]}),
    json.dumps({**_GOOD_TOP, "model_path": "/m.gguf", "template_path": 7}),
])
def test_malformed_manifest_is_none_for_auto_and_a_clear_error_for_serve(tmp_path: Path, text: str) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "manifest.json").write_text(text)
    assert read_manifest(home / "manifest.json") is None  # auto provisions afresh, no crash
    out = io.StringIO()
    code = main(["--home", str(home), "--log-format", "json", "serve", "--json", "--print-command"], out=out)
    assert code == 2
    error = json.loads(out.getvalue())["error"]
    assert "manifest.json" in error["message"] and "unreadable" in error["message"]
    assert "hotfit auto" in error["hint"]


def test_manifest_without_a_usable_plan_is_a_clear_error(provisioned: dict, tmp_path: Path) -> None:
    home = tmp_path / "home"
    manifest = provisioned["manifest"]
    write_manifest(home / "manifest.json", Manifest(**{**manifest.__dict__, "plan": {"entry": {}}}))
    out = io.StringIO()
    code = main(["--home", str(home), "--log-format", "json", "serve", "--json", "--print-command"], out=out)
    assert code == 2
    assert "hotfit auto" in json.loads(out.getvalue())["error"]["hint"]


def test_template_edited_after_verification_is_not_in_place(provisioned: dict, tmp_path: Path) -> None:
    """The manifest names the sha256 of the verified template; an edited one must not pass as
    provisioned (auto's fast no-op and serve both rely on files_in_place)."""
    import hashlib

    manifest = provisioned["manifest"]
    template = tmp_path / "chat_template.jinja"
    template.write_text("{{ tools }}<tool_call>")
    digest = hashlib.sha256(template.read_bytes()).hexdigest()
    pinned = Manifest(**{**manifest.__dict__, "template_path": str(template), "template_sha256": digest})
    write_manifest(tmp_path / "manifest.json", pinned)
    again = read_manifest(tmp_path / "manifest.json")
    assert again.template_sha256 == digest and again.files_in_place() == []
    template.write_text("{{ messages }} prose only")
    assert any("chat template" in p for p in again.files_in_place())


# ----------------------------------------------------------------------------- device pinning


GPU_UUID = "GPU-8a1c2f0e-0000-4000-8000-000000000001"


@pytest.fixture(scope="module")
def nvidia_home(provisioned: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A home provisioned for the second of two NVIDIA cards, planned from a saved probe file."""
    root = tmp_path_factory.mktemp("serve-nvidia")
    probe_path = root / "probe.json"
    probe = ProbeResult(devices=(
        Device(0, "nvidia", "small card", 4 * GiB, 3 * GiB, uuid="GPU-00000000-small"),
        Device(1, "nvidia", "big card", 24 * GiB, 20 * GiB, uuid=GPU_UUID),
        Device(2, "cpu", "host memory", 8 * GiB, 2 * GiB),
    ))
    probe_path.write_text(json.dumps(probe.to_json()))
    from hotfit.stages.probe import load_probe_file

    plan = build_plan(load_probe_file(probe_path), [provisioned["entry"]], F16).plan
    assert plan is not None and plan.placement.device.uuid == GPU_UUID
    home = root / "home"
    m = provisioned["manifest"]
    write_manifest(home / "manifest.json", Manifest(**{**m.__dict__, "plan_id": plan.plan_id, "plan": plan.to_json()}))
    return {"home": home, "plan": plan, "probe": probe_path}


def test_serve_and_load_pin_the_verified_nvidia_card_through_one_function(nvidia_home: dict,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    binary = require_llama_server()
    import hotfit.backends.llama_server.backend
    import hotfit.backends.llama_server.discovery
    from hotfit.backends.llama_server.flags import child_env, new_api_key

    # Stand-in: this machine has only the CPU build, which serve rightly refuses for an nvidia
    # plan (and which sees no NVIDIA card: the device check refuses it too); the pinning under test
    # does not depend on the build, so both checks are waived here (tests/test_device_check.py has its own).
    monkeypatch.setattr(hotfit.backends.llama_server.discovery, "compatibility_problem", lambda *a, **k: None)
    monkeypatch.setattr(hotfit.backends.llama_server.backend, "check_planned_device", lambda *a, **k: None)
    monkeypatch.setenv("HOTFIT_LLAMA_SERVER", str(binary))

    load_env = child_env(nvidia_home["plan"], new_api_key(), {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0"})
    assert load_env["CUDA_VISIBLE_DEVICES"] == GPU_UUID  # the uuid, whatever the caller had

    code, out = run_cli(nvidia_home["home"], "--print-command", "--json", "--probe-file", str(nvidia_home["probe"]))
    assert code == 0, out
    data = json.loads(out)
    assert data["env"] == {"CUDA_VISIBLE_DEVICES": GPU_UUID}
    code, text = run_cli(nvidia_home["home"], "--print-command", "--probe-file", str(nvidia_home["probe"]))
    assert code == 0 and text.startswith(f"env CUDA_VISIBLE_DEVICES={GPU_UUID} ")

    code, unit = run_cli(nvidia_home["home"], "--print-systemd-unit")
    assert code == 0 and f"Environment=CUDA_VISIBLE_DEVICES={GPU_UUID}" in unit


def test_child_env_strips_overrides_and_a_stale_key_and_pins_nothing_for_the_host(provisioned: dict) -> None:
    from hotfit.backends.llama_server.flags import API_KEY_ENV, child_env

    base = {"PATH": "/bin", "LLAMA_ARG_CTX_SIZE": "4096", "LLAMA_API_KEY": "stale"}
    assert child_env(provisioned["plan"], None, base) == {"PATH": "/bin"}  # serve: key from --api-key-file
    assert child_env(provisioned["plan"], "k-hfk", base) == {"PATH": "/bin", API_KEY_ENV: "k-hfk"}

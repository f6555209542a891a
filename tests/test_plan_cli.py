"""stages.plan and ``hotfit plan``: the frozen Plan, the --json document, exit codes, and the
spec's claims run end to end against the bundled registry with saved probe files."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest

from hotfit.pipeline.cli import main
from hotfit.core.errors import UsageError
from hotfit.planner.probe import Device, ProbeResult
from hotfit.pipeline.registry_file import load_registry
from hotfit.registry.catalog import Registry
from hotfit.registry.kv import KV_CACHE_TYPES
from hotfit.registry.select import MIN_AGENTIC_HOT_CONTEXT, reserve_bytes
from hotfit.pipeline.cli.render import plan_text as describe
from hotfit.planner.document import outcome_json
from hotfit.stages.plan import build_plan, resolve_kv_cache_type
from tests.entries import MINICPM5_2B, GiB, entry

TIER = "unit"

F16 = KV_CACHE_TYPES["f16"]


def probe_of(total: int, free: int, kind: str = "nvidia", name: str = "Test GPU") -> ProbeResult:
    return ProbeResult(devices=(Device(0, kind, name, total, free),))  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- stages.plan (pure)


def test_build_plan_makes_a_frozen_plan_with_a_stable_id() -> None:
    probe = probe_of(6 * GiB, 56 * GiB // 10)
    out = build_plan(probe, [MINICPM5_2B], F16, "default")
    plan = out.plan
    assert plan is not None and plan.entry.name == "minicpm5-2b"
    assert plan.kv_cache_type == "f16" and plan.kv_cache_type_source == "default"
    b = plan.budget
    assert b.usable_bytes == b.free_bytes - b.reserve_bytes - b.headroom_bytes
    assert b.kv_budget_bytes == b.usable_bytes - b.weights_bytes - b.allowance_bytes
    assert plan.hot_context_tokens == b.hot_context_tokens >= MIN_AGENTIC_HOT_CONTEXT
    assert 0 < plan.estimated_kv_bytes <= b.kv_budget_bytes
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.hot_context_tokens = 1  # type: ignore[misc]
    again = build_plan(probe, [MINICPM5_2B], F16, "default").plan
    assert again is not None and again.plan_id == plan.plan_id
    # A different KV type is a different plan.
    q8 = build_plan(probe, [MINICPM5_2B], KV_CACHE_TYPES["q8_0"], "flag").plan
    assert q8 is not None and q8.plan_id != plan.plan_id


def test_outcome_json_shape_and_refusal() -> None:
    out = build_plan(probe_of(4 * GiB, 2 * GiB), [MINICPM5_2B, entry("tc", tier="tool-chat", params_b=0.8,
                                                                     weights=500_000_000)], F16)
    data = outcome_json(out)
    assert out.plan is None and data["selected"] is None
    assert {"kv_cache_type", "budget", "selected", "candidates", "error"} <= set(data)
    assert all({"name", "verdict", "reason", "hot_context"} <= set(c) for c in data["candidates"])
    err = data["error"]
    assert err["code"] == "no_model_qualifies" and err["smallest"]["name"] == "minicpm5-2b"
    assert isinstance(err["smallest"]["required_free_bytes"], int) and err["alternatives"]
    assert "minicpm5-2b" in describe(out)


def test_kv_cache_type_resolution() -> None:
    assert resolve_kv_cache_type(None, None) == (F16, "default")
    assert resolve_kv_cache_type(None, "q8_0") == (KV_CACHE_TYPES["q8_0"], "env")
    assert resolve_kv_cache_type("q4_0", "q8_0") == (KV_CACHE_TYPES["q4_0"], "flag")
    with pytest.raises(UsageError, match="CONTENOX_LLAMA_KV_CACHE_TYPE"):
        resolve_kv_cache_type(None, "fp8")
    with pytest.raises(UsageError, match="--kv-cache-type"):
        resolve_kv_cache_type("q3", None)


# ----------------------------------------------------------------------------- the CLI, bundled registry


def load_bundled() -> Registry:
    return load_registry()


def write_probe(tmp_path: Path, total: int, free: int, kind: str = "nvidia") -> Path:
    path = tmp_path / f"probe-{kind}-{total}-{free}.json"
    path.write_text(json.dumps({"schema": 1, "devices": [
        {"index": 0, "kind": kind, "name": "Test GPU", "total_bytes": total, "free_bytes": free}], "selected": 0}))
    return path


def plan_cli(*argv: str) -> tuple[int, dict]:
    out = io.StringIO()
    rc = main(["plan", "--json", *argv], out=out)
    return rc, json.loads(out.getvalue())


@pytest.fixture(autouse=True)
def _home(hotfit_home: Path) -> None:
    """Every test here runs with its own HOTFIT_HOME (the CLI writes its event log there)."""


def test_spec_small_device_class_end_to_end(tmp_path: Path) -> None:
    # Spec: a 6 GiB card with 5.6 GiB free picks minicpm5-2b with ~75K f16 tokens.
    rc, data = plan_cli("--probe-file", str(write_probe(tmp_path, 6 * GiB, 56 * GiB // 10)))
    assert rc == 0 and data["error"] is None
    assert data["kv_cache_type"] == "f16"
    assert data["selected"]["name"] == "minicpm5-2b"
    assert 70_000 <= data["selected"]["hot_context"] <= 80_000
    b = data["budget"]
    for key in ("free_bytes", "reserve_bytes", "headroom_bytes", "usable_bytes", "weights_bytes",
                "allowance_bytes", "kv_budget_bytes", "hot_context_tokens"):
        assert isinstance(b[key], int), key
    names = {c["name"] for c in data["candidates"]}
    assert {e.name for e in load_bundled().entries} == names  # every candidate listed
    # The unverified nanbeige stays listed, excluded with its reason.
    nan = next(c for c in data["candidates"] if c["name"].startswith("nanbeige"))
    assert nan["verdict"] == "excluded" and nan["reason"]


def test_no_fit_exits_3_with_the_error_object_and_the_number_is_exact(tmp_path: Path) -> None:
    total = 4 * GiB
    rc, data = plan_cli("--origin", "china", "--probe-file", str(write_probe(tmp_path, total, 3 * GiB)))
    assert rc == 3 and data["selected"] is None
    err = data["error"]
    assert err["code"] == "no_model_qualifies"
    assert err["smallest"]["name"] == "minicpm5-2b"
    msg = err["message"]
    for needle in ("origin china", "backend llama", "f16", "minicpm5-2b", "weights", "runtime allowance",
                   "KV for 32768 tokens", "reserve", "headroom"):
        assert needle in msg
    alts = " ".join(err["alternatives"])
    assert "raise the memory budget" in alts and "another origin" in alts and "hosted backend" in alts
    need = err["smallest"]["required_free_bytes"]
    assert need <= total
    rc, ok = plan_cli("--origin", "china", "--probe-file", str(write_probe(tmp_path, total, need)))
    assert rc == 0 and ok["selected"]["name"] == "minicpm5-2b"
    assert ok["selected"]["hot_context"] >= MIN_AGENTIC_HOT_CONTEXT
    rc, short = plan_cli("--origin", "china", "--probe-file", str(write_probe(tmp_path, total, need - 1)))
    assert rc == 3 and short["selected"] is None


def test_kv_type_from_env_and_flag_and_unknown_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    probe = str(write_probe(tmp_path, 12 * GiB, 12 * GiB))
    rc, f16 = plan_cli("--probe-file", probe)
    monkeypatch.setenv("CONTENOX_LLAMA_KV_CACHE_TYPE", "q8_0")
    rc2, q8 = plan_cli("--probe-file", probe)
    assert rc == rc2 == 0 and q8["kv_cache_type"] == "q8_0" and q8["kv_cache_type_source"] == "env"
    same = f16["selected"]["name"]
    c16 = next(c for c in f16["candidates"] if c["name"] == same)
    c8 = next(c for c in q8["candidates"] if c["name"] == same)
    assert c8["hot_context"] >= c16["hot_context"]
    rc, flag = plan_cli("--probe-file", probe, "--kv-cache-type", "f16")
    assert rc == 0 and flag["kv_cache_type"] == "f16" and flag["kv_cache_type_source"] == "flag"
    monkeypatch.setenv("CONTENOX_LLAMA_KV_CACHE_TYPE", "q7")
    out = io.StringIO()
    assert main(["plan", "--json", "--probe-file", probe], out=out) == 2
    err = json.loads(out.getvalue())["error"]
    assert "q7" in err["message"] and "q8_0" in err["message"] and "f16" in err["message"]


def test_origin_errors_and_isolation(tmp_path: Path) -> None:
    probe = str(write_probe(tmp_path, 80 * GiB, 80 * GiB))
    out = io.StringIO()
    assert main(["plan", "--json", "--probe-file", probe, "--origin", "mars"], out=out) == 2
    assert "us, eu, china, gus" in json.loads(out.getvalue())["error"]["message"]
    rc, gus = plan_cli("--probe-file", probe, "--origin", "gus")
    assert rc == 3 and gus["error"]["smallest"] is None and "at any budget" in gus["error"]["message"]
    host = str(write_probe(tmp_path, 80 * GiB, 80 * GiB, kind="cpu"))  # OpenVINO serves host memory only
    rc, eu_ov = plan_cli("--probe-file", host, "--origin", "eu", "--backend", "openvino")
    assert rc == 3 and eu_ov["selected"] is None
    for origin in ("us", "eu", "china"):
        rc, data = plan_cli("--probe-file", probe, "--origin", origin)
        assert rc == 0 and data["selected"]["origin"] == origin


def test_previous_is_kept_and_tool_chat_never_picked(tmp_path: Path) -> None:
    probe = str(write_probe(tmp_path, 48 * GiB, 48 * GiB))
    rc, fresh = plan_cli("--probe-file", probe, "--origin", "china")
    assert rc == 0 and fresh["selected"]["name"] != "qwen3.5-4b"
    rc, kept = plan_cli("--probe-file", probe, "--origin", "china", "--previous", "qwen3.5-4b")
    assert rc == 0 and kept["selected"]["name"] == "qwen3.5-4b" and kept["selected"]["reused_previous"]
    smoke = next(c for c in fresh["candidates"] if c["name"] == "qwen3.5-0.8b")
    assert smoke["verdict"] == "excluded" and "tier" in smoke["reason"]
    assert smoke["hot_context"] >= fresh["selected"]["hot_context"]  # the larger window, still not picked


def test_human_output_lists_candidates_budget_and_kv_type(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    rc = main(["plan", "--probe-file", str(write_probe(tmp_path, 8 * GiB, 8 * GiB))], out=out)
    text = out.getvalue()
    assert rc == 0
    assert "KV cache f16" in text and "usable" in text and "reserve" in text and "headroom" in text
    for e in load_bundled().entries:
        assert e.name in text


def test_bad_probe_file_is_a_usage_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": 1, "devices": [{"index": 0, "kind": "gpu", "name": "x",
                                                         "total_bytes": 1, "free_bytes": 1}], "selected": 0}))
    out = io.StringIO()
    assert main(["plan", "--json", "--probe-file", str(bad)], out=out) == 2
    msg = json.loads(out.getvalue())["error"]["message"]
    assert str(bad) in msg and "devices[0].kind" in msg


def test_host_memory_probe_plans_with_the_host_reserve(tmp_path: Path) -> None:
    total = 32 * GiB
    rc, data = plan_cli("--probe-file", str(write_probe(tmp_path, total, 20 * GiB, kind="cpu")))
    assert rc == 0 and data["budget"]["reserve_bytes"] == reserve_bytes("cpu", total)


# ----------------------------------------------------------------------------- every device planned


def probe_many(*devices: tuple[str, int, int], selected: int = 0) -> ProbeResult:
    return ProbeResult(devices=tuple(
        Device(i, kind, f"{kind} {i}" if kind != "cpu" else "host memory", total, free)  # type: ignore[arg-type]
        for i, (kind, total, free) in enumerate(devices)))


def write_probe_many(tmp_path: Path, probe: ProbeResult) -> Path:
    path = tmp_path / "probe-many.json"
    path.write_text(json.dumps(probe.to_json()))
    return path


def test_small_gpu_beside_large_host_memory_plans_the_host(tmp_path: Path) -> None:
    # Seen: a 2 GiB GPU beside 32 GiB of RAM refused everything, the host never being planned.
    probe = probe_many(("nvidia", 2 * GiB, 2 * GiB), ("cpu", 32 * GiB, 30 * GiB))
    rc, data = plan_cli("--probe-file", str(write_probe_many(tmp_path, probe)))
    assert rc == 0 and data["error"] is None
    assert data["device"]["kind"] == "cpu" and data["device"]["index"] == 1
    considered = {d["index"]: d for d in data["devices"]}
    assert set(considered) == {0, 1}
    assert considered[0]["selected"] is None and considered[0]["refusal"]
    assert considered[1]["selected"] == data["selected"]["name"] and considered[1]["won"] is True
    assert considered[0]["won"] is False and data["device_choice"]
    # The small GPU's refusal names the host plan that fits, and how to force it.
    assert data["selected"]["name"] in considered[0]["refusal"] and "--device cpu" in considered[0]["refusal"]
    # GPU and host memory are never added: each device's budget is its own.
    assert considered[1]["budget"]["free_bytes"] == 30 * GiB and considered[0]["budget"]["free_bytes"] == 2 * GiB


def test_the_plan_is_pinned_to_the_winning_device_and_its_id_covers_that_device() -> None:
    entries = load_bundled().entries
    probe = probe_many(("nvidia", 2 * GiB, 2 * GiB), ("cpu", 32 * GiB, 30 * GiB))
    out = build_plan(probe, entries, F16)
    assert out.plan is not None and out.plan.placement.device.index == 1 and out.plan.placement.device.kind == "cpu"
    assert out.plan.probe.devices == probe.devices  # every device still on record
    alone = build_plan(probe_many(("cpu", 32 * GiB, 30 * GiB)), entries, F16).plan
    assert alone is not None and alone.entry.name == out.plan.entry.name
    assert alone.plan_id == out.plan.plan_id  # the decision (entry, KV, window, device), not the device list


def test_the_larger_model_wins_across_devices_and_ties_go_to_the_accelerator() -> None:
    entries = load_bundled().entries
    bigger_host = build_plan(probe_many(("nvidia", 8 * GiB, 8 * GiB), ("cpu", 64 * GiB, 60 * GiB)), entries, F16)
    gpu_only = build_plan(probe_many(("nvidia", 8 * GiB, 8 * GiB)), entries, F16).plan
    host_only = build_plan(probe_many(("cpu", 64 * GiB, 60 * GiB)), entries, F16).plan
    assert gpu_only is not None and host_only is not None
    assert host_only.entry.params_total_b > gpu_only.entry.params_total_b
    assert bigger_host.plan is not None and bigger_host.plan.entry.name == host_only.entry.name
    assert bigger_host.plan.placement.device.kind == "cpu"
    # Same memory on both: the same model and window; the accelerator takes the tie.
    same = build_plan(probe_many(("cpu", 24 * GiB, 20 * GiB), ("amd", 24 * GiB, 20 * GiB)), entries, F16)
    per = {d.device.index: d for d in same.devices}
    assert per[0].chosen_name == per[1].chosen_name
    assert same.plan is not None and same.plan.placement.device.kind == "amd"
    assert "accelerator" in same.device_choice


def test_previous_model_is_kept_on_its_device_while_it_qualifies_there() -> None:
    from hotfit.planner.devices import PreviousModel

    entries = load_bundled().entries
    probe = probe_many(("nvidia", 8 * GiB, 8 * GiB), ("cpu", 64 * GiB, 60 * GiB))
    gpu_pick = build_plan(probe_many(("nvidia", 8 * GiB, 8 * GiB)), entries, F16).plan
    assert gpu_pick is not None
    kept = build_plan(probe, entries, F16, previous=PreviousModel(gpu_pick.entry.name, probe.devices[0]))
    assert kept.plan is not None and kept.plan.reused_previous
    assert kept.plan.entry.name == gpu_pick.entry.name and kept.plan.placement.device.kind == "nvidia"
    assert "previous" in kept.device_choice
    # The GPU is gone from the probe: the previous model's device no longer exists, select afresh.
    host = probe_many(("cpu", 64 * GiB, 60 * GiB))
    fresh = build_plan(host, entries, F16, previous=PreviousModel(gpu_pick.entry.name, probe.devices[0]))
    assert fresh.plan is not None and not fresh.plan.reused_previous


@pytest.mark.parametrize("choice, kind, index", [("cpu", "cpu", 1), ("nvidia", "nvidia", 0), ("0", "nvidia", 0),
                                                 ("1", "cpu", 1), ("NVIDIA", "nvidia", 0)])
def test_device_flag_forces_a_device(tmp_path: Path, choice: str, kind: str, index: int) -> None:
    probe = probe_many(("nvidia", 24 * GiB, 22 * GiB), ("cpu", 32 * GiB, 30 * GiB))
    rc, data = plan_cli("--probe-file", str(write_probe_many(tmp_path, probe)), "--device", choice)
    assert rc == 0 and data["device"]["kind"] == kind and data["device"]["index"] == index
    assert [d["index"] for d in data["devices"] if d["considered"]] == [index]


@pytest.mark.parametrize("choice", ["gpu", "7", "amd", "-1", ""])
def test_a_bad_device_is_a_usage_error_naming_the_choices(tmp_path: Path, choice: str) -> None:
    probe = probe_many(("nvidia", 24 * GiB, 22 * GiB), ("cpu", 32 * GiB, 30 * GiB))
    out = io.StringIO()
    rc = main(["plan", "--json", "--probe-file", str(write_probe_many(tmp_path, probe)), "--device", choice], out=out)
    assert rc == 2
    err = json.loads(out.getvalue())["error"]
    assert "--device" in err["message"] and "nvidia" in err["message"] and "cpu" in err["message"]
    assert "0" in err["message"] and "1" in err["message"]


def test_a_forced_small_gpu_refusal_names_the_host_plan_and_how_to_force_it(tmp_path: Path) -> None:
    probe = probe_many(("nvidia", 2 * GiB, 2 * GiB), ("cpu", 32 * GiB, 30 * GiB))
    rc, data = plan_cli("--probe-file", str(write_probe_many(tmp_path, probe)), "--device", "nvidia")
    assert rc == 3 and data["selected"] is None
    host_pick = build_plan(probe_many(("cpu", 32 * GiB, 30 * GiB)), load_bundled().entries, F16).plan
    msg = data["error"]["message"]
    assert "host memory" in msg and host_pick.entry.name in msg and "--device cpu" in msg
    assert any("--device cpu" in a for a in data["error"]["alternatives"])


def test_every_device_refusing_reports_each_device(tmp_path: Path) -> None:
    probe = probe_many(("nvidia", 2 * GiB, 2 * GiB), ("cpu", 4 * GiB, 2 * GiB))
    rc, data = plan_cli("--probe-file", str(write_probe_many(tmp_path, probe)))
    assert rc == 3
    msg = data["error"]["message"]
    assert "nvidia 0" in msg and "host memory" in msg
    assert all(d["refusal"] for d in data["devices"])


def test_auto_takes_the_device_flag_too(tmp_path: Path) -> None:
    probe = str(write_probe_many(tmp_path, probe_many(("nvidia", 24 * GiB, 22 * GiB), ("cpu", 32 * GiB, 30 * GiB))))
    out = io.StringIO()
    assert main(["auto", "--dry-run", "--json", "--probe-file", probe, "--device", "cpu"], out=out) == 0
    data = json.loads(out.getvalue())
    assert data["device"]["kind"] == "cpu" and data["plan"]["placement"] == {"devices": [1], "split": "none"}
    assert data["plan"]["probe"]["selected"] == 1  # what a reader of schema-1 plans takes for the device
    out = io.StringIO()
    assert main(["auto", "--dry-run", "--json", "--probe-file", probe, "--device", "tpu"], out=out) == 2
    assert "--device" in json.loads(out.getvalue())["error"]["message"]


# ----------------------------------------------------------------------------- only devices the backend serves


def test_openvino_is_never_planned_on_a_gpu_it_cannot_serve(tmp_path: Path) -> None:
    # Seen: `auto --backend openvino` beside an NVIDIA GPU planned qwen3-8b-ov on the GPU (GPU and
    # host tie on model and window, the accelerator wins) and the preflight then refused it, exit 5.
    probe = probe_many(("nvidia", 24 * GiB, 22 * GiB), ("cpu", 24 * GiB, 22 * GiB))
    out = build_plan(probe, load_bundled().entries, KV_CACHE_TYPES["q8_0"], backend="openvino")
    assert out.plan is not None and out.plan.placement.device.kind == "cpu"
    assert out.plan.entry.backend == "openvino"
    gpu = next(dp for dp in out.devices if dp.device.kind == "nvidia")
    assert gpu.selection is None and not gpu.considered and gpu.unserved and "openvino" in gpu.unserved
    # The llama backend still plans the GPU: the rule is the backend's, not the device's.
    llama = build_plan(probe, load_bundled().entries, KV_CACHE_TYPES["q8_0"], backend="llama")
    assert llama.plan is not None and llama.plan.placement.device.kind == "nvidia" and "accelerator" in llama.device_choice
    rc, data = plan_cli("--probe-file", str(write_probe_many(tmp_path, probe)), "--backend", "openvino")
    assert rc == 0 and data["device"]["kind"] == "cpu" and data["selected"]["backend"] == "openvino"
    row = {d["kind"]: d for d in data["devices"]}
    assert row["nvidia"]["served"] is False and row["nvidia"]["considered"] is False
    assert "openvino backend cannot run a model on [0] nvidia" in row["nvidia"]["refusal"]
    assert row["cpu"]["served"] is True and row["cpu"]["won"] is True


def test_auto_with_openvino_beside_a_gpu_plans_host_memory_and_its_preflight_accepts_it(tmp_path: Path) -> None:
    probe = str(write_probe_many(tmp_path, probe_many(("nvidia", 24 * GiB, 22 * GiB), ("cpu", 32 * GiB, 30 * GiB))))
    out = io.StringIO()
    assert main(["auto", "--dry-run", "--json", "--probe-file", probe, "--backend", "openvino"], out=out) == 0
    data = json.loads(out.getvalue())
    assert data["device"]["kind"] == "cpu" and data["plan"]["placement"] == {"devices": [1], "split": "none"}
    assert data["plan"]["probe"]["selected"] == 1  # what a reader of schema-1 plans takes for the device


@pytest.mark.parametrize("choice", ["nvidia", "0"])
def test_forcing_a_device_the_backend_cannot_serve_is_a_usage_error(tmp_path: Path, choice: str) -> None:
    probe = str(write_probe_many(tmp_path, probe_many(("nvidia", 24 * GiB, 22 * GiB), ("cpu", 32 * GiB, 30 * GiB))))
    out = io.StringIO()
    assert main(["plan", "--json", "--probe-file", probe, "--backend", "openvino", "--device", choice], out=out) == 2
    err = json.loads(out.getvalue())["error"]
    assert "openvino backend cannot run a model on [0] nvidia" in err["message"]
    assert "--device cpu" in err["hint"]


def test_a_probe_without_a_device_the_backend_serves_is_a_usage_error(tmp_path: Path) -> None:
    probe = str(write_probe(tmp_path, 24 * GiB, 22 * GiB, kind="amd"))
    out = io.StringIO()
    assert main(["plan", "--json", "--probe-file", probe, "--backend", "openvino"], out=out) == 2
    assert "serves cpu devices" in json.loads(out.getvalue())["error"]["message"]


def test_every_backend_names_the_device_kinds_it_serves() -> None:
    from hotfit.backends.openvino.config import OPENVINO_DEVICES
    from hotfit.backends.select import BACKENDS
    from hotfit.registry.select import DEVICE_KINDS

    assert BACKENDS["llama"].device_kinds == DEVICE_KINDS
    assert BACKENDS["openvino"].device_kinds == frozenset(OPENVINO_DEVICES) == {"cpu"}

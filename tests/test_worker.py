"""pipeline.worker: the served model is judged with its own worker's memory.

Pure tables for the judgement; the record checks run against real processes (this one, a dead
one). The end-to-end run with the real llama-server is in tests/test_serve_worker_e2e.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hotfit.pipeline.manifest import Manifest
from hotfit.planner.probe import Device, ProbeResult
from hotfit.pipeline.worker import (
    WorkerFacts,
    WorkerRecord,
    find_worker,
    previous_device_free,
    process_start_ticks,
    read_worker_record,
    stale_reason,
    worker_held_bytes,
    write_worker_record,
)
from hotfit.registry.kv import KV_CACHE_TYPES, LayerKVProfile, kv_bytes, layer_profile
from hotfit.core.entry import LayerGroup
from hotfit.registry.select import MAX_HOT_CONTEXT_TOKENS, runtime_allowance
from hotfit.planner.devices import PreviousModel, available_with_worker
from hotfit.stages.plan import build_plan
from tests.entries import GiB, MiB, entry

TIER = "unit"

F16 = KV_CACHE_TYPES["f16"]


BIG = entry("big-agent", params_b=26.0, weights=12 * GiB, groups=(LayerGroup(32, 4, 128, 128),),
            context_limit=262144)
SMALL = entry("small-agent", params_b=2.0, weights=1 * GiB, groups=(LayerGroup(16, 4, 128, 128),),
              context_limit=262144)
CARD = Device(0, "nvidia", "24 GiB card", 24 * GiB, 24 * GiB, uuid="GPU-card")


def probe_free(free: int, *, processes_used: int | None = None) -> ProbeResult:
    return ProbeResult(devices=(Device(0, "nvidia", "24 GiB card", 24 * GiB, free, uuid="GPU-card",
                                       processes_used_bytes=processes_used),
                                Device(1, "cpu", "host memory", 8 * GiB, 2 * GiB)))


def manifest_for(plan, *, opened: int, actual_kv: int | None, ratio: float | None = None) -> Manifest:
    return Manifest(
        run_id="r1", plan_id=plan.plan_id, written_at="2026-12-01T00:00:00Z", entry_name=plan.entry.name,
        model_path="/models/big-agent.gguf", model_size_bytes=plan.entry.weights_bytes, model_sha256=None,
        template_path=None, projector_path=None, kv_cache_type=plan.kv_cache_type,
        planned_hot_context_tokens=plan.hot_context_tokens,
        measured={"opened_context_tokens": opened, "actual_kv_bytes": actual_kv, "kv_ratio": ratio},
        probe_verdict={"passed": True}, backend_build={}, device={}, plan=plan.to_json())


@pytest.fixture(scope="module")
def provisioned() -> tuple:
    plan = build_plan(probe_free(24 * GiB), [BIG, SMALL], F16).plan
    assert plan is not None and plan.entry.name == "big-agent" and plan.placement.device.uuid == "GPU-card"
    return plan, manifest_for(plan, opened=plan.hot_context_tokens, actual_kv=plan.estimated_kv_bytes + 5 * MiB)


def facts(opened: int, kv_type: str = "f16") -> WorkerFacts:
    record = WorkerRecord(pid=1, start_ticks=1, host="127.0.0.1", port=1, model_path="/models/big-agent.gguf",
                          entry_name="big-agent", context_tokens=opened, kv_cache_type=kv_type, device={})
    return WorkerFacts(record, opened, "props")


# ----------------------------------------------------------------------------- the judgement (pure)


@pytest.mark.parametrize("free, total, held, processes_used, expected", [
    (5 * GiB, 24 * GiB, 18 * GiB, None, 23 * GiB),       # the worker's memory is counted as available
    (5 * GiB, 24 * GiB, 30 * GiB, None, 24 * GiB),       # never beyond the device's total …
    (20 * GiB, 24 * GiB, 18 * GiB, None, 24 * GiB),      # … nor beyond what is in use (4 GiB here)
    (5 * GiB, 24 * GiB, 18 * GiB, 10 * GiB, 15 * GiB),   # nor beyond what the processes on it hold (NVML)
    (5 * GiB, 24 * GiB, 0, None, 5 * GiB),               # no worker: the probe as it is
])
def test_available_with_worker(free: int, total: int, held: int, processes_used: int | None, expected: int) -> None:
    device = Device(0, "nvidia", "card", total, free, processes_used_bytes=processes_used)
    assert available_with_worker(device, held) == expected


def test_held_bytes_use_the_measured_kv_of_the_verified_window(provisioned: tuple) -> None:
    plan, manifest = provisioned
    weights = BIG.weights_bytes
    assert weights is not None
    held = worker_held_bytes(manifest, facts(manifest.opened_context_tokens))
    assert held == weights + manifest.measured["actual_kv_bytes"] + runtime_allowance(weights)


def test_held_bytes_of_a_replanned_window_are_the_estimate_scaled_by_the_measured_ratio(provisioned: tuple) -> None:
    plan, manifest = provisioned
    m = manifest_for(plan, opened=plan.hot_context_tokens, actual_kv=None, ratio=1.5)
    profile = layer_profile(BIG, MAX_HOT_CONTEXT_TOKENS)
    assert isinstance(profile, LayerKVProfile) and BIG.weights_bytes is not None
    held = worker_held_bytes(m, facts(40000))  # serve re-planned a smaller window
    kv = int(kv_bytes(profile, 40000, F16) * 1.5)
    assert held == BIG.weights_bytes + kv + runtime_allowance(BIG.weights_bytes)


@pytest.mark.parametrize("worker_opened, expect_device_free", [(None, None), ("verified", "added")])
def test_previous_device_free(provisioned: tuple, worker_opened: str | None, expect_device_free: str | None) -> None:
    plan, manifest = provisioned
    probe = probe_free(int(5.5 * GiB))
    worker = None if worker_opened is None else facts(manifest.opened_context_tokens)
    got = previous_device_free(probe, manifest, worker)
    if expect_device_free is None:
        assert got is None
        return
    assert worker is not None
    held = worker_held_bytes(manifest, worker)
    assert got == (0, min(int(5.5 * GiB) + held, 24 * GiB))  # capped: the card has 18.5 GiB in use
    assert got[1] > int(5.5 * GiB)


def test_previous_device_free_is_none_when_its_device_is_gone(provisioned: tuple) -> None:
    plan, manifest = provisioned
    other = ProbeResult(devices=(Device(0, "nvidia", "24 GiB card", 24 * GiB, 5 * GiB, uuid="GPU-other"),))
    assert previous_device_free(other, manifest, facts(manifest.opened_context_tokens)) is None


def test_the_served_model_is_kept_with_its_worker_memory_and_swapped_without_it(provisioned: tuple) -> None:
    """Seen: 24 GiB card serving the big model, 5.5 GiB free → refused (exit 3); 8 GiB free →
    another model provisioned beside it. With the worker's memory counted the big one is kept."""
    plan, manifest = provisioned
    held = worker_held_bytes(manifest, facts(manifest.opened_context_tokens))
    for free in (int(5.5 * GiB), 8 * GiB):
        probe = probe_free(free)
        blind = build_plan(probe, [BIG, SMALL], F16, previous=PreviousModel("big-agent", plan.placement.device))
        assert blind.plan is None or blind.plan.entry.name != "big-agent"  # the defect, without the worker
        seen = build_plan(probe, [BIG, SMALL], F16,
                          previous=PreviousModel("big-agent", plan.placement.device, worker_held_bytes=held))
        assert seen.plan is not None and seen.plan.entry.name == "big-agent" and seen.plan.reused_previous
        assert seen.plan.placement.device.uuid == "GPU-card"
        card = next(d for d in seen.devices if d.device.index == 0)
        assert card.judged_free_bytes == previous_device_free(probe, manifest, facts(manifest.opened_context_tokens))[1]


def test_the_worker_memory_is_never_given_to_another_model(provisioned: tuple) -> None:
    """When even with its worker's memory the previous model no longer qualifies, the device is
    planned on what is really free: that memory is not available to a model that would run beside it."""
    plan, _ = provisioned
    tiny_card = ProbeResult(devices=(Device(0, "nvidia", "24 GiB card", 24 * GiB, 5 * GiB, uuid="GPU-card"),))
    out = build_plan(tiny_card, [BIG, SMALL], F16,
                     previous=PreviousModel("big-agent", plan.placement.device, worker_held_bytes=6 * GiB))
    assert out.plan is not None and out.plan.entry.name == "small-agent" and not out.plan.reused_previous
    assert out.plan.budget.free_bytes == 5 * GiB


# ----------------------------------------------------------------------------- records are checked, not trusted


def _record(pid: int, ticks: int, model_path: str = "/models/big-agent.gguf") -> WorkerRecord:
    return WorkerRecord(pid=pid, start_ticks=ticks, host="127.0.0.1", port=9, model_path=model_path,
                        entry_name="big-agent", context_tokens=65536, kv_cache_type="f16", device={})


def test_start_ticks_of_this_process() -> None:
    import os

    assert process_start_ticks(os.getpid()) is not None and process_start_ticks(os.getpid()) > 0


@pytest.mark.integration
def test_a_dead_process_is_not_a_worker(provisioned: tuple, tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ticks = process_start_ticks(child.pid)
    child.wait()
    assert process_start_ticks(child.pid) is None
    record = _record(child.pid, ticks or 1)
    assert "not running" in (stale_reason(record, provisioned[1]) or "")
    write_worker_record(tmp_path / "serve.pid", record)
    assert find_worker(tmp_path / "serve.pid", provisioned[1]) is None


def test_a_pid_reused_by_another_program_is_not_a_worker(provisioned: tuple, tmp_path: Path) -> None:
    import os

    me = os.getpid()  # a live process that is not llama-server
    reused = _record(me, process_start_ticks(me) or 0)
    assert "not llama-server" in (stale_reason(reused, provisioned[1]) or "")
    wrong_start = _record(me, (process_start_ticks(me) or 0) + 1)  # same pid, another process's start
    assert "another process" in (stale_reason(wrong_start, provisioned[1]) or "")
    for record in (reused, wrong_start):
        write_worker_record(tmp_path / "serve.pid", record)
        assert find_worker(tmp_path / "serve.pid", provisioned[1]) is None


@pytest.mark.parametrize("text", ["", "{", "[]", '{"schema": 1}', '{"schema": 1, "pid": "x"}'])
def test_an_unreadable_record_is_none(tmp_path: Path, text: str) -> None:
    (tmp_path / "serve.pid").write_text(text)
    assert read_worker_record(tmp_path / "serve.pid") is None


def test_record_round_trips(tmp_path: Path) -> None:
    record = _record(123, 456)
    write_worker_record(tmp_path / "serve.pid", record)
    assert read_worker_record(tmp_path / "serve.pid") == record


def test_a_damaged_record_names_the_file_and_the_field(tmp_path: Path) -> None:
    from hotfit.core.errors import IntegrityError

    good = _record(123, 456).to_json()
    path = tmp_path / "serve.pid"
    for damaged, field in (({**good, "pid": "x"}, "pid"), ({**good, "device": []}, "device"),
                           ({k: v for k, v in good.items() if k != "port"}, "port")):
        with pytest.raises(IntegrityError) as err:
            WorkerRecord.decode(json.dumps(damaged), path=path)
        assert err.value.what.startswith(f"worker record {path} is damaged: {field} "), err.value.what

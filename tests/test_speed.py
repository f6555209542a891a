"""registry/speed.py (the speed model), its place in selection (floors, the refusal, the warning),
the probe's figures it reads, and ``hotfit plan``'s speed flags end to end on saved probe files."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from hotfit.core.errors import UsageError
from hotfit.core.entry import LayerGroup
from hotfit.core.settings import load_settings
from hotfit.pipeline.cli import main
from hotfit.registry.kv import KV_CACHE_TYPES
from hotfit.planner.document import outcome_json
from hotfit.planner.probe import Device, ProbeResult
from hotfit.planner.select import select_auto
from hotfit.registry.select import device_budget
from hotfit.registry.speed import (
    ASSUMED_HOST_BANDWIDTH_BYTES_PER_S,
    CPU_DECODE_BANDWIDTH_EFFICIENCY,
    CPU_DECODE_WEIGHT_BYTES_PER_S_PER_THREAD,
    CPU_LONE_THREAD_SPEEDUP,
    AttentionGroup,
    DeviceSpeedFacts,
    ModelSpeedFacts,
    SpeedFloors,
    SpeedPlanning,
    _depth_sum,
    device_speed_facts,
    model_speed_facts,
    predict,
    quant_matmul_efficiency,
    speed_shortfalls,
)
from hotfit.stages._host_speed import machine_fingerprint, physical_cores
from hotfit.stages.plan import build_plan
from tests.entries import GiB, entry

TIER = "unit"  # the model, selection and the CLI in-process (CONTRIBUTING.md "Test tiers")

F16 = KV_CACHE_TYPES["f16"]
Q8 = KV_CACHE_TYPES["q8_0"]

CPU = Device(0, "cpu", "host memory", 64 * GiB, 60 * GiB, read_bandwidth_bytes_per_s=40_000_000_000,
             bandwidth_basis="measured (test)", compute_threads=8)
GPU = Device(1, "nvidia", "Test GPU", 24 * GiB, 23 * GiB, read_bandwidth_bytes_per_s=1_000_000_000_000,
             bandwidth_basis="NVML (test)")
OLD_CPU = Device(0, "cpu", "host memory", 64 * GiB, 60 * GiB)  # a probe file written before speed


def flat_device(bandwidth: float, flops: float) -> DeviceSpeedFacts:
    return DeviceSpeedFacts("cpu", bandwidth, 0.5, flops, "test bandwidth", "test compute")


# ----------------------------------------------------------------------------- the arithmetic


@pytest.mark.parametrize(("n", "window"), [(0, None), (1, None), (10, None), (10, 4), (4, 4), (3, 4), (1000, 37)])
def test_depth_sum_is_the_cells_each_prompt_token_attends(n: int, window: int | None) -> None:
    assert _depth_sum(n, window) == sum(d if window is None else min(d, window) for d in range(n))


DENSE = ModelSpeedFacts(weights_read_per_token_bytes=1e9, matmul_params=2e9,
                        attention=(AttentionGroup(10, 1000, 2000),), basis="test")


@pytest.mark.parametrize(("prompt", "decode_end", "first_token_s"), [
    # decode: 100 GB/s x 0.5 / (1 GB weights + 10 layers x 2000 B x depth); prefill: 2 x 2e9 FLOPs a token
    # + 10 layers x 4 x 1000 x sum(depth) at 1e12 FLOP/s
    (1, 50e9 / (1e9 + 10 * 2000), (4e9 + 0) / 1e12),
    (1000, 50e9 / (1e9 + 10 * 2000 * 1000), (1000 * 4e9 + 10 * 4 * 1000 * 999 * 1000 / 2) / 1e12),
    (16384, 50e9 / (1e9 + 10 * 2000 * 16384), (16384 * 4e9 + 10 * 4 * 1000 * 16383 * 16384 / 2) / 1e12),
])
def test_predict_table(prompt: int, decode_end: float, first_token_s: float) -> None:
    p = predict(DENSE, flat_device(100e9, 1e12), prompt)
    assert p.prompt_tokens == prompt
    assert p.decode_start_tokens_per_s == pytest.approx(50.0)
    assert p.decode_tokens_per_s == pytest.approx(decode_end)
    assert p.first_token_s == pytest.approx(first_token_s)
    assert p.prefill_tokens_per_s == pytest.approx(prompt / first_token_s)
    assert set(p.to_json()) >= {"prefill_tokens_per_s", "decode_tokens_per_s", "first_token_s", "prompt_tokens",
                                "basis"}
    assert set(p.basis) == {"bandwidth", "efficiency", "compute", "parameters"}


def test_a_sliding_window_stops_the_kv_read_and_the_attention_at_its_window() -> None:
    windowed = dataclasses.replace(DENSE, attention=(AttentionGroup(10, 1000, 2000, window_tokens=512),))
    dev = flat_device(100e9, 1e12)
    full, swa = predict(DENSE, dev, 16384), predict(windowed, dev, 16384)
    assert swa.decode_tokens_per_s == pytest.approx(50e9 / (1e9 + 10 * 2000 * 512))
    assert swa.first_token_s < full.first_token_s and swa.decode_tokens_per_s > full.decode_tokens_per_s


def test_a_longer_prompt_is_slower_per_token_and_later_to_answer() -> None:
    dev = flat_device(100e9, 1e12)
    short, long = predict(DENSE, dev, 512), predict(DENSE, dev, 32768)
    assert long.prefill_tokens_per_s < short.prefill_tokens_per_s
    assert long.decode_tokens_per_s < short.decode_tokens_per_s
    assert long.first_token_s > 64 * short.first_token_s * 0.99


def test_decode_attention_is_the_slower_of_its_kv_read_and_its_flops_plus_a_cost_a_layer() -> None:
    # 10 layers x 4 x 1000 FLOPs a cached cell; the KV read is 10 x 2000 B a cell at 50 GB/s
    dev = dataclasses.replace(flat_device(100e9, 1e12), attention_decode_flops_per_s=1e9,
                              decode_overhead_s_per_layer=1e-4)
    compute_bound = 1e9 / 50e9 + 10 * 4 * 1000 * 16384 / 1e9 + 10 * 1e-4
    assert predict(DENSE, dev, 16384).decode_tokens_per_s == pytest.approx(1 / compute_bound)
    fast = dataclasses.replace(dev, attention_decode_flops_per_s=1e15)  # then the KV read bounds it
    read_bound = (1e9 + 10 * 2000 * 16384) / 50e9 + 10 * 1e-4
    assert predict(DENSE, fast, 16384).decode_tokens_per_s == pytest.approx(1 / read_bound)
    assert predict(DENSE, fast, 16384).decode_start_tokens_per_s == pytest.approx(1 / (1e9 / 50e9 + 10 * 1e-4))


def test_prompt_attention_runs_at_its_own_rate_and_the_matmuls_at_the_quants() -> None:
    dev = dataclasses.replace(flat_device(100e9, 1e12), attention_prefill_flops_per_s=2e11)
    q4_1 = dataclasses.replace(DENSE, matmul_efficiency=0.5)
    expected = 16384 * 4e9 / (1e12 * 0.5) + 10 * 4 * 1000 * 16383 * 16384 / 2 / 2e11
    assert predict(q4_1, dev, 16384).first_token_s == pytest.approx(expected)


@pytest.mark.parametrize(("label", "factor", "said"), [
    ("Q4_K_M", 1.0, ""), ("Qwen3-8B-UD-Q4_K_XL.gguf", 1.0, ""), ("SmolLM2-135M-Instruct.Q4_1.gguf", 0.42, "Q4_1"),
    ("model-Q8_0.gguf", 1.0, ""), ("model-q4_0.gguf", 1.0, "not measured"), ("IQ4_K", 1.0, "not measured"),
    (None, 1.0, "not measured"),
])
def test_a_quants_matmul_rate_is_read_from_its_name_and_an_unmeasured_one_says_so(label, factor, said) -> None:
    got, basis = quant_matmul_efficiency(label)
    assert got == factor
    assert said in basis and (said or basis == "")


def test_decode_streams_the_weights_at_the_bus_or_the_threads_rate_whichever_is_slower() -> None:
    # 1 GB of weights; the bus streams 50 GB/s; the threads dequantize and multiply 20 GB/s of weights
    dev = dataclasses.replace(flat_device(100e9, 1e12), decode_weight_bytes_per_s=20e9)
    assert predict(DENSE, dev, 0).decode_start_tokens_per_s == pytest.approx(20.0)
    many_threads = dataclasses.replace(dev, decode_weight_bytes_per_s=200e9)  # then the bus binds again
    assert predict(DENSE, many_threads, 0).decode_start_tokens_per_s == pytest.approx(50.0)
    assert predict(DENSE, dataclasses.replace(dev, decode_weight_bytes_per_s=None), 0
                   ).decode_start_tokens_per_s == pytest.approx(50.0)  # a GPU: the bus alone
    # a calibration scales the threads' rate with the rest of decode
    assert predict(DENSE, dev.scaled(decode=0.5), 0).decode_start_tokens_per_s == pytest.approx(10.0)


def test_a_cpus_decode_rate_grows_with_its_threads_until_the_bus_binds() -> None:
    one, two, many = (device_speed_facts(dataclasses.replace(CPU, compute_threads=n)) for n in (1, 2, 64))
    assert one.decode_weight_bytes_per_s == pytest.approx(CPU_LONE_THREAD_SPEEDUP * CPU_DECODE_WEIGHT_BYTES_PER_S_PER_THREAD)
    rates = [predict(DENSE, d, 0).decode_start_tokens_per_s for d in (one, two, many)]
    assert rates[0] < rates[1] <= rates[2]
    assert rates[2] == pytest.approx(predict(DENSE, dataclasses.replace(many, decode_weight_bytes_per_s=None), 0)
                                     .decode_start_tokens_per_s)


def test_a_lone_thread_computes_faster_than_each_of_two_and_the_basis_says_so() -> None:
    one, two, four = (device_speed_facts(dataclasses.replace(CPU, compute_threads=n)) for n in (1, 2, 4))
    for rate in ("prefill_flops_per_s", "attention_prefill_flops_per_s", "attention_decode_flops_per_s",
                 "decode_weight_bytes_per_s"):
        assert getattr(one, rate) == pytest.approx(getattr(two, rate) / 2 * CPU_LONE_THREAD_SPEEDUP)
        assert getattr(four, rate) == pytest.approx(2 * getattr(two, rate))  # past one: linear in threads
    assert "a lone thread" in one.compute_basis and "a lone thread" not in two.compute_basis


def test_a_calibration_scales_every_decode_term_and_every_prefill_term_exactly() -> None:
    dev = device_speed_facts(CPU)
    before = predict(DENSE, dev, 8192)
    after = predict(DENSE, dev.scaled(decode=2.0, prefill=3.0), 8192)
    assert after.decode_tokens_per_s == pytest.approx(2 * before.decode_tokens_per_s)
    assert after.decode_start_tokens_per_s == pytest.approx(2 * before.decode_start_tokens_per_s)
    assert after.first_token_s == pytest.approx(before.first_token_s / 3)


# ----------------------------------------------------------------------------- from the registry


def test_entry_facts_use_active_parameters_and_the_quants_bytes_per_weight() -> None:
    dense = entry("dense", params_b=30.0, weights=18 * 10**9)
    moe = dataclasses.replace(dense, name="moe", params_active_b=3.0)
    d, m = model_speed_facts(dense, F16), model_speed_facts(moe, F16)
    assert d is not None and m is not None
    assert d.weights_read_per_token_bytes == pytest.approx(18e9)  # 0.6 bytes/weight x 30B
    assert m.weights_read_per_token_bytes == pytest.approx(1.8e9)  # 0.6 x 3B active
    assert m.matmul_params == pytest.approx(3e9)
    assert "3B active of 30B (MoE)" in m.basis and "30B (dense)" in d.basis
    # q8_0 KV costs 34/64 of f16 per token
    q8 = model_speed_facts(dense, Q8)
    assert q8 is not None and q8.kv_read_bytes(1000) == pytest.approx(d.kv_read_bytes(1000) * 34 / 64)


def test_an_entry_without_parameters_or_geometry_gets_no_prediction() -> None:
    assert model_speed_facts(entry("x", params_b=None), F16) is None
    assert model_speed_facts(entry("y", groups=None), F16) is None


# Plausible by construction (the hardware matrix's claim): the same model is faster on a GPU than on
# a CPU, and an MoE faster than a dense model of the same total size.
@pytest.mark.parametrize("kv", [F16, Q8])
def test_a_gpu_is_faster_than_a_cpu_and_an_moe_faster_than_a_dense_model(kv) -> None:
    dense = entry("dense", params_b=30.0, weights=18 * 10**9, groups=(LayerGroup(48, 4, 128, 128),))
    moe = dataclasses.replace(dense, name="moe", params_active_b=3.0)
    for model in (dense, moe):
        f = model_speed_facts(model, kv)
        assert f is not None
        on_cpu, on_gpu = predict(f, device_speed_facts(CPU), 16384), predict(f, device_speed_facts(GPU), 16384)
        assert on_gpu.decode_tokens_per_s > on_cpu.decode_tokens_per_s
        assert on_gpu.first_token_s < on_cpu.first_token_s
    for dev in (CPU, GPU):
        fd, fm = model_speed_facts(dense, kv), model_speed_facts(moe, kv)
        assert fd is not None and fm is not None
        d, m = predict(fd, device_speed_facts(dev), 16384), predict(fm, device_speed_facts(dev), 16384)
        assert m.decode_tokens_per_s > d.decode_tokens_per_s and m.first_token_s < d.first_token_s


def test_device_facts_name_their_basis_and_an_old_probe_is_assumed() -> None:
    cpu = device_speed_facts(CPU)
    assert cpu.read_bandwidth_bytes_per_s == 40e9 and cpu.decode_efficiency == CPU_DECODE_BANDWIDTH_EFFICIENCY
    assert "measured (test)" in cpu.bandwidth_basis and "8 threads" in cpu.compute_basis
    old = device_speed_facts(OLD_CPU)
    assert old.read_bandwidth_bytes_per_s == ASSUMED_HOST_BANDWIDTH_BYTES_PER_S
    assert "assumed" in old.bandwidth_basis and "threads assumed" in old.compute_basis
    gpu = device_speed_facts(GPU)
    assert "NVML" in gpu.bandwidth_basis and "estimated" in gpu.compute_basis
    no_clock = device_speed_facts(dataclasses.replace(GPU, read_bandwidth_bytes_per_s=None))
    assert "assumed" in no_clock.bandwidth_basis


@pytest.mark.parametrize(("floors", "expected"), [
    (SpeedFloors(), ()),
    (SpeedFloors(min_decode_tokens_per_s=10), ("predicted 4.1 generated tokens/s < 10",)),
    (SpeedFloors(min_decode_tokens_per_s=4), ()),
    (SpeedFloors(max_first_token_s=60), ("predicted first token after 100 s > 60 s for a 16384-token prompt",)),
    (SpeedFloors(min_decode_tokens_per_s=5, max_first_token_s=99),
     ("predicted 4.1 generated tokens/s < 5", "predicted first token after 100 s > 99 s for a 16384-token prompt")),
])
def test_shortfalls_name_the_figures(floors: SpeedFloors, expected: tuple[str, ...]) -> None:
    p = dataclasses.replace(predict(DENSE, flat_device(100e9, 1e12), 16384), decode_tokens_per_s=4.1,
                            first_token_s=100.0)
    assert speed_shortfalls(p, floors) == expected


# ----------------------------------------------------------------------------- selection


BIG = entry("big-32b", params_b=32.0, weights=19 * GiB)
MID = entry("mid-8b", params_b=8.0, weights=5 * GiB)
SMALL = entry("small-2b", params_b=2.0, weights=int(1.3 * GiB))
ENTRIES = (SMALL, BIG, MID)


TINY = entry("tiny-0.5b", params_b=0.5, weights=400 * 1024 * 1024, groups=(LayerGroup(24, 2, 64, 64),))


def plan(floors: SpeedFloors = SpeedFloors(), device: Device = CPU, prompt: int = 16384, entries=ENTRIES):
    return build_plan(ProbeResult((device,)), entries, F16,
                      speed=SpeedPlanning(prompt, floors))


def test_without_floors_the_spec_order_stands_and_every_candidate_carries_its_prediction() -> None:
    out = plan()
    assert out.plan is not None and out.plan.entry.name == "big-32b"
    assert all(v.speed is not None for v in out.selection.verdicts)
    data = outcome_json(out)
    assert all(c["speed"]["predicted"]["prompt_tokens"] == 16384 for c in data["candidates"])
    assert data["selected"]["speed"]["predicted"]["basis"]["parameters"].startswith("32B (dense)")
    assert out.plan.speed_predicted is not None and out.plan.speed_predicted["first_token_s"] > 0


def test_a_decode_floor_moves_to_the_next_candidate_in_the_spec_order() -> None:
    base = {v.entry.name: v.speed for v in plan().selection.verdicts}
    assert base["big-32b"] is not None and base["mid-8b"] is not None
    floor = (base["big-32b"].decode_tokens_per_s + base["mid-8b"].decode_tokens_per_s) / 2
    out = plan(SpeedFloors(min_decode_tokens_per_s=floor))
    assert out.plan is not None and out.plan.entry.name == "mid-8b"
    big = next(v for v in out.selection.verdicts if v.entry.name == "big-32b")
    assert big.verdict == "excluded" and big.reason_code == "speed"
    assert big.reason == f"predicted {base['big-32b'].decode_tokens_per_s:.1f} generated tokens/s < {floor:g}"


def test_an_impossible_floor_refuses_naming_the_fastest_candidate_and_its_figures() -> None:
    out = plan(SpeedFloors(max_first_token_s=0.001))
    assert out.plan is None
    refusal = out.selection.refusal
    assert refusal is not None
    assert "--max-first-token-s 0.001" in refusal.message and "The fastest is small-2b" in refusal.message
    small = next(v for v in out.selection.verdicts if v.entry.name == "small-2b").speed
    assert small is not None and f"prefill {small.prefill_tokens_per_s:.0f} tok/s" in refusal.message
    assert refusal.error().exit_code == 3


def test_min_context_excludes_a_window_below_it() -> None:
    tight = dataclasses.replace(CPU, total_bytes=36 * GiB, free_bytes=34 * GiB)
    base = plan(device=tight)
    assert base.plan is not None and base.plan.entry.name == "big-32b"
    hot = base.plan.hot_context_tokens
    out = plan(SpeedFloors(min_context_tokens=hot + 1), device=tight)
    assert out.plan is not None and out.plan.entry.name == "mid-8b"
    big = next(v for v in out.selection.verdicts if v.entry.name == "big-32b")
    assert big.reason_code == "context_floor" and f"--min-context {hot + 1}" in big.reason


def test_a_slow_first_token_warns_naming_the_floor_and_the_model_it_would_choose() -> None:
    out = plan(entries=(*ENTRIES, TINY))
    speeds = {v.entry.name: v.speed for v in out.selection.verdicts}
    assert speeds["big-32b"] is not None and speeds["big-32b"].first_token_s > 120
    warning = out.selection.speed_warning
    assert warning is not None and "--max-first-token-s 120" in warning
    quick = next(n for n in ("mid-8b", "small-2b", "tiny-0.5b") if (speeds[n] and speeds[n].first_token_s <= 120))
    assert f"would choose {quick}" in warning
    assert "would refuse" in (plan().selection.speed_warning or "")  # without the tiny one, none is quick
    assert out.plan is not None and out.plan.speed_predicted is not None
    assert out.plan.speed_predicted["warning"] == warning
    # a floor set: no warning; a fast device: no warning
    assert plan(SpeedFloors(max_first_token_s=1e6)).selection.speed_warning is None
    assert plan(device=GPU).selection.speed_warning is None


def test_select_auto_without_a_speed_request_is_unchanged() -> None:
    sel = select_auto(ENTRIES, device_budget("cpu", 64 * GiB, 60 * GiB), F16)
    assert sel.chosen is not None and sel.chosen.speed is None and sel.speed_warning is None


# ----------------------------------------------------------------------------- the probe's figures


def test_an_old_probe_file_loads_and_a_new_one_round_trips() -> None:
    old = {"schema": 1, "devices": [{"index": 0, "kind": "cpu", "name": "h", "total_bytes": 8, "free_bytes": 4}],
           "selected": 0}
    assert ProbeResult.decode(old).devices[0].read_bandwidth_bytes_per_s is None
    new = ProbeResult((CPU,))
    assert ProbeResult.decode(new.to_json()) == new


@pytest.mark.parametrize(("field", "bad"), [("read_bandwidth_bytes_per_s", 0), ("read_bandwidth_bytes_per_s", 1.5),
                                            ("compute_threads", -1), ("bandwidth_basis", 3)])
def test_a_damaged_speed_field_in_a_probe_file_is_named(tmp_path: Path, field: str, bad: object) -> None:
    doc = ProbeResult((CPU,)).to_json()
    doc["devices"][0][field] = bad
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(doc))
    from hotfit.stages.probe import load_probe_file
    with pytest.raises(UsageError, match=field):
        load_probe_file(path)


CPUINFO = "".join(f"processor\t: {i}\nmodel name\t: Test CPU\nphysical id\t: 0\ncore id\t: {i // 2}\n\n"
                  for i in range(8))


@pytest.mark.parametrize(("allowed", "cores"), [({0, 1, 2, 3, 4, 5, 6, 7}, 4), ({0, 1}, 1), ({0, 2}, 2), ({0}, 1)])
def test_threads_are_the_physical_cores_this_process_may_run_on(allowed: set[int], cores: int) -> None:
    assert physical_cores(CPUINFO, allowed) == cores


def test_the_cache_key_changes_with_the_affinity_and_the_machine() -> None:
    a = machine_fingerprint(CPUINFO, {0, 1}, "MemTotal: 1 kB", "id")
    assert a == machine_fingerprint(CPUINFO, {1, 0}, "MemTotal: 1 kB", "id")
    assert a != machine_fingerprint(CPUINFO, {0}, "MemTotal: 1 kB", "id")
    assert a != machine_fingerprint(CPUINFO, {0, 1}, "MemTotal: 1 kB", "other")


# ----------------------------------------------------------------------------- settings and the CLI


@pytest.mark.parametrize("bad", ["fast", "0", "-3", "inf", "nan"])
@pytest.mark.parametrize("name", ["HOTFIT_MIN_DECODE_TOKENS_PER_S", "HOTFIT_MAX_FIRST_TOKEN_S"])
def test_a_bad_floor_in_the_environment_is_named(name: str, bad: str) -> None:
    with pytest.raises(UsageError, match=name):
        load_settings({name: bad, "HOME": "/nonexistent"})


def test_floors_from_the_environment() -> None:
    s = load_settings({"HOTFIT_MIN_DECODE_TOKENS_PER_S": "7.5", "HOTFIT_MAX_FIRST_TOKEN_S": "90", "HOME": "/x"})
    assert (s.min_decode_tokens_per_s, s.max_first_token_s) == (7.5, 90.0)
    assert load_settings({"HOME": "/x"}).min_decode_tokens_per_s is None


@pytest.fixture()
def probe_file(tmp_path: Path, hotfit_home: Path) -> Path:
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(ProbeResult((CPU,)).to_json()))
    return path


def plan_cli(*argv: str) -> tuple[int, dict, str]:
    out = io.StringIO()
    rc = main(["plan", "--json", *argv], out=out)
    return rc, json.loads(out.getvalue()), ""


def test_plan_cli_carries_the_prediction_and_the_prompt(probe_file: Path) -> None:
    rc, data, _ = plan_cli("--probe-file", str(probe_file), "--agent-prompt-tokens", "4096")
    assert rc == 0
    assert data["speed"]["agent_prompt_tokens"] == 4096
    predicted = data["selected"]["speed"]["predicted"]
    assert predicted["prompt_tokens"] == 4096 and predicted["basis"]["bandwidth"].startswith("40.0 GB/s")


def test_plan_cli_impossible_floor_exits_3_with_the_figures(probe_file: Path, monkeypatch) -> None:
    rc, data, err = plan_cli("--probe-file", str(probe_file), "--min-decode-tokens-per-s", "100000")
    assert rc == 3 and data["selected"] is None
    assert "--min-decode-tokens-per-s 100000" in data["error"]["message"]
    assert "The fastest is" in data["error"]["message"] and "generation" in data["error"]["message"]
    assert all(c["reason_code"] != "speed" or "generated tokens/s < 100000" in c["reason"]
               for c in data["candidates"])
    monkeypatch.setenv("HOTFIT_MAX_FIRST_TOKEN_S", "0.01")  # the environment's floor, same refusal
    rc, data, _ = plan_cli("--probe-file", str(probe_file))
    assert rc == 3 and "--max-first-token-s 0.01" in data["error"]["message"]


@pytest.mark.parametrize(("flag", "value", "needle"), [
    ("--min-context", "16384", ">= 32768"), ("--min-decode-tokens-per-s", "-1", "positive number"),
    ("--max-first-token-s", "soon", "positive number"), ("--agent-prompt-tokens", "0", ">= 1")])
def test_plan_cli_rejects_a_bad_speed_flag(probe_file: Path, flag: str, value: str, needle: str, capsys) -> None:
    assert main(["plan", "--probe-file", str(probe_file), flag, value]) == 2
    assert needle in capsys.readouterr().err


# ----------------------------------------------------------------------------- measured after the load


from hotfit.grading.protocol import ChatReply  # noqa: E402
from hotfit.core.errors import SpeedFloorMissed  # noqa: E402
from hotfit.pipeline.cli.render import speed_lines  # noqa: E402
from hotfit.pipeline.provision import AutoOptions, provisioning_stages  # noqa: E402
from hotfit.stages.measure_speed import (  # noqa: E402
    CHARS_PER_TOKEN,
    FOLLOW_UP_TOKENS,
    SPEED_STAGE,
    SpeedCheckJob,
    Timing,
    agent_request,
    comparable,
    floor_misses,
    follow_up,
    measured_figures,
    prompt_size,
    ratios,
)


@pytest.mark.parametrize("tokens", [512, 4096, 16384, 65536])
def test_the_agent_prompt_has_tools_and_about_the_asked_size(tokens: int) -> None:
    req = agent_request(tokens)
    chars = len(json.dumps(req["tools"])) + sum(len(m["content"]) for m in req["messages"])
    assert abs(chars / CHARS_PER_TOKEN - tokens) / tokens < 0.05
    assert req["tools"] and req["tool_choice"] == "none" and req["cache_prompt"] is True
    nxt = follow_up(req, {"choices": [{"message": {"content": "I read it."}}]})
    assert nxt["messages"][:len(req["messages"])] == req["messages"]  # the cached prefix, then the new turn
    assert nxt["messages"][-2] == {"role": "assistant", "content": "I read it."}


@pytest.mark.parametrize("chars_per_token", [1.0, 2.5, CHARS_PER_TOKEN])
def test_the_follow_up_turn_adds_its_tokens_in_the_models_own_characters(chars_per_token: float) -> None:
    req = agent_request(4096, chars_per_token=chars_per_token)
    added = follow_up(req, {"choices": [{"message": {"content": ""}}]}, chars_per_token=chars_per_token)
    new_chars = len(added["messages"][-1]["content"])
    assert new_chars / chars_per_token == pytest.approx(FOLLOW_UP_TOKENS, rel=0.01)


class TokenizingServer:
    """What the speed check needs of a server: it counts a request's tokens at ``chars_per_token`` of
    its text plus ``template_tokens`` of its own, and with the prompt cache on evaluates only what
    follows the previous request's messages (llama-server's slot reuse)."""

    def __init__(self, chars_per_token: float, template_tokens: int = 80) -> None:
        self.chars_per_token, self.template_tokens = chars_per_token, template_tokens
        self.sent: list[dict[str, Any]] = []

    def tokens(self, messages: list[dict[str, Any]]) -> int:
        return round(sum(len(m["content"]) for m in messages) / self.chars_per_token)

    def count(self, request: dict[str, Any]) -> int:
        """The request's tokens evaluated whole."""
        return self.template_tokens + round(len(json.dumps(request["tools"])) / self.chars_per_token) \
            + self.tokens(request["messages"])

    async def ask(self, request: dict[str, Any], what: str) -> ChatReply:
        last = self.sent[-1]["messages"] if self.sent else None
        self.sent.append(request)
        msgs = request["messages"]
        if request.get("cache_prompt") and last is not None and msgs[:len(last)] == last:
            n = self.tokens(msgs[len(last):])
        else:
            n = self.count(request)
        return ChatReply.of_body({"choices": [{"message": {"content": "Read."}}],
                                  "timings": {"prompt_n": n, "prompt_ms": n * 2.0, "predicted_per_second": 10.0}})


@pytest.mark.parametrize("depths", [None, (2560, 5120)])
def test_the_check_sizes_its_prompts_in_tokens_the_server_counts_and_caches_the_follow_up(depths) -> None:
    # the probe's estimate (4 characters a token, its template's tokens counted in) is off: this
    # model reads 6 characters a token of the agent prompt (Qwen2.5 sent 65 % of the tokens asked)
    from hotfit.stages.measure_speed import timed_check

    server = TokenizingServer(chars_per_token=6.0)
    measured = anyio.run(timed_check, server.ask, 16384, depths, 4.0)
    first_measured = server.sent[-2]  # the full prompt, or the second depth: evaluated whole
    assert first_measured["cache_prompt"] is False and server.sent[0]["cache_prompt"] is False
    want = 16384 if depths is None else depths[1]
    assert abs(server.count(first_measured) - want) / want < 0.05  # sized by the server's count of a shorter one
    assert server.sent[-1]["cache_prompt"] is True  # the follow-up turn, on the cached prefix
    # only the new turn is evaluated (before, a fresh first turn left the follow-up uncached: all of it again)
    assert measured["follow_up_prompt_tokens"] == pytest.approx(FOLLOW_UP_TOKENS, rel=0.1)
    if depths is None:
        assert abs(measured["prompt_tokens"] - 16384) / 16384 < 0.05 and len(server.sent) == 3
        assert server.tokens(server.sent[0]["messages"]) < 16384 / 4  # the sizing prompt: a quarter at most
    else:
        assert measured["prompt_tokens"] == 16384 and len(server.sent) == 3


@pytest.mark.parametrize(("window", "wanted", "expected"), [(None, 16384, 16384), (131072, 16384, 16384),
                                                            (32768, 65536, 28672), (4096, 16384, 512)])
def test_the_prompt_is_clipped_to_the_opened_window(window, wanted: int, expected: int) -> None:
    assert prompt_size(window, wanted) == expected


def answer(prompt_n: int, prompt_ms: float, per_s: float) -> ChatReply:
    return ChatReply.of_body({"choices": [], "timings": {"prompt_n": prompt_n, "prompt_ms": prompt_ms,
                                                         "predicted_per_second": per_s}})


def test_measured_figures_come_from_the_servers_timings_and_are_compared() -> None:
    m = measured_figures(Timing.of(answer(16000, 80_000.0, 12.5)), Timing.of(answer(1500, 6000.0, 12.0)))
    assert (m["prompt_tokens"], m["first_token_s"], m["prefill_tokens_per_s"], m["decode_tokens_per_s"]) == \
        (16000, 80.0, 200.0, 12.5)
    assert (m["follow_up_prompt_tokens"], m["follow_up_first_token_s"]) == (1500, 6.0)
    same = {"prompt_tokens": 16000, "prefill_tokens_per_s": 250.0, "decode_tokens_per_s": 10.0, "first_token_s": 64.0}
    assert ratios(same, m) == {"prefill_tokens_per_s": 1.25, "decode_tokens_per_s": 0.8, "first_token_s": 0.8}
    # the check's prompt came out 2 % short: its first token is compared at its own length, at the
    # predicted prefill rate (16,000 tokens at 250 tok/s: 64 s predicted, 80 s measured)
    near = dict(same, prompt_tokens=16384, first_token_s=65.5)
    assert ratios(near, m) == {"prefill_tokens_per_s": 1.25, "decode_tokens_per_s": 0.8, "first_token_s": 0.8}
    unrated = {k: v for k, v in near.items() if k != "prefill_tokens_per_s"}  # no rate to scale the time by
    assert ratios(unrated, m) == {"decode_tokens_per_s": 0.8}
    far = dict(same, prompt_tokens=32768, first_token_s=131.0)  # another length: nothing is compared
    assert ratios(far, m) == {} and not comparable(far, m) and comparable(near, m)
    assert ratios(None, m) == {}
    misses = floor_misses(m, same, SpeedFloors(min_decode_tokens_per_s=20, max_first_token_s=60))
    assert misses == ["measured 12.5 generated tokens/s < 20 (predicted 10.0)",
                      "measured first token after 80 s > 60 s for 16000 prompt tokens (predicted 64.0 s for 16000)"]
    assert floor_misses(m, same, SpeedFloors(min_decode_tokens_per_s=12, max_first_token_s=90)) == []
    assert SpeedFloorMissed("x").exit_code == 5
    text = "\n".join(speed_lines(same, {"measured": m, "ratio": ratios(same, m)}))
    assert "speed measured  prefill 200 tok/s" in text and "decode_tokens_per_s 0.8" in text


def test_the_speed_check_runs_unless_skipped_by_its_flag() -> None:
    names = [s.name for s in provisioning_stages(AutoOptions())]
    assert names[-2:] == ["re-check", SPEED_STAGE]
    assert SPEED_STAGE not in [s.name for s in provisioning_stages(AutoOptions(skip_speed_check=True))]
    job = next(s for s in provisioning_stages(AutoOptions(agent_prompt_tokens=4096, max_first_token_s=30))
               if s.name == SPEED_STAGE).job
    assert isinstance(job, SpeedCheckJob) and job.prompt_tokens == 4096 and job.floors.max_first_token_s == 30


# ----------------------------------------------------------------------------- per-machine calibration


from hotfit.registry.speed import calibration_from  # noqa: E402
from hotfit.stages.measure_speed import read_calibration, write_calibration  # noqa: E402


BUILD = ("b1-identity", "llama.cpp b1, cpu backend")


def test_a_measurement_calibrates_later_plans_on_the_same_device_probe_figure_and_build(tmp_path: Path) -> None:
    base = plan()
    big = base.plan
    assert big is not None and big.speed_predicted is not None
    measured = {"prefill_tokens_per_s": big.speed_predicted["prefill_tokens_per_s"] / 2,
                "decode_tokens_per_s": big.speed_predicted["decode_tokens_per_s"] / 4}
    cal = calibration_from(CPU, "llama", BUILD, dict(big.speed_predicted), measured, "run r1 (big-32b, b1, now)")
    assert cal is not None and (cal.prefill_factor, cal.decode_factor) == pytest.approx((0.5, 0.25), rel=1e-2)
    assert (cal.backend, cal.backend_build, cal.backend_build_described) == ("llama", *BUILD)
    path = tmp_path / "speed-calibration.json"
    write_calibration(path, cal)
    assert read_calibration(path) == cal
    calibrated = build_plan(ProbeResult((CPU,)), ENTRIES, F16, speed=SpeedPlanning(16384, SpeedFloors(), cal, BUILD))
    p = calibrated.plan
    assert p is not None and p.speed_predicted is not None
    assert p.speed_predicted["decode_tokens_per_s"] == pytest.approx(measured["decode_tokens_per_s"], abs=0.01)
    assert "calibrated x0.25 by run r1" in p.speed_predicted["basis"]["bandwidth"]
    # the measured shortfall moves the next plan on: a floor the old prediction met, the calibrated one misses
    floor = SpeedFloors(min_decode_tokens_per_s=big.speed_predicted["decode_tokens_per_s"] * 0.9)
    before = build_plan(ProbeResult((CPU,)), ENTRIES, F16, speed=SpeedPlanning(16384, floor)).plan
    assert before is not None and before.entry.name == "big-32b"
    moved = build_plan(ProbeResult((CPU,)), ENTRIES, F16, speed=SpeedPlanning(16384, floor, cal, BUILD)).plan
    assert moved is not None and moved.entry.name != "big-32b"
    # another probe figure (a new measurement) or another device resets it
    other = dataclasses.replace(CPU, read_bandwidth_bytes_per_s=50_000_000_000)
    assert not cal.applies_to(other) and not cal.applies_to(GPU) and cal.applies_to(CPU)


@pytest.mark.parametrize(("backend", "build_now", "why"), [
    ("llama", ("b2-identity", "llama.cpp b2, cpu backend"),
     "measured with llama.cpp b1, cpu backend, the build now is llama.cpp b2, cpu backend"),
    ("llama", ("rebuilt", BUILD[1]), "the same version, other bytes: a rebuild"),
    ("llama", ("v-identity", "llama.cpp b1, vulkan backend"), "the build now is llama.cpp b1, vulkan backend"),
    ("llama", None, "no llama build is found now"),
    ("openvino", BUILD, "measured with the llama backend, this plan runs openvino"),
])
def test_a_calibration_from_another_build_is_set_aside_and_the_basis_says_why(backend, build_now, why) -> None:
    big = plan().plan
    assert big is not None and big.speed_predicted is not None
    halved = {k: big.speed_predicted[k] / 2 for k in ("prefill_tokens_per_s", "decode_tokens_per_s")}
    cal = calibration_from(CPU, "llama", BUILD, dict(big.speed_predicted), halved, "run r1 (big-32b, b1, now)")
    assert cal is not None
    planning = SpeedPlanning(16384, SpeedFloors(), cal, build_now)
    assert why in (planning.calibration_set_aside(backend) or "")
    request = planning.on(CPU, backend)
    assert request.device == dataclasses.replace(
        device_speed_facts(CPU), bandwidth_basis=request.device.bandwidth_basis,
        compute_basis=request.device.compute_basis)  # the probe's figures, uncalibrated
    note = "not calibrated: this machine's calibration (run r1 (big-32b, b1, now)) was "
    for basis in (request.device.bandwidth_basis, request.device.compute_basis):
        assert note in basis and why in basis
    # the same build on the same backend: it holds
    assert SpeedPlanning(16384, SpeedFloors(), cal, BUILD).on(CPU, "llama").device.decode_efficiency \
        == pytest.approx(device_speed_facts(CPU).decode_efficiency / 2, rel=1e-3)


def test_measure_speed_keys_its_calibration_by_the_build_and_a_new_build_resets_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import structlog.testing

    from hotfit.pipeline.provision import speed_planning
    from hotfit.stages.measure_speed import calibrate
    from tests.test_backend_boundary import FakeBackend, FakeBinary, _use

    fake = FakeBackend()
    _use(monkeypatch, fake)  # a backend registered where backends are: its build identity is the test's
    big = plan().plan
    assert big is not None and big.speed_predicted is not None
    served = dataclasses.replace(big, entry=dataclasses.replace(big.entry, backend="fake"))
    settings = load_settings({}, home=tmp_path / "home")
    halved = {k: big.speed_predicted[k] / 2 for k in ("prefill_tokens_per_s", "decode_tokens_per_s")}
    # the binary the load ran names the build: no search (the backend's answer is another build)
    fake.build = ("fake-build-searched", "what a search would find")
    calibrate(served, settings, "r1", dict(big.speed_predicted), halved, FakeBinary())
    stored = json.loads(settings.speed_calibration_path.read_text())
    assert (stored["backend"], stored["backend_build"], stored["schema"]) == ("fake", "fake-build-1", 2)
    assert "the fake server, build 1" in stored["provenance"] and stored["decode_factor"] == pytest.approx(0.5)
    # a load that found its own binary: the same search names it
    calibrate(served, settings, "r1", dict(big.speed_predicted), halved, None)
    assert json.loads(settings.speed_calibration_path.read_text())["backend_build"] == "fake-build-searched"
    fake.build = ("fake-build-1", "the fake server, build 1")
    calibrate(served, settings, "r1", dict(big.speed_predicted), halved, FakeBinary())

    with structlog.testing.capture_logs() as events:
        same = speed_planning(settings, ProbeResult((CPU,)), backend="fake")
    assert same.calibration_set_aside("fake") is None and "calibrated x0.50" in same.on(CPU, "fake").device.bandwidth_basis
    assert not [e for e in events if e["event"] == "speed.calibration_reset"]

    fake.build = ("fake-build-2", "the fake server, build 2")  # a new build in place
    with structlog.testing.capture_logs() as events:
        rebuilt = speed_planning(settings, ProbeResult((CPU,)), backend="fake")
    reset = [e for e in events if e["event"] == "speed.calibration_reset"]
    assert len(reset) == 1 and "the build now is the fake server, build 2" in reset[0]["reason"]
    basis = rebuilt.on(CPU, "fake").device
    assert "not calibrated" in basis.bandwidth_basis and basis.decode_efficiency == device_speed_facts(CPU).decode_efficiency
    # another machine's probe (a fleet's file): the calibration is not this device's, no build is asked for
    fake.build = ("fake-build-1", "the fake server, build 1")
    elsewhere = speed_planning(settings, ProbeResult((GPU,)), backend="fake")
    assert elsewhere.calibration_build_now is None and elsewhere.on(GPU, "fake").device == device_speed_facts(GPU)


def test_a_llama_server_binary_names_its_build_by_its_facts_and_its_bytes(tmp_path: Path) -> None:
    # measure-speed keys the calibration by the binary the load ran (ServerBinary.build_identity);
    # the search (LlamaServerBackend.build_identity) answers what the binary it finds answers
    from hotfit.backends.llama_server.discovery import BuildInfo, ServerBinary

    server = tmp_path / "llama-server"
    server.write_bytes(b"build one")
    build = BuildInfo("build-info.json", "0.0.1", 7000, "abc1234", "0.3.36", backend="cpu", variant="native")
    binary = ServerBinary(server, "cache", build, None)
    identity, described = binary.build_identity()
    assert described == build.describe() and binary.build_identity() == (identity, described)
    server.write_bytes(b"build two")  # a rebuild of the same version in place
    rebuilt = binary.build_identity()
    assert rebuilt[0] != identity and rebuilt[1] == described
    generic = dataclasses.replace(binary, build=dataclasses.replace(build, variant="generic")).build_identity()
    assert generic[0] not in (identity, rebuilt[0])


def test_a_measurement_without_a_generation_rate_still_calibrates_the_prefill() -> None:
    # an answer that ends at its first token (the tool-call fixtures') has no generation rate: the
    # prefill it did measure must still reach later plans, the decode factor left at 1 and said so
    predicted = {"prefill_tokens_per_s": 1000.0, "decode_tokens_per_s": 50.0}
    cal = calibration_from(CPU, "llama", BUILD, predicted, {"prefill_tokens_per_s": 250.0, "decode_tokens_per_s": None},
                           "run r1")
    assert cal is not None and (cal.prefill_factor, cal.decode_factor) == (0.25, 1.0)
    assert cal.provenance == "run r1; decode not measured (factor 1)"
    assert calibration_from(CPU, "llama", BUILD, predicted, {"prefill_tokens_per_s": None,
                                                             "decode_tokens_per_s": None}, "r") is None
    assert calibration_from(CPU, "llama", BUILD, predicted, {"prefill_tokens_per_s": 0, "decode_tokens_per_s": 5.0},
                            "r") == dataclasses.replace(cal, prefill_factor=1.0, decode_factor=0.1,
                                                        provenance="r; prefill not measured (factor 1)")


GOOD_CALIBRATION = {"schema": 2, "device_kind": "cpu", "device_name": "h", "read_bandwidth_bytes_per_s": 1,
                    "backend": "llama", "backend_build": "b1", "backend_build_described": "llama.cpp b1",
                    "prefill_factor": 0.5, "decode_factor": 1.0, "provenance": "x"}


@pytest.mark.parametrize("damage", [None, [], {"schema": 9}, {"prefill_factor": -1}, {"decode_factor": "fast"},
                                    {"provenance": None, "extra": 1}, {"schema": 1}, {"backend_build": None}])
def test_a_damaged_calibration_is_ignored_not_a_traceback(tmp_path: Path, damage: Any) -> None:
    (tmp_path / "c.json").write_text("{" if damage is None else json.dumps(
        damage if isinstance(damage, list) else {**GOOD_CALIBRATION, **damage}))
    assert read_calibration(tmp_path / "c.json") is None and read_calibration(tmp_path / "absent.json") is None
    (tmp_path / "c.json").write_text(json.dumps(GOOD_CALIBRATION))
    assert read_calibration(tmp_path / "c.json") is not None


# ----------------------------------------------------------------------------- the extrapolated check


from hotfit.stages.measure_speed import (  # noqa: E402
    SPEED_CHECK_BUDGET_S,
    extrapolated_figures,
    fit_prefill,
    short_depths,
)


@pytest.mark.parametrize(("a", "b"), [(0.004, 0.0), (0.004, 2e-7), (0.0001, 1e-6)])
def test_a_prefill_curve_through_two_depths_extrapolates_exactly(a: float, b: float) -> None:
    def t(n: int) -> float:
        return a * n + b * n * n
    fa, fb = fit_prefill(1024, t(1024), 2048, t(2048))
    assert (fa, fb) == (pytest.approx(a), pytest.approx(b, abs=1e-12))
    # decode: a step's time linear in the depth
    def rate(d: int) -> float:
        return 1 / (0.05 + 1e-6 * d)
    m = extrapolated_figures(Timing(1024, t(1024), rate(1024)), Timing(2048, t(2048), rate(2048)),
                             Timing(1500, None, None), 16384)
    assert m["first_token_s"] == pytest.approx(t(16384)) and m["decode_tokens_per_s"] == pytest.approx(rate(16384))
    assert m["follow_up_first_token_s"] == pytest.approx(t(16384 + 1500) - t(16384))
    assert m["prompt_tokens"] == 16384 and "extrapolated to 16384" in m["basis"]


def test_a_noisy_pair_is_read_as_linear_never_as_a_cheaper_long_prompt() -> None:
    assert fit_prefill(1000, 10.0, 2000, 15.0) == (15.0 / 2000, 0.0)


@pytest.mark.parametrize(("wanted", "expected_s", "depths"), [
    (16384, None, None), (16384, SPEED_CHECK_BUDGET_S, None), (16384, 770.0, (851, 1702)),
    (16384, 1e6, (512, 1024)), (1500, 1e6, None)])
def test_the_check_measures_short_depths_only_when_the_full_prompt_is_slow(wanted, expected_s, depths) -> None:
    assert short_depths(wanted, expected_s) == depths


def test_the_agent_prompt_is_sized_with_the_models_own_characters_per_token() -> None:
    from hotfit.stages.measure_speed import chars_per_token
    from hotfit.stages.probe_tool_call import probe_request

    req = probe_request()
    size = len(json.dumps(req))
    assert chars_per_token(req, size) == 1.0  # a byte vocabulary: one character a token
    assert chars_per_token(req, size // 3) == pytest.approx(size / (size // 3))
    assert chars_per_token(req, 1) == CHARS_PER_TOKEN and chars_per_token(req, None) == CHARS_PER_TOKEN
    small = agent_request(16384, chars_per_token=1.0)
    assert len(json.dumps(small["tools"])) + sum(len(m["content"]) for m in small["messages"]) <= 16384 * 1.05
    assert speed_lines(None, {"measured": {"basis": "not measured: the openvino backend ..."}}) == [
        "  speed measured  not measured: the openvino backend ..."]


def test_the_decode_rate_is_the_servers_own_and_one_generated_token_leaves_it_unmeasured() -> None:
    # llama-server leaves the first generated token out of predicted_per_second (it comes with the
    # prompt): one token generated reports 0, which is no rate — tokens / ms would make one up
    one = ChatReply.of_body({"choices": [], "timings": {"prompt_n": 100, "prompt_ms": 50.0, "predicted_n": 1,
                                                        "predicted_ms": 0.5, "predicted_per_second": 0.0}})
    assert Timing.of(one).decode_tokens_per_s is None
    more = ChatReply.of_body({"choices": [], "timings": {"prompt_n": 100, "prompt_ms": 50.0, "predicted_n": 11,
                                                         "predicted_ms": 1000.0, "predicted_per_second": 10.0}})
    assert Timing.of(more).decode_tokens_per_s == 10.0


# ----------------------------------------------------------------------------- reuse of a measurement


def test_another_floor_or_prompt_size_measures_again_never_a_record_made_without_it(tmp_path: Path) -> None:
    from hotfit.pipeline.engine import RunContext, inputs_hash

    chosen = plan().plan
    assert chosen is not None

    async def enter(cm: Any) -> Any:
        raise AssertionError("not entered")

    def key(opts: AutoOptions, env: dict[str, str] | None = None) -> str:
        stage = next(s for s in provisioning_stages(opts) if s.name == SPEED_STAGE)
        ctx = RunContext(run_id="r", run_dir=tmp_path, settings=load_settings({"HOME": str(tmp_path), **(env or {})}),
                         plan=chosen, results={}, enter_context=enter, stage_job=stage.job)
        return inputs_hash(stage, ctx, {"load": {"port": 1}})

    without = key(AutoOptions(agent_prompt_tokens=2048))
    assert key(AutoOptions(agent_prompt_tokens=2048)) == without  # the same run again reuses it
    assert key(AutoOptions(agent_prompt_tokens=2048, max_first_token_s=5)) != without
    assert key(AutoOptions(agent_prompt_tokens=2048), {"HOTFIT_MIN_DECODE_TOKENS_PER_S": "5"}) != without
    assert key(AutoOptions(agent_prompt_tokens=2048, min_decode_tokens_per_s=5.0)) == \
        key(AutoOptions(agent_prompt_tokens=2048), {"HOTFIT_MIN_DECODE_TOKENS_PER_S": "5"})  # flag or variable
    assert key(AutoOptions(agent_prompt_tokens=4096)) != without

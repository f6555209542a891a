"""The planner prices OpenVINO entries as GenAI's paged cache allocates.

The per-token figures are the ones measured on the CPU plugin (scripts/bench-estimate's
OpenVINO rows, docs/benchmarks.md) and by tests/test_openvino.py on real fixture IRs; a q8_0 OpenVINO plan priced as
llama.cpp's q8_0 would under-estimate and fail its re-check by design.
"""

from __future__ import annotations

import pytest

from hotfit.pipeline.registry_file import load_registry
from hotfit.registry.kv import (
    KV_CACHE_TYPES,
    OPENVINO_KV_BLOCK_TOKENS,
    PagedKV,
    context_for_budget,
    kv_bytes,
    layer_profile,
)
from hotfit.core.entry import LayerGroup
from hotfit.planner.select import select_auto
from hotfit.registry.select import MIN_AGENTIC_HOT_CONTEXT, DeviceBudget, device_budget, model_fit, required_memory
from hotfit.backends.openvino.config import KV_PRECISIONS, kv_bytes_per_token_for_entry
from tests.entries import GiB, entry

TIER = "unit"

F16, Q8, Q4 = KV_CACHE_TYPES["f16"], KV_CACHE_TYPES["q8_0"], KV_CACHE_TYPES["q4_0"]


def ov(groups: tuple[LayerGroup, ...], **kw: object) -> object:
    return entry("ov", backend="openvino", groups=groups, architecture=None, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("what", "groups", "kv", "per_token"), [
    # Qwen3-8B: 36 layers x 8 KV heads x 128: f16 147456, u8 85248 B/token
    ("qwen3-8b f16", (LayerGroup(36, 8, 128, 128),), "f16", 147_456),
    ("qwen3-8b q8_0 as u8", (LayerGroup(36, 8, 128, 128),), "q8_0", 85_248),
    ("qwen3-8b bf16", (LayerGroup(36, 8, 128, 128),), "bf16", 147_456),
    # SmolLM2-135M (addendum): 30 x 3 x 64; u8 80 B per head for K, 72 for V
    ("smollm2 q8_0 as u8", (LayerGroup(30, 3, 64, 64),), "q8_0", 30 * 3 * (80 + 72)),
    ("smollm2 f16", (LayerGroup(30, 3, 64, 64),), "f16", 30 * 2 * 3 * 64 * 2),
    # the tool-call fixture IR (1 x 1 x 32): 128 B at f16 and 80 at u8, measured by tests/test_openvino.py
    ("fixture f16", (LayerGroup(1, 1, 32, 32),), "f16", 128),
    ("fixture q8_0 as u8", (LayerGroup(1, 1, 32, 32),), "q8_0", 80),
    # two groups add up; a sliding window is no saving in OpenVINO's cache
    ("two groups", (LayerGroup(2, 4, 64, 64), LayerGroup(2, 4, 64, 64, window_tokens=128)), "f16", 4 * 4 * 64 * 4),
])
def test_openvino_bytes_per_token(what: str, groups: tuple[LayerGroup, ...], kv: str, per_token: int) -> None:
    p = layer_profile(ov(groups))  # type: ignore[arg-type]
    assert p.paged is not None, what
    assert kv_bytes(p, 32, KV_CACHE_TYPES[kv]) == 32 * per_token  # type: ignore[arg-type]
    # the session's byte model (what the re-check predicts from the IR) is the same function
    flat = [(g.count, g.n_kv_heads, g.head_dim_k, g.head_dim_v) for g in groups]
    assert kv_bytes_per_token_for_entry(flat, KV_PRECISIONS[kv]) == per_token


def test_openvino_q8_0_is_not_llama_cpps_q8_0() -> None:
    groups = (LayerGroup(36, 8, 128, 128),)
    llama = layer_profile(entry("l", groups=groups))
    openvino = layer_profile(ov(groups))  # type: ignore[arg-type]
    assert kv_bytes(llama, 32768, Q8) == 36 * 2 * 8 * 136 * 32768  # type: ignore[arg-type]  # 78336 B/token
    assert kv_bytes(openvino, 32768, Q8) == 85_248 * 32768  # type: ignore[arg-type]


@pytest.mark.parametrize(("tokens", "blocks"), [(1, 1), (32, 1), (33, 2), (32768, 1024), (40960, 1280), (40961, 1281)])
def test_openvino_allocates_whole_32_token_blocks(tokens: int, blocks: int) -> None:
    p = layer_profile(ov((LayerGroup(36, 8, 128, 128),)))  # type: ignore[arg-type]
    assert OPENVINO_KV_BLOCK_TOKENS == 32
    assert kv_bytes(p, tokens, F16) == blocks * 32 * 147_456  # type: ignore[arg-type]
    assert kv_bytes(p, 0, F16) == 0  # type: ignore[arg-type]


def test_openvino_budget_is_searched_in_blocks_not_256_cells() -> None:
    p = layer_profile(ov((LayerGroup(36, 8, 128, 128),)))  # type: ignore[arg-type]
    budget = 1025 * 32 * 85_248 + 100  # one block more than 32768 tokens, a few bytes spare
    n = context_for_budget(p, budget, Q8, 1 << 20)  # type: ignore[arg-type]
    assert n == 32800  # a multiple of 32 that llama.cpp's 256-cell pad could not give
    assert kv_bytes(p, n, Q8) <= budget < kv_bytes(p, n + 1, Q8)  # type: ignore[arg-type]


def test_plan_estimate_for_an_openvino_entry_is_openvinos_figure() -> None:
    e = ov((LayerGroup(36, 8, 128, 128),), weights=5 * GiB, context_limit=40960)
    fit = model_fit(e, 40 * GiB, Q8)  # type: ignore[arg-type]
    assert fit.hot_context_tokens == 40960
    assert fit.kv_bytes == 1280 * 32 * 85_248


def test_a_kv_type_openvino_cannot_run_leaves_the_entry_unpriced() -> None:
    e = ov((LayerGroup(36, 8, 128, 128),))
    fit = model_fit(e, 40 * GiB, Q4)  # type: ignore[arg-type]
    assert "no KV precision for q4_0" in fit.reason
    assert required_memory(e, _budget(), Q4) is None  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="q4_0 has no OpenVINO precision"):
        kv_bytes(layer_profile(e), 32768, Q4)  # type: ignore[arg-type]


def test_llama_entries_keep_llama_cpps_pricing() -> None:
    p = layer_profile(entry("l", groups=(LayerGroup(36, 8, 128, 128),)))
    assert p.paged is None
    assert kv_bytes(p, 1, F16) == kv_bytes(p, 256, F16)  # type: ignore[arg-type]


def test_the_real_qwen3_8b_ov_entry_plans_openvinos_q8_0_cost() -> None:
    reg = load_registry(None)
    e = next(x for x in reg.entries if x.name == "qwen3-8b-ov")
    fit = model_fit(e, 16 * GiB, Q8)
    assert isinstance(fit.profile.paged, PagedKV)
    assert fit.kv_bytes == -(-fit.hot_context_tokens // 32) * 32 * 85_248
    sel = select_auto(reg.entries, _budget(), Q8, origin="china", backend="openvino")
    assert sel.chosen is not None and sel.chosen.entry.name == "qwen3-8b-ov"
    assert sel.chosen.fit.kv_bytes == 1280 * 32 * 85_248  # the whole 40960-token ceiling fits 48 GiB free
    assert sel.chosen.fit.hot_context_tokens >= MIN_AGENTIC_HOT_CONTEXT


def _budget() -> DeviceBudget:
    return device_budget("cpu", 64 * GiB, 48 * GiB, "host")

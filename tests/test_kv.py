"""registry.kv: exact KV bytes per cache type, llama.cpp's cell padding and SWA sizing, profiles."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hotfit.core.errors import UsageError
from hotfit.registry.kv import (
    KV_CACHE_TYPES,
    KVLayerShape,
    LayerKVProfile,
    UnknownKV,
    context_for_budget,
    kv_bytes,
    layer_profile,
    parse_kv_cache_type,
)
from hotfit.core.entry import LayerGroup
from tests.entries import MINICPM5_2B, entry

TIER = "unit"


# ggml block sizes (ggml/src/ggml.c type traits), as bytes per element.
@pytest.mark.parametrize("name, per_elem", [
    ("f32", Fraction(4)), ("f16", Fraction(2)), ("bf16", Fraction(2)),
    ("q8_0", Fraction(34, 32)), ("q5_1", Fraction(24, 32)), ("q5_0", Fraction(22, 32)),
    ("q4_1", Fraction(20, 32)), ("q4_0", Fraction(18, 32)), ("iq4_nl", Fraction(18, 32)),
])
def test_block_sizes_are_ggmls(name: str, per_elem: Fraction) -> None:
    t = KV_CACHE_TYPES[name]
    assert Fraction(t.block_bytes, t.block_elems) == per_elem
    # A 128-wide row (one head) costs exactly 128 × bytes/elem — q8_0 is 136, never 128.
    assert t.row_bytes(128) == 128 * per_elem


def test_parse_kv_cache_type_unset_is_f16_and_unknown_is_an_error() -> None:
    assert parse_kv_cache_type(None).name == "f16"
    assert parse_kv_cache_type("").name == "f16"
    assert parse_kv_cache_type(" Q8_0 ").name == "q8_0"
    with pytest.raises(UsageError) as exc:
        parse_kv_cache_type("q8")
    msg = str(exc.value)
    assert "'q8'" in msg and all(n in msg for n in KV_CACHE_TYPES)


def test_dense_profile_matches_llama_cpp_tensor_sizes() -> None:
    # minicpm5-2b at -c 32768: 42 layers × (K 2·128 + V 2·128) elements × 32768 cells.
    p = layer_profile(MINICPM5_2B)
    assert isinstance(p, LayerKVProfile)
    f16 = KV_CACHE_TYPES["f16"]
    assert kv_bytes(p, 32768, f16) == 42 * 2 * 256 * 2 * 32768 == 1_409_286_144
    # q8_0: each 256-element row is 8 blocks of 34 bytes.
    assert kv_bytes(p, 32768, KV_CACHE_TYPES["q8_0"]) == 42 * 2 * (8 * 34) * 32768


def test_n_ctx_is_padded_to_256_cells() -> None:
    p = layer_profile(MINICPM5_2B)
    assert isinstance(p, LayerKVProfile)
    f16 = KV_CACHE_TYPES["f16"]
    assert kv_bytes(p, 1, f16) == kv_bytes(p, 256, f16) == 256 * 42 * 1024
    assert kv_bytes(p, 257, f16) == kv_bytes(p, 512, f16)
    assert kv_bytes(p, 0, f16) == 0


def test_sliding_window_layers_stop_at_window_plus_ubatch_padded() -> None:
    # gpt-oss-20b shape: 12 full + 12 sliding (window 128) layers, 8 KV heads × 64.
    e = entry("gpt-oss-like", groups=(LayerGroup(12, 8, 64, 64), LayerGroup(12, 8, 64, 64, window_tokens=128)),
              architecture="gpt-oss")
    p = layer_profile(e)
    assert isinstance(p, LayerKVProfile)
    f16 = KV_CACHE_TYPES["f16"]
    per_layer_cell = 2 * 8 * 64 * 2
    # llama-kv-cache-iswa.cpp: size_swa = GGML_PAD(min(n_ctx, n_swa + n_ubatch), 256) = PAD(640) = 768.
    n = 65536
    assert kv_bytes(p, n, f16) == 12 * per_layer_cell * n + 12 * per_layer_cell * 768
    # Below the window the SWA cache is no bigger than the context.
    assert kv_bytes(p, 256, f16) == 24 * per_layer_cell * 256
    # Global layers grow; windowed ones do not.
    assert kv_bytes(p, 2 * n, f16) - kv_bytes(p, n, f16) == 12 * per_layer_cell * n


def test_gemma_uses_the_larger_footprint_on_every_layer() -> None:
    # gemma-4-e4b: 35 sliding layers (2 KV heads × 256, window 512) + 7 global (2 × 512).
    e = entry("gemma4-e4b-like", groups=(LayerGroup(35, 2, 256, 256, 512), LayerGroup(7, 2, 512, 512)),
              architecture="gemma4")
    p = layer_profile(e)
    assert isinstance(p, LayerKVProfile)
    assert "gemma" in p.basis
    f16 = KV_CACHE_TYPES["f16"]
    wide = 2 * (2 * 512) * 2  # K + V at the global shape, f16
    assert kv_bytes(p, 65536, f16) == 7 * wide * 65536 + 35 * wide * 1024  # PAD(512 + 512) = 1024
    # The same geometry on a non-Gemma architecture is charged per group exactly.
    exact = layer_profile(entry("other", groups=e.config.layer_groups, architecture="llama"))
    assert isinstance(exact, LayerKVProfile)
    assert kv_bytes(exact, 65536, f16) < kv_bytes(p, 65536, f16)


def test_k_and_v_head_dims_are_separate() -> None:
    p = layer_profile(entry("kv", groups=(LayerGroup(10, 4, 192, 128),)))
    assert isinstance(p, LayerKVProfile)
    assert kv_bytes(p, 256, KV_CACHE_TYPES["f16"]) == 10 * (4 * 192 + 4 * 128) * 2 * 256


@pytest.mark.parametrize("flag", ["mla", "recurrent"])
def test_mla_and_recurrent_are_budgeted_dense_over_all_layers(flag: str) -> None:
    # Qwen3.5-like: 32 layers, only 8 recorded as attention; MLA / hybrid → all 32 dense.
    flags: dict[str, Any] = {flag: True}
    e = entry("dense", groups=(LayerGroup(8, 4, 256, 256),), n_layers=32, **flags)
    p = layer_profile(e)
    assert isinstance(p, LayerKVProfile)
    assert p.n_layers == 32 and "dense" in p.basis
    assert kv_bytes(p, 256, KV_CACHE_TYPES["f16"]) == 32 * 2 * 4 * 256 * 2 * 256


@pytest.mark.parametrize("kwargs, why", [
    ({"groups": None}, "geometry"),
    ({"groups": ()}, "geometry"),
    ({"context_limit": None}, "context"),
    ({"groups": (LayerGroup(30, 8, 128, 128),), "n_layers": 32}, "cover"),
    ({"groups": (LayerGroup(32, 0, 128, 128),)}, "incomplete"),
])
def test_unknown_metadata_is_a_typed_verdict(kwargs: dict, why: str) -> None:
    p = layer_profile(entry("u", **kwargs))
    assert isinstance(p, UnknownKV) and why in p.reason


def test_q8_0_roughly_doubles_the_window() -> None:
    p = layer_profile(MINICPM5_2B)
    assert isinstance(p, LayerKVProfile)
    budget = 3 << 30
    f16 = context_for_budget(p, budget, KV_CACHE_TYPES["f16"], 1 << 20)
    q8 = context_for_budget(p, budget, KV_CACHE_TYPES["q8_0"], 1 << 20)
    # Exactly 2 / (34/32) = 1.882× up to the 256-cell step.
    assert 1.85 < q8 / f16 < 1.9


shapes = st.builds(
    KVLayerShape,
    count=st.integers(1, 64),
    k_elems=st.sampled_from([64, 128, 256, 512, 576, 1024]),
    v_elems=st.sampled_from([64, 128, 256, 512, 1024]),
    window_tokens=st.one_of(st.none(), st.integers(1, 8192)),
)
profiles = st.builds(lambda s, c: LayerKVProfile(tuple(s), c, "test"),
                     st.lists(shapes, min_size=1, max_size=3), st.integers(1, 300_000))


@settings(max_examples=200, deadline=None)
@given(profiles, st.integers(0, 1 << 36), st.sampled_from(sorted(KV_CACHE_TYPES)))
def test_context_for_budget_is_the_exact_inverse_of_kv_bytes(p: LayerKVProfile, budget: int, t: str) -> None:
    ct = KV_CACHE_TYPES[t]
    n = context_for_budget(p, budget, ct, p.context_limit_tokens)
    assert 0 <= n <= p.context_limit_tokens
    if n > 0:
        assert kv_bytes(p, n, ct) <= budget
    if n < p.context_limit_tokens:
        assert kv_bytes(p, n + 1, ct) > budget


@settings(max_examples=200, deadline=None)
@given(profiles, st.integers(0, 1 << 36), st.integers(0, 1 << 30), st.sampled_from(sorted(KV_CACHE_TYPES)))
def test_context_for_budget_is_monotonic(p: LayerKVProfile, budget: int, more: int, t: str) -> None:
    ct = KV_CACHE_TYPES[t]
    assert context_for_budget(p, budget + more, ct, p.context_limit_tokens) >= \
        context_for_budget(p, budget, ct, p.context_limit_tokens)


@settings(max_examples=200, deadline=None)
@given(profiles, st.integers(0, 300_000), st.integers(0, 300_000))
def test_kv_bytes_is_monotonic(p: LayerKVProfile, a: int, b: int) -> None:
    lo, hi = sorted((a, b))
    f16 = KV_CACHE_TYPES["f16"]
    assert kv_bytes(p, lo, f16) <= kv_bytes(p, hi, f16)


def test_allocation_estimate_is_exact_per_group_not_conservative() -> None:
    from hotfit.registry.kv import allocation_kv_bytes

    f16 = KV_CACHE_TYPES["f16"]
    # Qwen3.5-like hybrid: llama.cpp allocates KV for the 8 full-attention layers only.
    hybrid = entry("q35", groups=(LayerGroup(8, 4, 256, 256),), n_layers=32, recurrent=True)
    assert allocation_kv_bytes(hybrid, 32768, "f16") == 8 * 2 * 4 * 256 * 2 * 32768
    budgeted = layer_profile(hybrid)
    assert isinstance(budgeted, LayerKVProfile)
    assert kv_bytes(budgeted, 32768, f16) == 4 * allocation_kv_bytes(hybrid, 32768, f16)
    # A dense model: budget and allocation agree exactly.
    assert allocation_kv_bytes(MINICPM5_2B, 75520, f16) == kv_bytes(layer_profile(MINICPM5_2B), 75520, f16)  # type: ignore[arg-type]
    # MLA cannot be predicted from the recorded geometry.
    assert allocation_kv_bytes(entry("mla", mla=True), 32768, f16) is None

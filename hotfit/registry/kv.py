"""KV-cache cost model: how many bytes llama.cpp allocates for an N-token window (pure, no I/O).

All arithmetic is on integers: a cache type is ggml's block (elements per block, bytes per
block), so q8_0 costs exactly 34 bytes per 32 elements — never a float, never rounded to one
byte (contenox's ``kvTypeBytes`` rounds q8_0 to 1 B and under-budgets it by ~6 %).

What the estimate mirrors, from the pinned llama.cpp tree (``src/llama-context.cpp``,
``src/llama-kv-cache.cpp``, ``src/llama-kv-cache-iswa.cpp``, ``src/llama-model.cpp``), for
``llama-server -c N -np 1`` with the default ``-ub 512`` and no ``--swa-full``:

* ``n_ctx`` is padded up to a multiple of 256 (``GGML_PAD(n_ctx, 256)``); every global
  (full-attention) layer holds that many cells.
* sliding-window layers live in a separate cache of
  ``GGML_PAD(min(n_ctx, n_swa + n_ubatch), 256)`` cells.
* each layer holds one K tensor of ``n_kv_heads * head_dim_k`` elements per cell and one V
  tensor of ``n_kv_heads * head_dim_v`` elements per cell, stored as ggml rows of the cache
  type (``ggml_row_size``: whole blocks).

OpenVINO entries (their layout's ``paged_kv``, core/entry.py) are priced by what GenAI's paged cache
allocates instead (:class:`PagedKV`, held to GenAI's reported allocation by tests/test_openvino.py
and scripts/bench-estimate's OpenVINO rows, docs/benchmarks.md): whole 32-token blocks on CPU, every
layer the full window (the continuous-batching cache has no separate sliding-window pool), and at
q8_0 the CPU plugin's u8 with its scales —
85,248 B/token for Qwen3-8B where llama.cpp's q8_0 costs 78,336. Priced as llama.cpp, a q8_0
OpenVINO plan would fail its re-check by design.

Deliberate departures (spec, "Selection and hot context"): Gemma profiles charge every layer the
larger per-layer footprint of its two attention types and assume no shared-KV saving; MLA and
recurrent/hybrid models are charged as dense attention over all their layers. These can only
over-estimate. A model whose geometry or context ceiling is unknown gets an ``UnknownKV``
verdict and is excluded from automatic selection — never "unlimited" (contenox failed open).
"""

from __future__ import annotations

from dataclasses import dataclass

from hotfit.core.errors import UsageError
from hotfit.core.entry import Entry, LayerGroup

# llama.cpp pads n_ctx and the SWA cache to 256 cells (llama-context.cpp, llama-kv-cache-iswa.cpp).
KV_CELL_PAD_TOKENS = 256
# llama-server's default micro-batch (-ub); the SWA cache keeps window + n_ubatch cells.
LLAMA_UBATCH_TOKENS = 512
DEFAULT_KV_CACHE_TYPE = "f16"  # spec: "Unset means f16"
# Tokens per block of OpenVINO GenAI's paged KV cache on CPU (continuous_batching/cache/kv_cache_manager.hpp).
OPENVINO_KV_BLOCK_TOKENS = 32
# The plan's KV type -> OpenVINO's KV_CACHE_PRECISION. u8 is the analogue of q8_0; f32 is refused by
# the CPU plugin on BF16-capable CPUs and u4 costs more than u8 there (measured), so neither is offered.
OPENVINO_KV_PRECISIONS: dict[str, str] = {"f16": "f16", "bf16": "bf16", "q8_0": "u8"}


@dataclass(frozen=True)
class KVCacheType:
    """A ggml tensor type as llama.cpp stores KV rows: ``block_bytes`` per ``block_elems``."""

    name: str
    block_elems: int
    block_bytes: int

    def row_bytes(self, n_elems: int) -> int:
        """Bytes of one row of ``n_elems`` (ggml_row_size; a partial block still costs a block)."""
        blocks = -(-n_elems // self.block_elems)
        return blocks * self.block_bytes


# ggml's type traits (ggml/src/ggml.c): block size and bytes per block.
KV_CACHE_TYPES: dict[str, KVCacheType] = {
    t.name: t
    for t in (
        KVCacheType("f32", 1, 4),
        KVCacheType("f16", 1, 2),
        KVCacheType("bf16", 1, 2),
        KVCacheType("q8_0", 32, 34),
        KVCacheType("q5_1", 32, 24),
        KVCacheType("q5_0", 32, 22),
        KVCacheType("q4_1", 32, 20),
        KVCacheType("q4_0", 32, 18),
        KVCacheType("iq4_nl", 32, 18),
    )
}


def parse_kv_cache_type(raw: str | None, *, source: str = "CONTENOX_LLAMA_KV_CACHE_TYPE") -> KVCacheType:
    """The cache type the worker will run. Unset/empty = f16; anything unknown is an error.

    Case and surrounding blanks are forgiven (``Q8_0`` means q8_0 — the name handed to
    llama-server is the canonical one), an unknown name never silently becomes f16.
    """
    if raw is None or raw.strip() == "":
        return KV_CACHE_TYPES[DEFAULT_KV_CACHE_TYPE]
    key = raw.strip().lower()
    if key in KV_CACHE_TYPES:
        return KV_CACHE_TYPES[key]
    accepted = ", ".join(KV_CACHE_TYPES)
    raise UsageError(
        f"{source}={raw!r} is not a KV cache type llama.cpp accepts (accepted: {accepted})",
        hint=f"set {source} to one of: {accepted} (unset means f16; q8_0 halves the window's cost)",
        value=raw,
        accepted=list(KV_CACHE_TYPES),
    )


def pad_cells(tokens: int) -> int:
    """GGML_PAD(tokens, 256)."""
    return -(-tokens // KV_CELL_PAD_TOKENS) * KV_CELL_PAD_TOKENS


@dataclass(frozen=True)
class KVLayerShape:
    """``count`` layers each holding ``k_elems`` + ``v_elems`` per cell; ``window_tokens`` = SWA."""

    count: int
    k_elems: int
    v_elems: int
    window_tokens: int | None = None

    def bytes_per_cell(self, cache_type: KVCacheType) -> int:
        return self.count * (cache_type.row_bytes(self.k_elems) + cache_type.row_bytes(self.v_elems))


def openvino_state_bytes_per_token(kv_heads: int, head_dim: int, precision: str, *, is_key: bool) -> int:
    """Bytes one cached token costs in one K or V state of OpenVINO's CPU cache at ``precision``."""
    if precision in ("f16", "bf16"):
        return kv_heads * head_dim * 2
    if precision == "u8":
        # Measured on the CPU plugin (tests/test_openvino.py): keys carry a per-channel scale and zero
        # point per 32-token block (head_dim/4 bytes per token), values a per-token pair (8 bytes).
        return kv_heads * (head_dim + (head_dim // 4 if is_key else 8))
    raise ValueError(f"no byte model for OpenVINO KV precision {precision!r}")


def openvino_layer_bytes_per_token(group: LayerGroup, precision: str) -> int:
    """K + V bytes per token of one layer of ``group`` at OpenVINO ``precision``."""
    return (openvino_state_bytes_per_token(group.n_kv_heads, group.head_dim_k, precision, is_key=True)
            + openvino_state_bytes_per_token(group.n_kv_heads, group.head_dim_v, precision, is_key=False))


@dataclass(frozen=True)
class PagedKV:
    """OpenVINO's cache: whole ``block_tokens`` blocks at a fixed cost per token per KV type."""

    block_tokens: int
    bytes_per_token: tuple[tuple[str, int], ...]  # (plan KV type name: f16, bf16, q8_0; bytes per token)

    def per_token(self, cache_type: KVCacheType) -> int:
        for name, cost in self.bytes_per_token:
            if name == cache_type.name:
                return cost
        raise ValueError(f"KV type {cache_type.name} has no OpenVINO precision "
                         f"(supported: {', '.join(n for n, _ in self.bytes_per_token)})")

    def supports(self, cache_type: KVCacheType) -> bool:
        return any(name == cache_type.name for name, _ in self.bytes_per_token)


def openvino_paged_kv(groups: tuple[LayerGroup, ...], n_layers: int, *, dense: bool) -> PagedKV:
    """The OpenVINO price of ``groups``; ``dense`` (MLA, hybrid) charges every layer the costliest layer."""
    table = []
    for name, precision in OPENVINO_KV_PRECISIONS.items():
        costs = [(g.count, openvino_layer_bytes_per_token(g, precision)) for g in groups]
        table.append((name, n_layers * max(c for _, c in costs) if dense else sum(n * c for n, c in costs)))
    return PagedKV(OPENVINO_KV_BLOCK_TOKENS, tuple(table))


@dataclass(frozen=True)
class LayerKVProfile:
    """The per-layer KV geometry selection budgets with, plus the context ceiling it may open."""

    shapes: tuple[KVLayerShape, ...]
    context_limit_tokens: int
    basis: str  # how the profile was derived ("exact", "gemma: larger footprint", "dense: MLA", ...)
    paged: PagedKV | None = None  # set: priced as OpenVINO's cache, not llama.cpp's

    @property
    def step_tokens(self) -> int:
        """The granularity the allocation grows by (llama.cpp's 256-cell pad, OpenVINO's block)."""
        return self.paged.block_tokens if self.paged is not None else KV_CELL_PAD_TOKENS

    @property
    def n_layers(self) -> int:
        return sum(s.count for s in self.shapes)


@dataclass(frozen=True)
class UnknownKV:
    """Why no profile could be built: the model is excluded from automatic selection."""

    reason: str


def kv_bytes(profile: LayerKVProfile, tokens: int, cache_type: KVCacheType,
             ubatch_tokens: int = LLAMA_UBATCH_TOKENS) -> int:
    """Bytes llama.cpp (or, for a paged profile, OpenVINO) allocates for a ``tokens`` window."""
    if tokens <= 0:
        return 0
    if profile.paged is not None:
        block = profile.paged.block_tokens
        return -(-tokens // block) * block * profile.paged.per_token(cache_type)
    cells = pad_cells(tokens)
    total = 0
    for shape in profile.shapes:
        if shape.window_tokens is None:
            shape_cells = cells
        else:
            shape_cells = pad_cells(min(cells, shape.window_tokens + ubatch_tokens))
        total += shape.bytes_per_cell(cache_type) * shape_cells
    return total


def context_for_budget(profile: LayerKVProfile, budget_bytes: int, cache_type: KVCacheType,
                       ceiling_tokens: int, ubatch_tokens: int = LLAMA_UBATCH_TOKENS) -> int:
    """The largest n ≤ ceiling with kv_bytes(n) ≤ budget (0 if not even one padded block fits).

    kv_bytes is constant on each step (llama.cpp's 256-cell block, OpenVINO's 32-token block) and
    non-decreasing, so the answer is min(ceiling, step·k) for the largest block count k that fits;
    found by bisection on integers.
    """
    if budget_bytes <= 0 or ceiling_tokens <= 0:
        return 0
    step = profile.step_tokens
    lo, hi = 0, -(-ceiling_tokens // step)  # invariant: lo blocks fit
    if kv_bytes(profile, hi * step, cache_type, ubatch_tokens) <= budget_bytes:
        return ceiling_tokens
    while hi - lo > 1:  # hi blocks do not fit
        mid = (lo + hi) // 2
        if kv_bytes(profile, mid * step, cache_type, ubatch_tokens) <= budget_bytes:
            lo = mid
        else:
            hi = mid
    return min(ceiling_tokens, lo * step)


def _is_gemma(architecture: str | None) -> bool:
    return architecture is not None and architecture.lower().startswith("gemma")


def layer_profile(entry: Entry, max_context_tokens: int | None = None) -> LayerKVProfile | UnknownKV:
    """The KV profile selection budgets ``entry`` with, or why it cannot have one.

    ``max_context_tokens`` additionally caps the ceiling (the 286720-token product cap).
    """
    cfg = entry.config
    if entry.context_limit is None or entry.context_limit <= 0:
        return UnknownKV("context ceiling not verified")
    ceiling = entry.context_limit if max_context_tokens is None else min(entry.context_limit, max_context_tokens)
    groups = cfg.layer_groups
    if not groups:
        return UnknownKV("KV geometry (layers, KV heads, head dims) not verified")
    for g in groups:
        if g.count <= 0 or g.n_kv_heads <= 0 or g.head_dim_k <= 0 or g.head_dim_v <= 0:
            return UnknownKV(f"KV geometry incomplete: layer group {g}")
        if g.window_tokens is not None and g.window_tokens <= 0:
            return UnknownKV(f"sliding window not positive: layer group {g}")
    covered = sum(g.count for g in groups)
    n_layers = cfg.n_layers if cfg.n_layers is not None else covered
    if covered > n_layers:
        return UnknownKV(f"layer groups cover {covered} layers but the model has {n_layers}")

    # The larger of K and V element counts across groups: the footprint of the costliest layer.
    def footprint(g: LayerGroup) -> tuple[int, int]:
        return (g.n_kv_heads * g.head_dim_k, g.n_kv_heads * g.head_dim_v)

    widest_k = max(footprint(g)[0] for g in groups)
    widest_v = max(footprint(g)[1] for g in groups)

    if cfg.mla or cfg.recurrent:
        # Spec: MLA and recurrent/hybrid models get a conservative dense estimate — every layer
        # a full-attention layer at the widest recorded shape, no compression or state savings.
        kind = "MLA" if cfg.mla else "recurrent/hybrid"
        shape = KVLayerShape(n_layers, widest_k, widest_v, None)
        paged = openvino_paged_kv(groups, n_layers, dense=True) if entry.layout.paged_kv else None
        return LayerKVProfile((shape,), ceiling, f"dense ({kind} budgeted as full attention on all {n_layers} layers)",
                              paged)

    if covered != n_layers:
        return UnknownKV(f"layer groups cover {covered} of {n_layers} layers")

    if entry.layout.paged_kv:
        # GenAI's paged cache: every layer holds the whole window, in 32-token blocks (module docstring).
        shapes = tuple(KVLayerShape(g.count, *footprint(g), None) for g in groups)
        return LayerKVProfile(shapes, ceiling, "openvino (paged blocks, per layer group)",
                              openvino_paged_kv(groups, n_layers, dense=False))

    if _is_gemma(entry.architecture):
        # Spec: Gemma profiles use the larger per-layer footprint across the two attention types,
        # and assume no saving from shared KV or K = V; windowed layers still stop at the window.
        shapes = tuple(KVLayerShape(g.count, widest_k, widest_v, g.window_tokens) for g in groups)
        return LayerKVProfile(shapes, ceiling, "gemma (larger per-layer footprint on every layer)")

    shapes = tuple(KVLayerShape(g.count, *footprint(g), g.window_tokens) for g in groups)
    return LayerKVProfile(shapes, ceiling, "exact (per layer group)")


def allocation_kv_bytes(entry: Entry, tokens: int, cache_type: KVCacheType | str,
                        ubatch_tokens: int = LLAMA_UBATCH_TOKENS) -> int | None:
    """What llama.cpp itself should allocate for the recorded KV-owning layers — the exact
    per-group figure, without the spec's conservative Gemma/MLA/recurrent rules. For checking a
    real allocation (stages/recheck), never for budgeting. None when the recorded geometry cannot
    predict it: MLA (llama.cpp caches a compressed latent the registry does not record), or a
    non-hybrid model whose groups do not cover every layer. Gemma's shared-KV layers (E2B/E4B) are
    not recorded either, so for those this is still an upper bound."""
    ct = KV_CACHE_TYPES[cache_type] if isinstance(cache_type, str) else cache_type
    cfg = entry.config
    if cfg.mla or not cfg.layer_groups:
        return None
    covered = sum(g.count for g in cfg.layer_groups)
    if not cfg.recurrent and cfg.n_layers is not None and covered != cfg.n_layers:
        return None
    shapes = tuple(KVLayerShape(g.count, g.n_kv_heads * g.head_dim_k, g.n_kv_heads * g.head_dim_v, g.window_tokens)
                   for g in cfg.layer_groups)
    return kv_bytes(LayerKVProfile(shapes, max(tokens, 1), "allocation"), tokens, ct, ubatch_tokens)

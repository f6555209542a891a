"""The memory budget of one device and what one model needs in it (pure: no I/O, integers only).

Spec sections "Selection and hot context", "The small-device class", "The KV cache type is an input".

Budget of a device (``device_budget``)::

    reserve  = max(floor, 10 % of total), at most 25 % of total     (kept for every other client)
    headroom = ceil(3 % of (free - reserve))                           (allocator fragmentation)
    usable   = free - reserve - headroom                               (never below 0)

Per model (``model_fit``)::

    allowance  = max(ceil(weights / 4), 256 MiB)     weights = artifact + projector
    kv_budget  = usable - weights - allowance
    hot tokens = context_for_budget(kv_budget) at the worker's KV type,
                 capped at min(verified ceiling, 286720)

``required_free_bytes`` / ``required_device_bytes`` invert the budget exactly (the refusal's figures).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hotfit.core.entry import Entry
from hotfit.core.records import field_dict
from hotfit.registry.kv import (
    OPENVINO_KV_PRECISIONS,
    KVCacheType,
    LayerKVProfile,
    UnknownKV,
    context_for_budget,
    kv_bytes,
    layer_profile,
)

MiB = 1 << 20
GiB = 1 << 30

# Spec: "A model must first hold MinAgenticHotContext (32768 tokens) of usable context".
MIN_AGENTIC_HOT_CONTEXT = 32768
# Spec: "Context is capped at the lesser of the verified model limit and 286720 tokens" (280 Ki).
MAX_HOT_CONTEXT_TOKENS = 286720

# Accelerator reserve for every other client of the card (compositor, browsers through PRIME):
# contenox's rule, max(512 MiB, 10 % of total) capped at 25 % of total (contenox-facts §a).
ACCEL_RESERVE_FLOOR_BYTES = 512 * MiB
# Host RAM reserve: the same shape with a 1 GiB floor. On the CPU path the operating system,
# hotfit itself and llama-server's host-side buffers live in the same pool, and exhausting
# MemAvailable means swapping or the OOM killer rather than a clean allocation failure.
HOST_RESERVE_FLOOR_BYTES = 1 * GiB
RESERVE_FRACTION = (1, 10)
RESERVE_CAP_FRACTION = (1, 4)
# Fragmentation headroom: 3 % of what is left after the reserve. Allocators (CUDA's caching
# allocator, ggml's buffer pools) lose a little to alignment and fragmentation; 3 % is "small"
# per the spec and reproduces its small-device figure (~75K f16 tokens for minicpm5-2b on a
# 6 GiB card with 5.6 GiB free). A ratio of integers so the budget stays exact.
FRAGMENTATION_HEADROOM = (3, 100)
# Spec: "a conservative runtime allowance of the larger of one quarter of weight bytes or 256 MiB"
# on weights + projector (contenox-auto-facts: max((weights + projector) / 4, 256 MiB)).
RUNTIME_ALLOWANCE_FRACTION = (1, 4)
RUNTIME_ALLOWANCE_FLOOR_BYTES = 256 * MiB

ACCELERATOR_KINDS = frozenset({"nvidia", "amd", "vulkan"})
HOST_KIND = "cpu"  # host RAM: planned like any device, never added to an accelerator's memory
DEVICE_KINDS = ACCELERATOR_KINDS | {HOST_KIND}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def fmt_bytes(n: int) -> str:
    """Human figure plus the exact count where it matters: '4.12 GiB'."""
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.0f} MiB"


# --------------------------------------------------------------------------- device budget


def reserve_bytes(kind: str, total_bytes: int) -> int:
    """The reserve floor kept for every other client of the device."""
    floor = ACCEL_RESERVE_FLOOR_BYTES if kind in ACCELERATOR_KINDS else HOST_RESERVE_FLOOR_BYTES
    num, den = RESERVE_FRACTION
    reserve = max(floor, total_bytes * num // den)
    if total_bytes > 0:
        cnum, cden = RESERVE_CAP_FRACTION
        reserve = min(reserve, total_bytes * cnum // cden)
    return reserve


def headroom_bytes(after_reserve_bytes: int) -> int:
    num, den = FRAGMENTATION_HEADROOM
    return _ceil_div(max(after_reserve_bytes, 0) * num, den)


@dataclass(frozen=True)
class DeviceBudget:
    """What the planner may spend on one device. ``kind`` None = a bare usable figure (tests,
    callers that already hold a budget): then reserve and headroom are 0 and required-free
    figures are reported as usable bytes."""

    kind: str | None
    name: str
    total_bytes: int
    free_bytes: int
    reserve_bytes: int
    headroom_bytes: int
    usable_bytes: int

    @classmethod
    def from_usable(cls, usable_bytes: int, name: str = "budget") -> DeviceBudget:
        return cls(None, name, 0, usable_bytes, 0, 0, usable_bytes)

    def to_json(self) -> dict[str, object]:
        # beside a plan's other facts, a bare "kind"/"name" would not say they are the device's
        return {"device_kind": self.kind, "device_name": self.name, **field_dict(self, omit=("kind", "name"))}


def device_budget(kind: str, total_bytes: int, free_bytes: int, name: str = "") -> DeviceBudget:
    reserve = reserve_bytes(kind, total_bytes)
    after_reserve = max(free_bytes - reserve, 0)
    headroom = headroom_bytes(after_reserve)
    return DeviceBudget(kind, name, total_bytes, free_bytes, reserve, headroom, after_reserve - headroom)


def required_free_bytes(need_usable_bytes: int, kind: str, total_bytes: int) -> int:
    """The least free memory whose budget has ``usable ≥ need`` — the exact inverse of
    device_budget: usable(a) = a - ceil(3a/100) = floor(97a/100) over a = free - reserve, so the
    least a is ceil(100·need/97)."""
    num, den = FRAGMENTATION_HEADROOM
    after_reserve = _ceil_div(max(need_usable_bytes, 0) * den, den - num)
    return reserve_bytes(kind, total_bytes) + after_reserve


def required_device_bytes(need_usable_bytes: int, kind: str) -> int:
    """The least size of an otherwise empty device of ``kind`` (free = total) whose budget has
    ``usable ≥ need``. Unlike :func:`required_free_bytes` the reserve here grows with the device
    (10 % of its total), so this is the number for "use a larger device". usable(F) is
    non-decreasing in F, so the least F is found by bisection on integers."""
    need = max(need_usable_bytes, 0)
    lo, hi = 0, max(2 * need, 8 * GiB)  # usable(hi) ≥ hi·0.97·0.75 - … ≥ need; usable(lo) < need or need == 0
    while device_budget(kind, hi, hi).usable_bytes < need:
        hi *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if device_budget(kind, mid, mid).usable_bytes >= need:
            hi = mid
        else:
            lo = mid
    return hi


def runtime_allowance(weights_bytes: int) -> int:
    num, den = RUNTIME_ALLOWANCE_FRACTION
    return max(_ceil_div(weights_bytes * num, den), RUNTIME_ALLOWANCE_FLOOR_BYTES)


# --------------------------------------------------------------------------- one model


@dataclass(frozen=True)
class ModelFit:
    weights_bytes: int
    allowance_bytes: int
    kv_budget_bytes: int  # usable - weights - allowance; negative = the weights do not fit
    hot_context_tokens: int
    kv_bytes: int  # what the hot window allocates at the KV type
    ceiling_tokens: int
    profile: LayerKVProfile = field(repr=False)

    def floor_need_bytes(self, cache_type: KVCacheType) -> int:
        """Usable bytes needed to hold the agentic floor."""
        return self.weights_bytes + self.allowance_bytes + kv_bytes(self.profile, MIN_AGENTIC_HOT_CONTEXT, cache_type)


def model_profile(entry: Entry) -> LayerKVProfile | UnknownKV:
    """The KV profile, or why the entry's metadata is unknown (weights included)."""
    if entry.weights_bytes is None:
        return UnknownKV("artifact size not verified (weights bytes unknown)")
    return layer_profile(entry, MAX_HOT_CONTEXT_TOKENS)


def unpriceable(profile: LayerKVProfile, cache_type: KVCacheType) -> UnknownKV | None:
    """An OpenVINO entry at a KV type its runtime has no precision for has no KV price at all."""
    if profile.paged is not None and not profile.paged.supports(cache_type):
        supported = ", ".join(OPENVINO_KV_PRECISIONS)
        return UnknownKV(f"OpenVINO has no KV precision for {cache_type.name} (supported: {supported}; "
                         "q8_0 runs as u8)")
    return None


def model_fit(entry: Entry, usable_bytes: int, cache_type: KVCacheType) -> ModelFit | UnknownKV:
    """An OpenVINO entry's profile is priced as OpenVINO's paged cache (registry.kv.PagedKV)."""
    profile = model_profile(entry)
    if isinstance(profile, UnknownKV):
        return profile
    unpriced = unpriceable(profile, cache_type)
    if unpriced is not None:
        return unpriced
    weights = entry.weights_bytes
    assert weights is not None
    allowance = runtime_allowance(weights)
    kv_budget = usable_bytes - weights - allowance
    hot = context_for_budget(profile, kv_budget, cache_type, profile.context_limit_tokens)
    return ModelFit(weights, allowance, kv_budget, hot, kv_bytes(profile, hot, cache_type),
                    profile.context_limit_tokens, profile)

"""Budget, automatic selection and the fail-closed refusal (pure: no I/O, integers only).

Spec sections "Selection and hot context", "The agentic baseline", "The small-device class",
"The KV cache type is an input", "Exclusions and backend differences".

Budget of a device (``device_budget``)::

    reserve  = max(floor, 10 % of total), at most 25 % of total     (kept for every other client)
    headroom = ceil(3 % of (free - reserve))                           (allocator fragmentation)
    usable   = free - reserve - headroom                               (never below 0)

Per model (``model_fit``)::

    allowance  = max(ceil(weights / 4), 256 MiB)     weights = artifact + projector
    kv_budget  = usable - weights - allowance
    hot tokens = context_for_budget(kv_budget) at the worker's KV type,
                 capped at min(verified ceiling, 286720)

A model qualifies when it is agentic, auto-eligible (and of a permissive licence),
of the planned backend and origin, with known metadata, and holds ≥ 32768 hot tokens. The larger
model (parameters) wins, then the larger hot context, then the name; a still-qualifying
``previous`` model is kept. When nothing qualifies, ``Refusal`` names the smallest agentic model
of that origin and the free memory it would need, computed by inverting the budget exactly.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Iterable, Literal

from core.errors import NoModelQualifies, UsageError
from registry.kv import (
    KV_CACHE_TYPES,
    OPENVINO_KV_PRECISIONS,
    KVCacheType,
    LayerKVProfile,
    UnknownKV,
    context_for_budget,
    kv_bytes,
    layer_profile,
)
from core.entry import BACKENDS, ORIGINS, PERMISSIVE_LICENSES, Entry

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
ORIGIN_ALL = "auto"

ReasonCode = Literal[
    "ok", "backend", "origin", "tier", "eligibility", "unknown_metadata", "memory", "context_floor"
]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def fmt_bytes(n: int) -> str:
    """Human figure plus the exact count where it matters: '4.12 GiB'."""
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.0f} MiB"


# --------------------------------------------------------------------------- inputs


def normalize_origin(raw: str | None) -> str | None:
    """None for 'all origins' (unset, empty, 'auto'); a valid origin; else a UsageError."""
    if raw is None or raw.strip() == "" or raw.strip().lower() == ORIGIN_ALL:
        return None
    key = raw.strip().lower()
    if key in ORIGINS:
        return key
    valid = ", ".join((ORIGIN_ALL, *ORIGINS))
    raise UsageError(f"unknown origin {raw!r} (valid: {valid})",
                     hint=f"use one of {valid}; 'auto' or no origin allows all", origin=raw, valid=[ORIGIN_ALL, *ORIGINS])


def normalize_backend(raw: str | None) -> str:
    key = (raw or "llama").strip().lower()
    if key in BACKENDS:
        return key
    raise UsageError(f"unknown backend {raw!r} (valid: {', '.join(BACKENDS)})",
                     hint=f"use --backend {' or --backend '.join(BACKENDS)}", backend=raw, valid=list(BACKENDS))


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
    def from_usable(cls, usable_bytes: int, name: str = "budget") -> "DeviceBudget":
        return cls(None, name, 0, usable_bytes, 0, 0, usable_bytes)

    def to_json(self) -> dict[str, object]:
        return {
            "device_kind": self.kind,
            "device_name": self.name,
            "total_bytes": self.total_bytes,
            "free_bytes": self.free_bytes,
            "reserve_bytes": self.reserve_bytes,
            "headroom_bytes": self.headroom_bytes,
            "usable_bytes": self.usable_bytes,
        }


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


def _unpriceable(profile: LayerKVProfile, cache_type: KVCacheType) -> UnknownKV | None:
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
    unpriced = _unpriceable(profile, cache_type)
    if unpriced is not None:
        return unpriced
    weights = entry.weights_bytes
    assert weights is not None
    allowance = runtime_allowance(weights)
    kv_budget = usable_bytes - weights - allowance
    hot = context_for_budget(profile, kv_budget, cache_type, profile.context_limit_tokens)
    return ModelFit(weights, allowance, kv_budget, hot, kv_bytes(profile, hot, cache_type),
                    profile.context_limit_tokens, profile)


# --------------------------------------------------------------------------- verdicts


@dataclass(frozen=True)
class Verdict:
    entry: Entry
    verdict: Literal["selected", "qualifies", "excluded"]
    reason_code: ReasonCode
    reason: str
    fit: ModelFit | None

    @property
    def hot_context_tokens(self) -> int | None:
        return None if self.fit is None else self.fit.hot_context_tokens

    def to_json(self) -> dict[str, object]:
        f = self.fit
        return {
            "name": self.entry.name,
            "verdict": self.verdict,
            "reason": self.reason,
            "reason_code": self.reason_code,
            "hot_context": None if f is None else f.hot_context_tokens,
            "agentic_tier": self.entry.agentic_tier,
            "origin": self.entry.origin,
            "backend": self.entry.backend,
            "params_total_b": self.entry.params_total_b,
            "weights_bytes": None if f is None else f.weights_bytes,
            "allowance_bytes": None if f is None else f.allowance_bytes,
            "kv_budget_bytes": None if f is None else f.kv_budget_bytes,
        }


def _eligibility_problem(entry: Entry) -> str | None:
    if not entry.auto_eligible:
        return f"not auto-eligible: {entry.ineligible_reason or 'no reason recorded'}"
    if entry.license not in PERMISSIVE_LICENSES:
        return f"licence {entry.license!r} is not {' or '.join(PERMISSIVE_LICENSES)}"
    return None


def evaluate(entry: Entry, budget: DeviceBudget, cache_type: KVCacheType, *,
             origin: str | None, backend: str) -> Verdict:
    """Why ``entry`` does or does not qualify for automatic selection (verdict 'qualifies'/'excluded')."""
    fit = model_fit(entry, budget.usable_bytes, cache_type)
    known = fit if isinstance(fit, ModelFit) else None

    def excluded(code: ReasonCode, reason: str) -> Verdict:
        return Verdict(entry, "excluded", code, reason, known)

    if entry.backend != backend:
        return excluded("backend", f"backend {entry.backend}, planning for {backend}")
    if origin is not None and entry.origin != origin:
        return excluded("origin", f"origin {entry.origin}, planning for {origin} (explicit origins never fall back)")
    if entry.agentic_tier != "agentic":
        return excluded("tier", f"tier {entry.agentic_tier}: only agentic models are picked automatically "
                                f"(installable by name)")
    problem = _eligibility_problem(entry)
    if problem:
        return excluded("eligibility", problem)
    if isinstance(fit, UnknownKV):
        return excluded("unknown_metadata", f"unknown metadata: {fit.reason}")
    if entry.params_total_b is None:
        return excluded("unknown_metadata", "unknown metadata: parameter count not recorded")
    assert known is not None
    if known.ceiling_tokens < MIN_AGENTIC_HOT_CONTEXT:
        return excluded("context_floor", f"context ceiling {known.ceiling_tokens} is below the "
                                         f"{MIN_AGENTIC_HOT_CONTEXT}-token floor at any budget")
    if known.hot_context_tokens == 0:
        if known.kv_budget_bytes < 0:
            return excluded("memory", f"weights {fmt_bytes(known.weights_bytes)} + runtime allowance "
                                      f"{fmt_bytes(known.allowance_bytes)} exceed the usable "
                                      f"{fmt_bytes(budget.usable_bytes)}")
        return excluded("memory", f"KV budget {fmt_bytes(known.kv_budget_bytes)} holds no tokens "
                                  f"at {cache_type.name}")
    if known.hot_context_tokens < MIN_AGENTIC_HOT_CONTEXT:
        return excluded("context_floor", f"holds {known.hot_context_tokens} hot tokens at {cache_type.name}, "
                                         f"below the {MIN_AGENTIC_HOT_CONTEXT}-token floor")
    return Verdict(entry, "qualifies", "ok", f"holds {known.hot_context_tokens} hot tokens at {cache_type.name}",
                   known)


def _order_key(v: Verdict) -> tuple[float, int, str]:
    assert v.fit is not None and v.entry.params_total_b is not None
    return (-v.entry.params_total_b, -v.fit.hot_context_tokens, v.entry.name)


# --------------------------------------------------------------------------- refusal


@dataclass(frozen=True)
class RequiredMemory:
    """What the named model would need on this device to hold the floor, broken down."""

    name: str
    weights_bytes: int
    allowance_bytes: int
    kv_floor_bytes: int  # KV for MIN_AGENTIC_HOT_CONTEXT tokens at the KV type
    reserve_bytes: int
    headroom_bytes: int
    required_free_bytes: int  # sum of the above; a usable figure when the budget has no device
    # When required_free_bytes exceeds this device's total: the least size of an empty device of
    # this kind that holds it (its reserve is larger), else None.
    required_device_bytes: int | None = None

    @property
    def need_usable_bytes(self) -> int:
        return self.weights_bytes + self.allowance_bytes + self.kv_floor_bytes

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "required_free_bytes": self.required_free_bytes,
            "weights_bytes": self.weights_bytes,
            "allowance_bytes": self.allowance_bytes,
            "kv_floor_bytes": self.kv_floor_bytes,
            "reserve_bytes": self.reserve_bytes,
            "headroom_bytes": self.headroom_bytes,
            "required_device_bytes": self.required_device_bytes,
        }


def required_memory(entry: Entry, budget: DeviceBudget, cache_type: KVCacheType) -> RequiredMemory | None:
    """Free memory ``entry`` needs on this device to hold 32768 tokens; None if it never can."""
    profile = model_profile(entry)
    if isinstance(profile, UnknownKV) or profile.context_limit_tokens < MIN_AGENTIC_HOT_CONTEXT:
        return None
    if _unpriceable(profile, cache_type) is not None:
        return None
    weights = entry.weights_bytes
    assert weights is not None
    allowance = runtime_allowance(weights)
    kv_floor = kv_bytes(profile, MIN_AGENTIC_HOT_CONTEXT, cache_type)
    need = weights + allowance + kv_floor
    if budget.kind is None:
        return RequiredMemory(entry.name, weights, allowance, kv_floor, 0, 0, need)
    required = required_free_bytes(need, budget.kind, budget.total_bytes)
    reserve = reserve_bytes(budget.kind, budget.total_bytes)
    device = required_device_bytes(need, budget.kind) if required > budget.total_bytes else None
    return RequiredMemory(entry.name, weights, allowance, kv_floor, reserve, required - reserve - need, required,
                          device)


@dataclass(frozen=True)
class Refusal:
    origin: str | None
    backend: str
    cache_type: str
    budget: DeviceBudget
    smallest: RequiredMemory | None  # None = no agentic model of this origin/backend at any budget
    below_tier: Verdict | None  # a tool-chat model that would fit, installable by name
    alternatives: tuple[str, ...]
    message: str

    def error(self) -> NoModelQualifies:
        return NoModelQualifies(
            self.message,
            hint="; ".join(self.alternatives),
            origin=self.origin or ORIGIN_ALL,
            backend=self.backend,
            kv_cache_type=self.cache_type,
            budget=self.budget.to_json(),
            smallest=None if self.smallest is None else self.smallest.to_json(),
            below_tier=None if self.below_tier is None else {
                "name": self.below_tier.entry.name, "agentic_tier": self.below_tier.entry.agentic_tier,
                "hot_context": self.below_tier.hot_context_tokens},
            alternatives=list(self.alternatives),
        )

    def to_json(self) -> dict[str, object]:
        return {
            "code": NoModelQualifies.code,
            "message": self.message,
            "smallest": None if self.smallest is None else self.smallest.to_json(),
            "below_tier": None if self.below_tier is None else {
                "name": self.below_tier.entry.name, "agentic_tier": self.below_tier.entry.agentic_tier,
                "hot_context": self.below_tier.hot_context_tokens},
            "alternatives": list(self.alternatives),
        }


def _agentic_pool(entries: Iterable[Entry], origin: str | None, backend: str) -> list[Entry]:
    return [e for e in entries
            if e.backend == backend and (origin is None or e.origin == origin)
            and e.agentic_tier == "agentic" and _eligibility_problem(e) is None and e.params_total_b is not None]


def smallest_agentic(entries: Iterable[Entry], budget: DeviceBudget, cache_type: KVCacheType, *,
                     origin: str | None, backend: str) -> RequiredMemory | None:
    """The agentic model of this origin/backend needing the least free memory for the floor."""
    needs = [r for e in _agentic_pool(entries, origin, backend)
             if (r := required_memory(e, budget, cache_type)) is not None]
    if not needs:
        return None
    return min(needs, key=lambda r: (r.required_free_bytes, r.name))


@dataclass(frozen=True)
class _Words:
    """How a refusal names the memory it speaks of: a GPU's memory is device memory, host RAM is
    host memory (an operator reading "device memory" on a CPU-only machine looks for a GPU)."""

    memory: str  # "device memory" | "host memory"
    this_one: str  # "this device" | "this host"
    total: str  # "this device's total" | "this host's total memory"
    empty: str  # "an otherwise empty device" | "an otherwise idle host"
    other: str  # "a device" | "a host"


def _words(kind: str | None) -> _Words:
    if kind is not None and kind not in ACCELERATOR_KINDS:
        return _Words("host memory", "this host", "this host's total memory", "an otherwise idle host", "a host")
    return _Words("device memory", "this device", "this device's total", "an otherwise empty device", "a device")


def origins_with_agentic_models(entries: Iterable[Entry], backend: str) -> tuple[str, ...]:
    """Origins (registry order) that have at least one automatically selectable model for ``backend``:
    the only ones worth suggesting to an operator whose origin refused."""
    pool = _agentic_pool(entries, None, backend)
    return tuple(o for o in ORIGINS if any(e.origin == o for e in pool))


def build_refusal(entries: tuple[Entry, ...], verdicts: tuple[Verdict, ...], budget: DeviceBudget,
                  cache_type: KVCacheType, *, origin: str | None, backend: str) -> Refusal:
    where = f"origin {origin or ORIGIN_ALL}, backend {backend}"
    words = _words(budget.kind)
    if budget.kind is None:
        budget_text = f"a usable budget of {fmt_bytes(budget.usable_bytes)} ({budget.usable_bytes} bytes)"
    else:
        budget_text = (f"a usable budget of {fmt_bytes(budget.usable_bytes)} ({budget.usable_bytes} bytes: "
                       f"{fmt_bytes(budget.free_bytes)} free on {budget.name or budget.kind} minus reserve "
                       f"{fmt_bytes(budget.reserve_bytes)} and headroom {fmt_bytes(budget.headroom_bytes)})")
    lines = [f"No curated agentic model ({where}) holds {MIN_AGENTIC_HOT_CONTEXT} tokens of hot context in "
             f"{budget_text} at KV type {cache_type.name}."]
    smallest = smallest_agentic(entries, budget, cache_type, origin=origin, backend=backend)
    if smallest is None:
        lines.append(f"There is no curated agentic model of {where} that holds {MIN_AGENTIC_HOT_CONTEXT} tokens "
                     f"at any budget.")
    else:
        unit = f"free {words.memory}" if budget.kind is not None else "usable memory"
        parts = (f"weights {fmt_bytes(smallest.weights_bytes)} + runtime allowance "
                 f"{fmt_bytes(smallest.allowance_bytes)} + KV for {MIN_AGENTIC_HOT_CONTEXT} tokens "
                 f"{fmt_bytes(smallest.kv_floor_bytes)}")
        if budget.kind is not None:
            parts += (f" + reserve {fmt_bytes(smallest.reserve_bytes)} + headroom "
                      f"{fmt_bytes(smallest.headroom_bytes)}")
        line = (f"The smallest curated agentic model of {where} is {smallest.name}; at {cache_type.name} it needs "
                f"{fmt_bytes(smallest.required_free_bytes)} ({smallest.required_free_bytes} bytes) of {unit}: "
                f"{parts}.")
        if smallest.required_device_bytes is not None:
            line += (f" That is more than {words.total} {fmt_bytes(budget.total_bytes)}; {words.empty} "
                     f"needs at least {fmt_bytes(smallest.required_device_bytes)} "
                     f"({smallest.required_device_bytes} bytes), its reserve being larger.")
        lines.append(line)
    fitting_below = sorted(
        (v for v in verdicts
         if v.entry.backend == backend and (origin is None or v.entry.origin == origin)
         and v.entry.agentic_tier == "tool-chat" and v.fit is not None
         and v.fit.hot_context_tokens >= MIN_AGENTIC_HOT_CONTEXT),
        key=lambda v: (-(v.entry.params_total_b or 0.0), -(v.hot_context_tokens or 0), v.entry.name))
    below = fitting_below[0] if fitting_below else None
    if below is not None:
        lines.append(f"A model below the agentic tier fits: {below.entry.name} ({below.entry.agentic_tier}, "
                     f"{below.hot_context_tokens} hot tokens); it can be installed by name "
                     f"(hotfit auto --model {below.entry.name}) at the operator's risk.")
    alternatives: list[str] = []
    # More memory helps only when some model of this origin holds the floor at some budget.
    if smallest is not None and smallest.required_device_bytes is not None:
        alternatives.append(f"raise the memory budget: use {words.other} with at "
                            f"least {fmt_bytes(smallest.required_device_bytes)} of {words.memory} "
                            f"({words.this_one} has {fmt_bytes(budget.total_bytes)} in all)")
    elif smallest is not None and budget.kind is not None:
        more = max(smallest.required_free_bytes - budget.free_bytes, 0)
        alternatives.append(f"raise the memory budget: free {fmt_bytes(more)} more {words.memory} on "
                            f"{words.this_one} (it needs {fmt_bytes(smallest.required_free_bytes)} free)")
    elif smallest is not None:
        alternatives.append(f"raise the usable budget to at least {fmt_bytes(smallest.required_free_bytes)}")
    # An explicit origin never falls back (spec); name only the origins that have a model to offer.
    # With origin auto every origin was already tried.
    if origin is not None:
        others = [o for o in origins_with_agentic_models(entries, backend) if o != origin]
        if others:
            alternatives.append(f"choose another origin ({', '.join(others)}, or auto for all)")
    alternatives.append("use a hosted backend instead of a local model")
    if smallest is not None and cache_type.name in ("f32", "f16", "bf16"):
        q8 = KV_CACHE_TYPES["q8_0"]
        alt = smallest_agentic(entries, budget, q8, origin=origin, backend=backend)
        if alt is not None:
            q8_need = (f"{words.empty} with at least {fmt_bytes(alt.required_device_bytes)} "
                       f"({alt.required_device_bytes} bytes)" if alt.required_device_bytes is not None
                       else f"{fmt_bytes(alt.required_free_bytes)} ({alt.required_free_bytes} bytes) free")
            alternatives.append(f"run the worker with CONTENOX_LLAMA_KV_CACHE_TYPE=q8_0 (about half the KV cost): "
                                f"{alt.name} then needs {q8_need}")
    lines.append("Alternatives: " + "; ".join(alternatives) + ".")
    return Refusal(origin, backend, cache_type.name, budget, smallest, below, tuple(alternatives), "\n".join(lines))


# --------------------------------------------------------------------------- selection


@dataclass(frozen=True)
class Selection:
    """The outcome of a selection: every candidate's verdict, and the pick or the refusal."""

    chosen: Verdict | None
    verdicts: tuple[Verdict, ...]
    budget: DeviceBudget
    cache_type: KVCacheType
    origin: str | None
    backend: str
    reused_previous: bool = False
    explicit: bool = False
    refusal: Refusal | None = None
    notes: tuple[str, ...] = ()

    def raise_if_refused(self) -> Verdict:
        if self.chosen is None:
            assert self.refusal is not None
            raise self.refusal.error()
        return self.chosen


def select_auto(entries: Iterable[Entry], budget: DeviceBudget, cache_type: KVCacheType, *,
                origin: str | None = None, backend: str = "llama", previous: str | None = None) -> Selection:
    """Every candidate's verdict and the automatic pick (or the refusal). Never raises for 'no fit';
    call ``raise_if_refused`` for the fail-closed error."""
    entries = tuple(entries)
    origin = normalize_origin(origin)
    backend = normalize_backend(backend)
    verdicts = [evaluate(e, budget, cache_type, origin=origin, backend=backend) for e in entries]
    qualifying = sorted((v for v in verdicts if v.verdict == "qualifies"), key=_order_key)
    notes: list[str] = []
    chosen: Verdict | None = None
    reused = False
    if previous:
        prev = next((v for v in qualifying if v.entry.name == previous), None)
        if prev is not None:
            chosen, reused = prev, True
        else:
            prev_v = next((v for v in verdicts if v.entry.name == previous), None)
            notes.append(f"previous model {previous} " + (
                "is not in the registry" if prev_v is None else f"no longer qualifies: {prev_v.reason}"))
    if chosen is None and qualifying:
        chosen = qualifying[0]
    final: list[Verdict] = []
    for v in verdicts:
        if chosen is not None and v.entry.name == chosen.entry.name:
            why = "kept as the previous model; " if reused else ""
            v = Verdict(v.entry, "selected", "ok", why + v.reason, v.fit)
            chosen = v
        final.append(v)
    refusal = None
    if chosen is None:
        refusal = build_refusal(entries, tuple(final), budget, cache_type, origin=origin, backend=backend)
    return Selection(chosen, tuple(final), budget, cache_type, origin, backend, reused, False, refusal, tuple(notes))


def select_explicit(entries: Iterable[Entry], name: str, budget: DeviceBudget, cache_type: KVCacheType, *,
                    origin: str | None = None, backend: str = "llama") -> Selection:
    """``--model NAME``: this entry or nothing. Tool-chat is allowed, the fit is still computed, and
    it fails closed (NoModelQualifies) when it cannot open the 32768-token floor. No fallback."""
    entries = tuple(entries)
    origin = normalize_origin(origin)
    backend = normalize_backend(backend)
    entry = next((e for e in entries if e.name == name), None)
    if entry is None:
        close = difflib.get_close_matches(name, [e.name for e in entries], n=3)
        raise UsageError(f"no registry entry named {name!r}" + (f" (did you mean {', '.join(close)}?)" if close else ""),
                         hint="hotfit registry list shows the downloadable entries", model=name)
    if entry.backend != backend:
        raise UsageError(f"{name} is a {entry.backend} entry, but the backend is {backend}",
                         hint=f"add --backend {entry.backend}", model=name)
    if origin is not None and entry.origin != origin:
        raise UsageError(f"{name} is of origin {entry.origin}, but --origin {origin} was given",
                         hint="drop --origin or choose a model of that origin", model=name)
    if entry.agentic_tier == "none":
        raise UsageError(f"{name} has agentic tier 'none': the runtime cannot read tool calls from its template",
                         hint="choose an agentic or tool-chat entry", model=name)
    fit = model_fit(entry, budget.usable_bytes, cache_type)
    if isinstance(fit, UnknownKV):
        raise NoModelQualifies(f"{name}: cannot verify that it holds {MIN_AGENTIC_HOT_CONTEXT} tokens — "
                               f"unknown metadata: {fit.reason}",
                               hint="choose an entry whose facts are verified (hotfit registry list), or record "
                                    "the missing facts in the registry", model=name, kv_cache_type=cache_type.name)
    notes: list[str] = []
    if entry.agentic_tier != "agentic":
        notes.append(f"{name} is {entry.agentic_tier}, below the agentic tier: installed by name at the operator's risk")
    problem = _eligibility_problem(entry)
    if problem:
        notes.append(f"{name} is {problem}")
    if fit.hot_context_tokens < MIN_AGENTIC_HOT_CONTEXT:
        words = _words(budget.kind)
        need = required_memory(entry, budget, cache_type)
        if need is None:
            what = (f"{name} cannot hold {MIN_AGENTIC_HOT_CONTEXT} tokens at any budget: its context ceiling is "
                    f"{fit.ceiling_tokens}")
        else:
            what = (f"{name} holds {fit.hot_context_tokens} hot tokens at {cache_type.name} in a usable budget of "
                    f"{fmt_bytes(budget.usable_bytes)}, below the {MIN_AGENTIC_HOT_CONTEXT}-token floor; it needs "
                    f"{fmt_bytes(need.required_free_bytes)} ({need.required_free_bytes} bytes) "
                    f"{'free' if budget.kind else 'usable'}: weights {fmt_bytes(need.weights_bytes)} + allowance "
                    f"{fmt_bytes(need.allowance_bytes)} + KV {fmt_bytes(need.kv_floor_bytes)} + reserve "
                    f"{fmt_bytes(need.reserve_bytes)} + headroom {fmt_bytes(need.headroom_bytes)}")
            if need.required_device_bytes is not None:
                what += (f"; that is more than {words.total} {fmt_bytes(budget.total_bytes)}: {words.empty} "
                         f"needs at least {fmt_bytes(need.required_device_bytes)} "
                         f"({need.required_device_bytes} bytes)")
        raise NoModelQualifies(what, hint=f"free {words.memory} on {words.this_one}, use q8_0 KV, or choose a "
                                          f"smaller model",
                               model=name, kv_cache_type=cache_type.name,
                               smallest=None if need is None else need.to_json())
    chosen = Verdict(entry, "selected", "ok", f"chosen by name; holds {fit.hot_context_tokens} hot tokens at "
                                              f"{cache_type.name}", fit)
    return Selection(chosen, (chosen,), budget, cache_type, origin, backend, False, True, None, tuple(notes))

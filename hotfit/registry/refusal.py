"""The fail-closed refusal when nothing qualifies (pure): the smallest agentic model of that origin
and the free memory it would need (the budget inverted exactly), what fits below the tier, and
the alternatives an operator has (spec, "Selection and hot context", "The small-device class").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from hotfit.core.entry import ORIGINS, Entry
from hotfit.core.errors import NoModelQualifies
from hotfit.core.records import field_dict
from hotfit.registry.budget import (
    ACCELERATOR_KINDS,
    MIN_AGENTIC_HOT_CONTEXT,
    DeviceBudget,
    fmt_bytes,
    model_profile,
    required_device_bytes,
    required_free_bytes,
    reserve_bytes,
    runtime_allowance,
    unpriceable,
)
from hotfit.registry.kv import KV_CACHE_TYPES, KVCacheType, UnknownKV, kv_bytes
from hotfit.registry.verdict import Verdict, eligibility_problem

ORIGIN_ALL = "auto"

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
        headline = {"name": self.name, "required_free_bytes": self.required_free_bytes}  # the sum before its parts
        return headline | field_dict(self, omit=headline)

    def described(self, budget: DeviceBudget) -> str:
        """What this need is, of which memory, broken down, and — where even the whole device of
        ``budget`` is too small — the least empty device that holds it: the one wording of the
        refusal and of a model named that cannot hold the floor (planner/select.py)."""
        words = words_for(budget.kind)
        unit = f"free {words.memory}" if budget.kind is not None else "usable memory"
        parts = (f"weights {fmt_bytes(self.weights_bytes)} + runtime allowance {fmt_bytes(self.allowance_bytes)} + "
                 f"KV for {MIN_AGENTIC_HOT_CONTEXT} tokens {fmt_bytes(self.kv_floor_bytes)}")
        if budget.kind is not None:
            parts += f" + reserve {fmt_bytes(self.reserve_bytes)} + headroom {fmt_bytes(self.headroom_bytes)}"
        text = f"{fmt_bytes(self.required_free_bytes)} ({self.required_free_bytes} bytes) of {unit}: {parts}."
        if self.required_device_bytes is not None:
            text += (f" That is more than {words.total} {fmt_bytes(budget.total_bytes)}; {words.empty} needs at "
                     f"least {fmt_bytes(self.required_device_bytes)} ({self.required_device_bytes} bytes), its "
                     "reserve being larger.")
        return text


def required_memory(entry: Entry, budget: DeviceBudget, cache_type: KVCacheType) -> RequiredMemory | None:
    """Free memory ``entry`` needs on this device to hold 32768 tokens; None if it never can."""
    profile = model_profile(entry)
    if isinstance(profile, UnknownKV) or profile.context_limit_tokens < MIN_AGENTIC_HOT_CONTEXT:
        return None
    if unpriceable(profile, cache_type) is not None:
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
            and e.agentic_tier == "agentic" and eligibility_problem(e) is None and e.params_total_b is not None]


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


def words_for(kind: str | None) -> _Words:
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
    words = words_for(budget.kind)
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
        line = (f"The smallest curated agentic model of {where} is {smallest.name}; at {cache_type.name} it needs "
                f"{smallest.described(budget)}")
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

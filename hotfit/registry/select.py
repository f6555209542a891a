"""Automatic selection and ``--model NAME`` (pure: no I/O, integers only).

Spec sections "Selection and hot context", "The agentic baseline", "Exclusions and backend
differences". Each candidate gets a verdict on the device's budget (registry/verdict.py, on the
arithmetic of registry/budget.py); the larger model (parameters) wins, then the larger hot context,
then the name; a still-qualifying ``previous`` model is kept. When nothing qualifies the selection
carries the fail-closed refusal (registry/refusal.py). ``--model NAME`` is that entry or nothing.

Split from one 668-line module at its seams (budget arithmetic, one verdict, the refusal, the
pick); this module re-exports their public names, the planner's one import surface.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Iterable

from hotfit.core.entry import BACKENDS, DEFAULT_BACKEND, ORIGINS, Entry
from hotfit.core.errors import NoModelQualifies, UsageError

# The planner's surface: registry.select re-exports the budget, verdict and refusal names its
# callers (stages/plan.py, pipeline/worker.py, stages/probe.py, the tests) import from here.
from hotfit.registry.budget import (
    ACCEL_RESERVE_FLOOR_BYTES,
    ACCELERATOR_KINDS,
    DEVICE_KINDS,
    FRAGMENTATION_HEADROOM,
    HOST_KIND,
    HOST_RESERVE_FLOOR_BYTES,
    MAX_HOT_CONTEXT_TOKENS,
    MIN_AGENTIC_HOT_CONTEXT,
    RESERVE_CAP_FRACTION,
    RESERVE_FRACTION,
    RUNTIME_ALLOWANCE_FLOOR_BYTES,
    RUNTIME_ALLOWANCE_FRACTION,
    DeviceBudget,
    GiB,
    MiB,
    ModelFit,
    device_budget,
    fmt_bytes,
    headroom_bytes,
    model_fit,
    model_profile,
    required_device_bytes,
    required_free_bytes,
    reserve_bytes,
    runtime_allowance,
)
from hotfit.registry.kv import KVCacheType, UnknownKV
from hotfit.registry.refusal import (
    ORIGIN_ALL,
    Refusal,
    RequiredMemory,
    build_refusal,
    origins_with_agentic_models,
    required_memory,
    smallest_agentic,
    words_for,
)
from hotfit.registry.speed import SLOW_FIRST_TOKEN_S, SpeedRequest, fmt_seconds, speed_shortfalls
from hotfit.registry.verdict import ReasonCode, Verdict, eligibility_problem, evaluate

__all__ = [
    "ACCEL_RESERVE_FLOOR_BYTES", "ACCELERATOR_KINDS", "DEVICE_KINDS", "FRAGMENTATION_HEADROOM", "HOST_KIND",
    "HOST_RESERVE_FLOOR_BYTES", "MAX_HOT_CONTEXT_TOKENS", "MIN_AGENTIC_HOT_CONTEXT", "ORIGIN_ALL",
    "RESERVE_CAP_FRACTION", "RESERVE_FRACTION", "RUNTIME_ALLOWANCE_FLOOR_BYTES", "RUNTIME_ALLOWANCE_FRACTION",
    "DeviceBudget", "GiB", "MiB", "ModelFit", "ReasonCode", "Refusal", "RequiredMemory", "Selection", "Verdict",
    "build_refusal", "device_budget", "eligibility_problem", "evaluate", "fmt_bytes", "headroom_bytes",
    "model_fit", "model_profile", "normalize_backend", "normalize_origin", "origins_with_agentic_models",
    "required_device_bytes", "required_free_bytes", "required_memory", "reserve_bytes", "runtime_allowance",
    "select_auto", "select_explicit", "smallest_agentic",
]


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
    key = (raw or DEFAULT_BACKEND).strip().lower()
    if key in BACKENDS:
        return key
    raise UsageError(f"unknown backend {raw!r} (valid: {', '.join(BACKENDS)})",
                     hint=f"use --backend {' or --backend '.join(BACKENDS)}", backend=raw, valid=list(BACKENDS))


def _order_key(v: Verdict) -> tuple[float, int, str]:
    assert v.fit is not None and v.entry.params_total_b is not None
    return (-v.entry.params_total_b, -v.fit.hot_context_tokens, v.entry.name)




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
    # tool-chat entries the caller admitted on grade evidence (``--admit-graded``); the caller checked it
    admitted: frozenset[str] = frozenset()
    # without speed floors, when the pick's predicted first token is slow: what a floor would choose
    speed_warning: str | None = None

    @property
    def admitted_by_grade(self) -> bool:
        """The pick is a tool-chat entry that qualified only through grade evidence."""
        return self.chosen is not None and self.chosen.entry.name in self.admitted \
            and self.chosen.entry.agentic_tier == "tool-chat"

    def raise_if_refused(self) -> Verdict:
        if self.chosen is None:
            assert self.refusal is not None
            raise self.refusal.error()
        return self.chosen


def _evaluate(entry: Entry, budget: DeviceBudget, cache_type: KVCacheType, *, origin: str | None, backend: str,
              admitted: frozenset[str]) -> Verdict:
    """:func:`evaluate`, with a tool-chat entry in ``admitted`` judged as if agentic: it earned its place
    by a grade, every other rule (backend, origin, eligibility, memory, floor) still holds."""
    if entry.name not in admitted or entry.agentic_tier != "tool-chat":
        return evaluate(entry, budget, cache_type, origin=origin, backend=backend)
    v = evaluate(dataclasses.replace(entry, agentic_tier="agentic"), budget, cache_type, origin=origin,
                 backend=backend)
    reason = f"admitted by grade evidence (tool-chat); {v.reason}" if v.verdict == "qualifies" else v.reason
    return Verdict(entry, v.verdict, v.reason_code, reason, v.fit)


def select_auto(entries: Iterable[Entry], budget: DeviceBudget, cache_type: KVCacheType, *,
                origin: str | None = None, backend: str = DEFAULT_BACKEND, previous: str | None = None,
                admitted: Iterable[str] = (), speed: SpeedRequest | None = None) -> Selection:
    """Every candidate's verdict and the automatic pick (or the refusal). Never raises for 'no fit';
    call ``raise_if_refused`` for the fail-closed error. ``admitted``: tool-chat entry names the caller
    found valid grade evidence for (``--admit-graded``; default none: curation only). ``speed``: predict
    every candidate's speed on the device and hold them to its opt-in floors (registry/speed.py)."""
    entries = tuple(entries)
    origin = normalize_origin(origin)
    backend = normalize_backend(backend)
    admitted = frozenset(admitted)
    verdicts = [_evaluate(e, budget, cache_type, origin=origin, backend=backend, admitted=admitted) for e in entries]
    if speed is not None:
        verdicts = [_with_speed(v, speed, cache_type) for v in verdicts]
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
            v = dataclasses.replace(v, verdict="selected", reason_code="ok", reason=why + v.reason)
            chosen = v
        final.append(v)
    refusal = None
    if chosen is None:
        refusal = (speed_refusal(tuple(final), speed, budget, cache_type, origin=origin, backend=backend)
                   if speed is not None else None) or build_refusal(
            entries, tuple(final), budget, cache_type, origin=origin, backend=backend)
    warning = None if speed is None or chosen is None else slow_first_token_warning(chosen, qualifying, speed)
    return Selection(chosen, tuple(final), budget, cache_type, origin, backend, reused, False, refusal, tuple(notes),
                     admitted, warning)


# --------------------------------------------------------------------------- speed (registry/speed.py)


def _with_speed(v: Verdict, speed: SpeedRequest, cache_type: KVCacheType) -> Verdict:
    """``v`` with its predicted speed; a qualifying candidate below an opt-in floor (``--min-context``,
    ``--min-decode-tokens-per-s``, ``--max-first-token-s``) becomes ineligible, the figures named."""
    predicted = speed.predict(v.entry, cache_type)
    v = dataclasses.replace(v, speed=predicted)
    if v.verdict != "qualifies" or v.fit is None:
        return v
    floors = speed.floors
    if floors.min_context_tokens is not None and v.fit.hot_context_tokens < floors.min_context_tokens:
        return dataclasses.replace(v, verdict="excluded", reason_code="context_floor",
                                   reason=f"holds {v.fit.hot_context_tokens} hot tokens at {cache_type.name}, below "
                                          f"--min-context {floors.min_context_tokens}")
    if not floors.any_speed:
        return v
    if predicted is None:
        return dataclasses.replace(v, verdict="excluded", reason_code="speed",
                                   reason="speed cannot be predicted (parameters or KV geometry not recorded), "
                                          "so no speed floor can be checked")
    missed = speed_shortfalls(predicted, floors)
    if missed:
        return dataclasses.replace(v, verdict="excluded", reason_code="speed", reason="; ".join(missed))
    return v


def _fastest(verdicts: Iterable[Verdict], speed: SpeedRequest) -> Verdict | None:
    """The candidate nearest the floors: the fastest to the first token when that floor is set,
    else the fastest generator."""
    pool = [v for v in verdicts if v.speed is not None]
    if not pool:
        return None
    if speed.floors.max_first_token_s is not None:
        return min(pool, key=lambda v: (v.speed.first_token_s if v.speed else 0.0, v.entry.name))
    return max(pool, key=lambda v: (v.speed.decode_tokens_per_s if v.speed else 0.0, v.entry.name))


def speed_refusal(verdicts: tuple[Verdict, ...], speed: SpeedRequest, budget: DeviceBudget, cache_type: KVCacheType,
                  *, origin: str | None, backend: str) -> Refusal | None:
    """Nothing qualifies because of the opt-in floors (a candidate fits but is too slow or holds too
    little): the refusal names the fastest candidate and its predicted figures. None when no
    candidate was excluded by a floor (the memory refusal then stands)."""
    floored = [v for v in verdicts if v.reason_code == "speed"
               or (v.reason_code == "context_floor" and "--min-context" in v.reason)]
    if not floored:
        return None
    fastest = _fastest(floored, speed)
    wanted = speed.floors.flags()
    lines = [f"no candidate meets the floors ({wanted}) on this device: {len(floored)} fit but miss a floor"]
    if fastest is not None and fastest.speed is not None:
        lines.append(f"The fastest is {fastest.entry.name}: {fastest.speed.text()} ({fastest.reason}).")
    alternatives = ("lower or drop the floor", "plan a faster device (a GPU) with --device",
                    "shorten the agent prompt the prediction is for (--agent-prompt-tokens)")
    message = "\n".join([*lines, "Alternatives: " + "; ".join(alternatives) + "."])
    return Refusal(origin, backend, cache_type.name, budget, None, None, alternatives, message)


def slow_first_token_warning(chosen: Verdict, qualifying: list[Verdict], speed: SpeedRequest) -> str | None:
    """Without a first-token floor, when the pick's predicted first token of an agent prompt is past
    SLOW_FIRST_TOKEN_S: the warning, naming the floor option and the model it would choose."""
    p = chosen.speed
    if p is None or speed.floors.max_first_token_s is not None or p.first_token_s <= SLOW_FIRST_TOKEN_S:
        return None
    quick = next((v for v in qualifying if v.speed is not None and v.speed.first_token_s <= SLOW_FIRST_TOKEN_S), None)
    would = (f"--max-first-token-s {SLOW_FIRST_TOKEN_S:g} would choose {quick.entry.name} (first token "
             f"{fmt_seconds(quick.speed.first_token_s)})" if quick is not None and quick.speed is not None
             else f"no candidate here is predicted under {SLOW_FIRST_TOKEN_S:g} s, so --max-first-token-s "
                  f"{SLOW_FIRST_TOKEN_S:g} would refuse")
    return (f"{chosen.entry.name} is predicted to take {fmt_seconds(p.first_token_s)} to the first token of a "
            f"{p.prompt_tokens}-token agent prompt (over {SLOW_FIRST_TOKEN_S:g} s); {would}")


def select_explicit(entries: Iterable[Entry], name: str, budget: DeviceBudget, cache_type: KVCacheType, *,
                    origin: str | None = None, backend: str = DEFAULT_BACKEND,
                    speed: SpeedRequest | None = None) -> Selection:
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
    problem = eligibility_problem(entry)
    if problem:
        notes.append(f"{name} is {problem}")
    if fit.hot_context_tokens < MIN_AGENTIC_HOT_CONTEXT:
        words = words_for(budget.kind)
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
                                              f"{cache_type.name}", fit,
                     None if speed is None else speed.predict(entry, cache_type))
    return Selection(chosen, (chosen,), budget, cache_type, origin, backend, False, True, None, tuple(notes))

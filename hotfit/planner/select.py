"""The pick on one device: automatic selection and ``--model NAME`` (pure: no I/O, integers only).

Spec sections "Selection and hot context", "The agentic baseline", "Exclusions and backend
differences". Each candidate gets a verdict on the device's budget (registry/verdict.py, on the
arithmetic of registry/budget.py); the qualifying ones are ranked by the planner's one ranking
(planner/rank.py: a still-qualifying ``previous`` model first, then the larger model, the larger hot
context, the name). When nothing qualifies the selection carries the fail-closed refusal
(registry/refusal.py). ``--model NAME`` is that entry or nothing.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Iterable

from hotfit.core.entry import DEFAULT_BACKEND, Entry
from hotfit.core.errors import NoModelQualifies, UsageError
from hotfit.planner.rank import Candidate, ranked
from hotfit.registry.budget import MIN_AGENTIC_HOT_CONTEXT, DeviceBudget, fmt_bytes, model_fit
from hotfit.registry.kv import KVCacheType, UnknownKV
from hotfit.registry.refusal import Refusal, build_refusal, required_memory, words_for
from hotfit.registry.select import normalize_backend, normalize_origin
from hotfit.registry.speed import SLOW_FIRST_TOKEN_S, SpeedRequest, fmt_seconds, speed_shortfalls
from hotfit.registry.verdict import Verdict, eligibility_problem, evaluate


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
    every candidate's speed on the device, once, with its verdict, and hold them to its opt-in floors
    (registry/speed.py): a candidate below a floor is not eligible, so it never reaches the ranking."""
    entries = tuple(entries)
    origin = normalize_origin(origin)
    backend = normalize_backend(backend)
    admitted = frozenset(admitted)
    verdicts = [_evaluate(e, budget, cache_type, origin=origin, backend=backend, admitted=admitted) for e in entries]
    if speed is not None:
        verdicts = [_with_speed(v, speed, cache_type) for v in verdicts]
    qualifying = ranked([Candidate(v, budget, kept=bool(previous) and v.entry.name == previous)
                         for v in verdicts if v.verdict == "qualifies"])
    best = qualifying[0] if qualifying else None
    notes: list[str] = []
    chosen = None if best is None else best.verdict
    reused = best is not None and best.kept
    if previous and not reused:
        prev_v = next((v for v in verdicts if v.entry.name == previous), None)
        notes.append(f"previous model {previous} " + (
            "is not in the registry" if prev_v is None else f"no longer qualifies: {prev_v.reason}"))
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


def slow_first_token_warning(chosen: Verdict, qualifying: list[Candidate], speed: SpeedRequest) -> str | None:
    """Without a first-token floor, when the pick's predicted first token of an agent prompt is past
    SLOW_FIRST_TOKEN_S: the warning, naming the floor option and the model it would choose (the first
    candidate in the ranking's order predicted under it)."""
    p = chosen.speed
    if p is None or speed.floors.max_first_token_s is not None or p.first_token_s <= SLOW_FIRST_TOKEN_S:
        return None
    quick = next((c.verdict for c in qualifying
                  if c.verdict.speed is not None and c.verdict.speed.first_token_s <= SLOW_FIRST_TOKEN_S), None)
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
                    f"{need.described(budget)}")
        raise NoModelQualifies(what, hint=f"free {words.memory} on {words.this_one}, use q8_0 KV, or choose a "
                                          f"smaller model",
                               model=name, kv_cache_type=cache_type.name,
                               smallest=None if need is None else need.to_json())
    chosen = Verdict(entry, "selected", "ok", f"chosen by name; holds {fit.hot_context_tokens} hot tokens at "
                                              f"{cache_type.name}", fit,
                     None if speed is None else speed.predict(entry, cache_type))
    return Selection(chosen, (chosen,), budget, cache_type, origin, backend, False, True, None, tuple(notes))

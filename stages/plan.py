"""Plan stage: probe result + registry + KV type → the frozen ``Plan`` (pure apart from logging).

``build_plan`` runs selection (registry.select) on the probe's selected device and wraps the pick
in ``pipeline.plan.Plan``; when nothing qualifies the outcome carries the refusal instead, so
``hotfit plan`` can still print every candidate's verdict next to the error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Literal

from pipeline.log import get_logger
from pipeline.plan import BudgetBreakdown, Plan, ProbeResult
from pipeline.settings import KV_CACHE_ENV
from registry.kv import KVCacheType, parse_kv_cache_type
from registry.model import Entry
from registry.select import (
    MAX_HOT_CONTEXT_TOKENS,
    MIN_AGENTIC_HOT_CONTEXT,
    Selection,
    device_budget,
    fmt_bytes,
    select_auto,
    select_explicit,
)

log = get_logger()

KVSource = Literal["env", "flag", "default"]


def resolve_kv_cache_type(flag: str | None, env_raw: str | None) -> tuple[KVCacheType, KVSource]:
    """--kv-cache-type wins over CONTENOX_LLAMA_KV_CACHE_TYPE; unset = f16; unknown = UsageError."""
    if flag is not None:
        return parse_kv_cache_type(flag, source="--kv-cache-type"), "flag"
    if env_raw is not None and env_raw.strip():
        return parse_kv_cache_type(env_raw, source=KV_CACHE_ENV), "env"
    return parse_kv_cache_type(None), "default"


@dataclass(frozen=True)
class PlanOutcome:
    probe: ProbeResult
    selection: Selection
    kv_cache_type_source: KVSource
    plan: Plan | None  # None = nothing qualifies (selection.refusal says why)

    @property
    def kv_cache_type(self) -> str:
        return self.selection.cache_type.name


def build_plan(
    probe: ProbeResult,
    entries: Iterable[Entry],
    cache_type: KVCacheType,
    kv_cache_type_source: KVSource = "default",
    *,
    origin: str | None = None,
    backend: str = "llama",
    previous: str | None = None,
    model: str | None = None,
) -> PlanOutcome:
    """Select for the probe's chosen device. ``model`` = explicit --model NAME (raises when it
    cannot open the floor; no fallback). Otherwise never raises for 'no fit' — check ``plan``."""
    device = probe.device
    budget = device_budget(device.kind, device.total_bytes, device.free_bytes, name=device.name)
    entries = tuple(entries)
    if model:
        selection = select_explicit(entries, model, budget, cache_type, origin=origin, backend=backend)
    else:
        selection = select_auto(entries, budget, cache_type, origin=origin, backend=backend, previous=previous)
    plan = None
    chosen = selection.chosen
    if chosen is not None and chosen.fit is not None:
        fit = chosen.fit
        plan = Plan(
            entry=chosen.entry,
            probe=probe,
            kv_cache_type=cache_type.name,
            kv_cache_type_source=kv_cache_type_source,
            hot_context_tokens=fit.hot_context_tokens,
            estimated_kv_bytes=fit.kv_bytes,
            budget=BudgetBreakdown(
                free_bytes=budget.free_bytes,
                reserve_bytes=budget.reserve_bytes,
                headroom_bytes=budget.headroom_bytes,
                usable_bytes=budget.usable_bytes,
                weights_bytes=fit.weights_bytes,
                allowance_bytes=fit.allowance_bytes,
                kv_budget_bytes=fit.kv_budget_bytes,
                hot_context_tokens=fit.hot_context_tokens,
            ),
            origin=selection.origin,
            reused_previous=selection.reused_previous,
            explicit_model=selection.explicit,
        )
        log.info("plan.selected", model=chosen.entry.name, hot_context_tokens=fit.hot_context_tokens,
                 kv_cache_type=cache_type.name, kv_cache_type_source=kv_cache_type_source,
                 estimated_kv_bytes=fit.kv_bytes, usable_bytes=budget.usable_bytes,
                 reused_previous=selection.reused_previous, explicit_model=selection.explicit,
                 plan_id=plan.plan_id)
    else:
        refusal = selection.refusal
        log.warning("plan.refused", origin=selection.origin or "auto", backend=selection.backend,
                    kv_cache_type=cache_type.name, usable_bytes=budget.usable_bytes,
                    smallest=None if refusal is None or refusal.smallest is None else refusal.smallest.name,
                    required_free_bytes=None if refusal is None or refusal.smallest is None
                    else refusal.smallest.required_free_bytes)
    for note in selection.notes:
        log.info("plan.note", note=note)
    return PlanOutcome(probe, selection, kv_cache_type_source, plan)


def outcome_json(outcome: PlanOutcome) -> dict[str, Any]:
    """The ``hotfit plan --json`` document (issue 3, item 6)."""
    sel = outcome.selection
    b = sel.budget
    chosen = sel.chosen
    fit = None if chosen is None else chosen.fit
    budget: dict[str, Any] = {
        "free_bytes": b.free_bytes,
        "total_bytes": b.total_bytes,
        "reserve_bytes": b.reserve_bytes,
        "headroom_bytes": b.headroom_bytes,
        "usable_bytes": b.usable_bytes,
        "weights_bytes": None if fit is None else fit.weights_bytes,
        "allowance_bytes": None if fit is None else fit.allowance_bytes,
        "kv_budget_bytes": None if fit is None else fit.kv_budget_bytes,
        "kv_bytes": None if fit is None else fit.kv_bytes,
        "hot_context_tokens": None if fit is None else fit.hot_context_tokens,
    }
    selected = None
    if chosen is not None and fit is not None and outcome.plan is not None:
        e = chosen.entry
        selected = {
            "name": e.name,
            "display_name": e.display_name,
            "hot_context": fit.hot_context_tokens,
            "backend": e.backend,
            "origin": e.origin,
            "license": e.license,
            "agentic_tier": e.agentic_tier,
            "params_total_b": e.params_total_b,
            "weights_bytes": fit.weights_bytes,
            "estimated_kv_bytes": fit.kv_bytes,
            "context_ceiling": fit.ceiling_tokens,
            "reused_previous": sel.reused_previous,
            "explicit_model": sel.explicit,
            "plan_id": outcome.plan.plan_id,
        }
    device = outcome.probe.device
    return {
        "kv_cache_type": sel.cache_type.name,
        "kv_cache_type_source": outcome.kv_cache_type_source,
        "origin": sel.origin or "auto",
        "backend": sel.backend,
        "min_hot_context": MIN_AGENTIC_HOT_CONTEXT,
        "device": {"index": device.index, "kind": device.kind, "name": device.name},
        "budget": budget,
        "selected": selected,
        "candidates": [v.to_json() for v in sel.verdicts],
        "notes": list(sel.notes),
        "error": None if sel.refusal is None else sel.refusal.to_json(),
    }


def describe(outcome: PlanOutcome) -> str:
    """Human report: device, budget breakdown, every candidate with its verdict, the pick or refusal."""
    sel = outcome.selection
    b = sel.budget
    d = outcome.probe.device
    lines = [
        f"device   [{d.index}] {d.kind} {d.name}",
        f"KV cache {sel.cache_type.name} ({outcome.kv_cache_type_source})"
        + ("" if sel.cache_type.name != "f16" else "  — q8_0 would halve what the window costs"),
        f"origin   {sel.origin or 'auto (all)'}   backend {sel.backend}   floor {MIN_AGENTIC_HOT_CONTEXT} tokens, "
        f"cap {MAX_HOT_CONTEXT_TOKENS}",
        f"budget   free {fmt_bytes(b.free_bytes)} - reserve {fmt_bytes(b.reserve_bytes)} - headroom "
        f"{fmt_bytes(b.headroom_bytes)} = usable {fmt_bytes(b.usable_bytes)} ({b.usable_bytes} bytes)",
        "",
        f"  {'verdict':9} {'model':28} {'hot ctx':>8}  reason",
    ]
    for v in sel.verdicts:
        hot = "-" if v.hot_context_tokens is None else str(v.hot_context_tokens)
        lines.append(f"  {v.verdict:9} {v.entry.name:28} {hot:>8}  {v.reason}")
    lines.append("")
    chosen = sel.chosen
    if chosen is not None and chosen.fit is not None:
        f = chosen.fit
        lines.append(f"selected {chosen.entry.name}: usable {fmt_bytes(b.usable_bytes)} - weights "
                     f"{fmt_bytes(f.weights_bytes)} - allowance {fmt_bytes(f.allowance_bytes)} = KV budget "
                     f"{fmt_bytes(f.kv_budget_bytes)} → {f.hot_context_tokens} hot tokens at {sel.cache_type.name} "
                     f"(KV {fmt_bytes(f.kv_bytes)})" + ("  [kept: previous model]" if sel.reused_previous else ""))
    elif sel.refusal is not None:
        lines.append(sel.refusal.message)
    lines += [f"note: {n}" for n in sel.notes]
    return "\n".join(lines)

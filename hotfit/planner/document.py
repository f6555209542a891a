"""The ``hotfit plan --json`` document of a plan outcome, and each device's one-line refusal (pure):
what the CLI prints and ``auto --dry-run`` embeds, from :class:`~hotfit.planner.devices.PlanOutcome`."""

from __future__ import annotations

from typing import Any

from hotfit.planner.devices import DevicePlan, PlanOutcome, fits_elsewhere
from hotfit.registry.budget import MIN_AGENTIC_HOT_CONTEXT


def device_refusal(dp: DevicePlan, devices: tuple[DevicePlan, ...]) -> str | None:
    """One line: why ``dp`` refused, and what another device would hold instead (with its flag)."""
    if dp.chosen is not None:
        return None
    if dp.unserved is not None:
        return dp.unserved
    sel = dp.selection
    why = (str(dp.error) if dp.error is not None
           else sel.refusal.message.splitlines()[0] if sel is not None and sel.refusal is not None else "refused")
    return " ".join([why, *(f"Instead, {line} ({flag})." for line, flag in fits_elsewhere(devices, dp.device))])


def _device_json(dp: DevicePlan, best: int, devices: tuple[DevicePlan, ...]) -> dict[str, Any]:
    sel = dp.selection
    c = dp.chosen
    refusal = device_refusal(dp, devices)
    return {
        "index": dp.device.index,
        "kind": dp.device.kind,
        "name": dp.device.name,
        "considered": dp.considered,
        "won": dp.considered and c is not None and dp.device.index == best,
        "budget": None if sel is None else sel.budget.to_json(),
        "judged_free_bytes": dp.judged_free_bytes,
        "selected": None if c is None else c.entry.name,
        "hot_context": None if c is None or c.fit is None else c.fit.hot_context_tokens,
        "params_total_b": None if c is None else c.entry.params_total_b,
        "reused_previous": bool(sel is not None and sel.reused_previous),
        "refusal": refusal,
        "served": dp.unserved is None,
    }


def outcome_json(outcome: PlanOutcome) -> dict[str, Any]:
    """The ``hotfit plan --json`` document."""
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
            "speed": {"predicted": None if chosen.speed is None else chosen.speed.to_json()},
        }
        if outcome.admission is not None:  # --admit-graded: whether the pick rests on grade evidence, and which
            selected["admitted_by_grade"] = sel.admitted_by_grade
            selected["evidence"] = outcome.admitted_evidence
    device = outcome.placement.device
    return {
        "kv_cache_type": sel.cache_type.name,
        "kv_cache_type_source": outcome.kv_cache_type_source,
        "origin": sel.origin or "auto",
        "backend": sel.backend,
        "min_hot_context": MIN_AGENTIC_HOT_CONTEXT,
        "device": {"index": device.index, "kind": device.kind, "name": device.name},
        "devices": [_device_json(dp, device.index, outcome.devices) for dp in outcome.devices],
        "device_choice": outcome.device_choice,
        "forced_device": outcome.forced_device,
        "budget": budget,
        "selected": selected,
        "candidates": [v.to_json() for v in sel.verdicts],
        "notes": list(sel.notes),
        "speed": {"agent_prompt_tokens": outcome.speed.prompt_tokens, "floors": outcome.speed.floors.to_json(),
                  "warning": sel.speed_warning},
        "error": None if sel.refusal is None else sel.refusal.to_json(),
    } | ({} if outcome.admission is None else {"admission": outcome.admission.to_json()})


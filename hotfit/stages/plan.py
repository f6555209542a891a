"""Plan stage: a thin adapter over the planner (planner/): the probe result, the registry and the
KV type in, the frozen ``Plan`` out, with the backend's preflight.

What the planner cannot know without a backend it is handed as data: the device kinds the backend
serves (:meth:`Backend.device_kinds`). The planner decides (planner/devices.py: every device on its
own budget, the one ranking of planner/rank.py); this module asks the backend, logs the outcome,
and runs the preflight — the binary found once per run, before any weight byte is fetched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Iterable, Literal

import anyio

from hotfit.backends.base import BackendBinary
from hotfit.backends.select import backend_for
from hotfit.core.entry import DEFAULT_BACKEND, Entry
from hotfit.core.log import get_logger
from hotfit.core.settings import KV_CACHE_ENV, Settings
from hotfit.planner import devices as planner
from hotfit.planner.devices import Admission, PlanOutcome, PreviousModel
from hotfit.planner.plan import Plan, decode_plan
from hotfit.planner.probe import ProbeResult
from hotfit.planner.select import Selection
from hotfit.registry.kv import KVCacheType, parse_kv_cache_type
from hotfit.registry.select import normalize_backend
from hotfit.registry.speed import SpeedPlanning
from hotfit.stages.declaration import StageContext, StageDeclaration

log = get_logger()

KVSource = Literal["env", "flag", "default"]
PREFLIGHT_KEY = "preflight"  # the plan stage's record: the plan's fields and this one


def resolve_kv_cache_type(flag: str | None, env_raw: str | None) -> tuple[KVCacheType, KVSource]:
    """--kv-cache-type wins over CONTENOX_LLAMA_KV_CACHE_TYPE; unset = f16; unknown = UsageError."""
    if flag is not None:
        return parse_kv_cache_type(flag, source="--kv-cache-type"), "flag"
    if env_raw is not None and env_raw.strip():
        return parse_kv_cache_type(env_raw, source=KV_CACHE_ENV), "env"
    return parse_kv_cache_type(None), "default"


@dataclass(frozen=True)
class PlannedRun:
    """The plan stage's result: the frozen plan, and what the backend preflight found for it
    (llama-server's path and build facts, OpenVINO's runtime) — checked before any weight byte is
    fetched and read by load through ``ctx.result("plan", PlannedRun)``, so the binary is found once
    per run. ``backend`` is None where the stage only plans (the dry run, the no-op check)."""

    plan: Plan
    backend: BackendBinary | None = None

    def to_json(self) -> dict[str, Any]:
        # the plan's own record, plus the preflight (so the record holds what load was handed)
        return {**self.plan.to_json(), PREFLIGHT_KEY: self.backend.to_json() if self.backend is not None else None}


def decode_planned(record: Mapping[str, Any]) -> PlannedRun:
    """The plan stage's record (``PlannedRun.to_json()``): the plan, and the preflight's binary
    decoded by the plan's backend; StageRecordError names a damaged field."""
    if not isinstance(record, Mapping):
        return PlannedRun(decode_plan(record))  # the plan's decoder names what is wrong
    plan = decode_plan({k: v for k, v in record.items() if k != PREFLIGHT_KEY})
    found = record.get(PREFLIGHT_KEY)
    if found is None:
        return PlannedRun(plan)
    return PlannedRun(plan, backend_for(plan.backend).decode_binary(found, path=PREFLIGHT_KEY))


@dataclass(frozen=True)
class PlanJob:
    """What the run asks of the plan stage. ``select`` is the selection for a probe (the job's
    registry, KV type, origin, previous model…; it raises the refusal); ``on_plan`` sees the whole
    outcome (every device and candidate), which the dry run prints; ``check_backend`` False (the dry
    run, the no-op check): only plan, the binary is checked when a run would use it."""

    select: Callable[[Settings, ProbeResult], PlanOutcome]
    on_plan: Callable[[PlanOutcome], None] | None = None
    check_backend: bool = True


async def plan_work(ctx: StageContext) -> PlannedRun:
    job = ctx.job(PlanJob)
    outcome = job.select(ctx.settings, ctx.result("probe", ProbeResult))
    if job.on_plan is not None:
        job.on_plan(outcome)
    plan = outcome.plan
    assert plan is not None  # select raised the refusal otherwise
    if not job.check_backend:
        return PlannedRun(plan)
    # The backend that will serve this plan must be usable here before a single weight byte is
    # fetched: llama-server found, answering, suiting this CPU and the device;
    # OpenVINO importable with the plan's device and KV precision. Found once: load reuses it.
    preflight = backend_for(plan.backend).preflight
    return PlannedRun(plan, await anyio.to_thread.run_sync(functools.partial(preflight, plan, ctx.settings)))


def plan_figures(planned: PlannedRun) -> dict[str, Any]:
    plan = planned.plan
    return {"model": plan.entry.name, "hot_context_tokens": plan.hot_context_tokens,
            "kv_cache_type": plan.kv_cache_type, "kv_cache_type_source": plan.kv_cache_type_source,
            "estimated_kv_bytes": plan.estimated_kv_bytes, "usable_bytes": plan.budget.usable_bytes,
            "reused_previous": plan.reused_previous, "explicit_model": plan.explicit_model}


def _plan_of(planned: PlannedRun) -> Plan:
    return planned.plan


# Always run (selection is cheap and free memory changes), so no reuse check.
DECLARATION = StageDeclaration(
    "plan", plan_work, deps=("probe",), always_run=True, decode=decode_planned, figures=plan_figures,
    plan_of=_plan_of, version=1, result_type=PlannedRun)


def served_device_kinds(backend: str) -> frozenset[str]:
    """The device kinds the backend can run a model on, asked of the backend itself."""
    return backend_for(normalize_backend(backend)).device_kinds


def build_plan(probe: ProbeResult, entries: Iterable[Entry], cache_type: KVCacheType,
               kv_cache_type_source: KVSource = "default", *, origin: str | None = None,
               backend: str = DEFAULT_BACKEND, previous: str | PreviousModel | None = None,
               model: str | None = None, device: str | None = None,
               admission: Admission | None = None, speed: SpeedPlanning = SpeedPlanning()) -> PlanOutcome:
    """:func:`planner.devices.build_plan` with the device kinds ``backend`` serves asked of it, and
    the outcome logged (``plan.device`` for every device, then ``plan.selected`` or ``plan.refused``)."""
    outcome = planner.build_plan(probe, entries, cache_type, kv_cache_type_source, origin=origin, backend=backend,
                                 served=served_device_kinds(backend), previous=previous, model=model, device=device,
                                 admission=admission, speed=speed)
    log_outcome(outcome)
    return outcome


def log_outcome(outcome: PlanOutcome) -> None:
    won = outcome.placement.device
    for dp in outcome.devices:
        log.info("plan.device", index=dp.device.index, kind=dp.device.kind, name=dp.device.name,
                 considered=dp.considered, model=dp.chosen_name, won=dp.device.index == won.index,
                 judged_free_bytes=dp.judged_free_bytes)
    selection, plan = outcome.selection, outcome.plan
    budget = selection.budget
    if plan is not None:
        log.info("plan.selected", model=plan.entry.name, hot_context_tokens=plan.hot_context_tokens,
                 kv_cache_type=plan.kv_cache_type, kv_cache_type_source=plan.kv_cache_type_source,
                 estimated_kv_bytes=plan.estimated_kv_bytes, usable_bytes=budget.usable_bytes,
                 reused_previous=selection.reused_previous, explicit_model=selection.explicit,
                 device_index=won.index, device_kind=won.kind, device_choice=outcome.device_choice,
                 plan_id=plan.plan_id, **({"admitted_by_grade": selection.admitted_by_grade}
                                          if outcome.admission is not None else {}))
    else:
        refusal = selection.refusal
        log.warning("plan.refused", origin=selection.origin or "auto", backend=selection.backend,
                    kv_cache_type=selection.cache_type.name, usable_bytes=budget.usable_bytes,
                    smallest=None if refusal is None or refusal.smallest is None else refusal.smallest.name,
                    required_free_bytes=None if refusal is None or refusal.smallest is None
                    else refusal.smallest.required_free_bytes)
    for note in selection.notes:
        log.info("plan.note", note=note)
    _log_speed(selection)


def _log_speed(selection: Selection) -> None:
    """One event for the pick's predicted speed, and one warning when its first token is slow."""
    chosen = selection.chosen
    if chosen is not None and chosen.speed is not None:
        log.info("plan.speed", model=chosen.entry.name, **chosen.speed.to_json())
    if selection.speed_warning is not None:
        log.warning("plan.slow_first_token", model=None if chosen is None else chosen.entry.name,
                    warning=selection.speed_warning)

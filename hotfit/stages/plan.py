"""Plan stage: probe result + registry + KV type → the frozen ``Plan`` (pure apart from logging).

``build_plan`` runs selection (registry.select) on every device the probe found — each on its own
budget, GPU and host memory never added — and takes the plan that wins by the spec's ordering
(parameters, then hot context, then name; the previous model kept while it qualifies on its
device). The winner's device becomes ``plan.probe.selected``, the device load pins. The pick is
wrapped in ``core.plan.Plan``; when nothing qualifies the outcome carries the refusal
instead, so ``hotfit plan`` can still print every candidate's verdict next to the error.

Over 400 lines: the plan stage's whole job — KV type, previous-model rule, origin isolation,
multi-device choice, the ``--admit-graded`` admission per device and the fail-closed refusal — in the
one module per stage; the arithmetic is in registry/ (pure).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from collections.abc import Callable, Mapping
from typing import Any, Iterable, Literal

import anyio

from hotfit.backends.base import BackendBinary
from hotfit.backends.select import backend_for
from hotfit.core.errors import NoModelQualifies, UsageError
from hotfit.core.log import get_logger
from hotfit.core.plan import BudgetBreakdown, Device, Plan, ProbeResult, decode_probe
from hotfit.core.records import Fields, stage_record_fail
from hotfit.core.settings import KV_CACHE_ENV, Settings
from hotfit.registry.kv import KVCacheType, parse_kv_cache_type
from hotfit.core.entry import DEFAULT_BACKEND, Entry
from hotfit.registry.select import (
    ACCELERATOR_KINDS,
    DEVICE_KINDS,
    MIN_AGENTIC_HOT_CONTEXT,
    DeviceBudget,
    Refusal,
    Selection,
    Verdict,
    device_budget,
    normalize_backend,
    select_auto,
    select_explicit,
)
from hotfit.registry.schema import decode_entry
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


@dataclass(frozen=True)
class PreviousModel:
    """The model the last provisioning chose, and where: it is kept while it still qualifies on
    *its* device (spec: the caller keeps the previous model while it qualifies).

    ``device`` None = any device (``hotfit plan --previous NAME``). ``worker_held_bytes``: memory a
    running worker of this home holds on that device for this very model (pipeline.worker); the
    previous model is judged with it counted as available, since it is its own."""

    name: str
    device: Device | None = None
    worker_held_bytes: int = 0


@dataclass(frozen=True)
class Admission:
    """``--admit-graded``: the tool-chat entries grade evidence admits on each device
    (checked by the caller, :mod:`pipeline.evidence`), and every model's evidence status as JSON."""

    admitted: Mapping[int, frozenset[str]]  # device index -> entry names
    report: tuple[Mapping[str, Any], ...] = ()  # model, device_index, status, reason, evidence
    evidence_file: str = ""

    def on(self, device: Device) -> frozenset[str]:
        return self.admitted.get(device.index, frozenset())

    def evidence_for(self, name: str, device: Device) -> Mapping[str, Any] | None:
        return next((r for r in self.report if r["model"] == name and r["device_index"] == device.index), None)

    def to_json(self) -> dict[str, Any]:
        return {"flag": "--admit-graded", "evidence_file": self.evidence_file,
                "models": [dict(r) for r in self.report]}


@dataclass(frozen=True)
class DevicePlan:
    """One device's selection (or its refusal) — ``hotfit plan --json`` lists every one."""

    device: Device
    considered: bool  # False = left out by --device (planned anyway, for the refusal's hints)
    selection: Selection | None  # None with ``error``: --model NAME does not fit this device
    error: NoModelQualifies | None = None
    judged_free_bytes: int | None = None  # free counted for the previous model (its worker's memory added)
    unserved: str | None = None  # why the chosen backend cannot run a model here (not planned)

    @property
    def chosen(self) -> Verdict | None:
        return None if self.selection is None else self.selection.chosen

    @property
    def chosen_name(self) -> str | None:
        return None if self.chosen is None else self.chosen.entry.name


@dataclass(frozen=True)
class PlanOutcome:
    probe: ProbeResult  # ``selected`` = the device the plan is for (or the primary refusal's)
    selection: Selection
    kv_cache_type_source: KVSource
    plan: Plan | None  # None = nothing qualifies (selection.refusal says why)
    devices: tuple[DevicePlan, ...] = ()
    device_choice: str = ""  # why this device's plan won (or why every device refused)
    forced_device: str | None = None  # --device as given
    admission: Admission | None = None  # --admit-graded: what grade evidence admitted (None: curation only)
    speed: SpeedPlanning = SpeedPlanning()  # the agent prompt predicted for, and the opt-in floors

    @property
    def admitted_evidence(self) -> Mapping[str, Any] | None:
        """The evidence the pick rests on, when grade evidence admitted it (else None)."""
        if self.admission is None or self.plan is None or not self.selection.admitted_by_grade:
            return None
        return self.admission.evidence_for(self.plan.entry.name, self.probe.device)

    @property
    def kv_cache_type(self) -> str:
        return self.selection.cache_type.name


# ------------------------------------------------------------------------ the stage

REPROVISION_HINT = "run `hotfit auto` to provision again; it rewrites the manifest and reuses completed downloads"
_PLAN_FIELDS = ("entry", "probe", "kv_cache_type", "kv_cache_type_source", "hot_context_tokens",
                "estimated_kv_bytes", "budget", "origin")
_PLAN_OPTIONAL = ("backend", "reused_previous", "explicit_model", "speed_predicted")
KV_CACHE_TYPE_SOURCES = ("env", "flag", "default")


def decode_plan_fields(data: Any, f: Fields) -> Plan:
    """``Plan.to_json()`` back into the Plan (its ``plan_id`` comes out the same): the entry through
    the registry's own entry decoder, the probe through the probe file's; ``f`` names a damaged
    field the way the caller reports it (a stage record, the manifest)."""
    doc = f.object(data, "", _PLAN_FIELDS, optional=_PLAN_OPTIONAL)
    entry = decode_entry(doc["entry"], f.at("entry"), rules=False)
    b = f.at("budget")
    raw_budget = b.object(doc["budget"], "", tuple(BudgetBreakdown.__dataclass_fields__))
    budget = BudgetBreakdown(**{k: b.integer(raw_budget[k], k, minimum=None) for k in raw_budget})
    plan = Plan(
        entry=entry,
        probe=decode_probe(doc["probe"], f.at("probe")),
        kv_cache_type=f.string(doc["kv_cache_type"], "kv_cache_type"),
        kv_cache_type_source=f.choice(doc["kv_cache_type_source"], "kv_cache_type_source", KV_CACHE_TYPE_SOURCES),
        hot_context_tokens=f.integer(doc["hot_context_tokens"], "hot_context_tokens"),
        estimated_kv_bytes=f.integer(doc["estimated_kv_bytes"], "estimated_kv_bytes", minimum=0),
        budget=budget,
        origin=f.string(doc["origin"], "origin", nullable=True),
        reused_previous=f.boolean(doc.get("reused_previous", False), "reused_previous"),
        explicit_model=f.boolean(doc.get("explicit_model", False), "explicit_model"),
        speed_predicted=_speed_predicted(doc.get("speed_predicted"), f),
    )
    if doc.get("backend", entry.backend) != entry.backend:
        raise f.fail("backend", f"is {doc['backend']!r} but the entry's backend is {entry.backend!r}",
                     REPROVISION_HINT)
    return plan


def _speed_predicted(raw: Any, f: Fields) -> Mapping[str, Any] | None:
    """The plan's recorded speed prediction (registry/speed.py): an object, or absent in older records."""
    if raw is None:
        return None
    return f.object(raw, "speed_predicted", ("prompt_tokens", "prefill_tokens_per_s", "decode_tokens_per_s",
                                            "first_token_s", "basis"), extra=True)


def decode_plan(record: Mapping[str, Any]) -> Plan:
    """The plan's record (``Plan.to_json()``) back into the Plan; StageRecordError names a damaged field."""
    return decode_plan_fields(record, Fields(stage_record_fail, noun="plan"))


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


def device_label(d: Device) -> str:
    return f"[{d.index}] {d.kind} {d.name}"


def choose_devices(probe: ProbeResult, choice: str | None) -> tuple[Device, ...]:
    """``--device KIND|INDEX`` → the devices to plan (None = every device the probe found).
    A kind is any device kind (registry.select.DEVICE_KINDS, or one the probe reports); an index
    is a probe index. Anything else, or a choice this probe has no device for, is a UsageError
    naming what there is."""
    if choice is None:
        return probe.devices
    key = choice.strip().lower()
    present = [f"{d.index} ({d.kind} {d.name})" for d in probe.devices]
    kinds = sorted({d.kind for d in probe.devices})
    hint = f"use --device {' or --device '.join(kinds)}, or a device index: {', '.join(present)}"
    if re.fullmatch(r"\d+", key):
        chosen = tuple(d for d in probe.devices if d.index == int(key))
    elif key in DEVICE_KINDS or key in kinds:
        chosen = tuple(d for d in probe.devices if d.kind == key)
    else:
        raise UsageError(f"--device {choice!r} is neither a device kind ({', '.join(sorted(DEVICE_KINDS))}) nor a "
                         f"device index; this machine has {', '.join(present)}", hint=hint, device=choice,
                         valid=[*kinds, *(str(d.index) for d in probe.devices)])
    if not chosen:
        raise UsageError(f"--device {choice!r}: the probe found no such device; it has {', '.join(present)}",
                         hint=hint, device=choice, valid=[*kinds, *(str(d.index) for d in probe.devices)])
    return chosen


def served_device_kinds(backend: str) -> frozenset[str]:
    """The device kinds the backend can run a model on, asked of the backend itself."""
    return backend_for(normalize_backend(backend)).device_kinds


def unserved_reason(backend: str, device: Device, served: frozenset[str]) -> str:
    name = normalize_backend(backend)
    return (f"the {name} backend cannot run a model on {device_label(device)} (it serves "
            f"{', '.join(sorted(served))} devices); not planned")


def same_device(d: Device, prev: Device) -> bool:
    if d.uuid and prev.uuid:
        return d.uuid == prev.uuid
    return d.kind == prev.kind and d.index == prev.index and d.name == prev.name


def available_with_worker(device: Device, held_bytes: int) -> int:
    """Pure: free memory of ``device`` counting what a running worker holds as available. It can
    free no more than the device has in use, nor more than the processes on it hold (NVML), and
    the sum never exceeds the device's total."""
    held = max(min(held_bytes, device.total_bytes - device.free_bytes), 0)
    if device.processes_used_bytes is not None:
        held = min(held, device.processes_used_bytes)
    return min(device.free_bytes + held, device.total_bytes)


def _budget(device: Device, free_bytes: int | None = None) -> DeviceBudget:
    return device_budget(device.kind, device.total_bytes, device.free_bytes if free_bytes is None else free_bytes,
                         name=device.name)


def _plan_device(device: Device, entries: tuple[Entry, ...], cache_type: KVCacheType, *, origin: str | None,
                 backend: str, previous: PreviousModel | None, model: str | None, considered: bool,
                 admitted: frozenset[str] = frozenset(), speed: SpeedPlanning = SpeedPlanning()) -> DevicePlan:
    fast = speed.on(device)  # the device's speed figures and the floors (registry/speed.py)
    if model:
        try:
            sel = select_explicit(entries, model, _budget(device), cache_type, origin=origin, backend=backend,
                                  speed=fast)
        except NoModelQualifies as exc:
            return DevicePlan(device, considered, None, exc)
        return DevicePlan(device, considered, sel)
    prev_here = previous is not None and (previous.device is None or same_device(device, previous.device))
    if previous is not None and prev_here and previous.worker_held_bytes > 0:
        # Judge the previous model with its own worker's memory counted as available; the
        # memory is not available to any other model while that worker runs.
        judged = available_with_worker(device, previous.worker_held_bytes)
        sel = select_auto(entries, _budget(device, judged), cache_type, origin=origin, backend=backend,
                          previous=previous.name, admitted=admitted, speed=fast)
        if sel.reused_previous:
            return DevicePlan(device, considered, sel, judged_free_bytes=judged)
    sel = select_auto(entries, _budget(device), cache_type, origin=origin, backend=backend,
                      previous=previous.name if previous is not None and prev_here else None, admitted=admitted,
                      speed=fast)
    return DevicePlan(device, considered, sel)


def _rank(dp: DevicePlan) -> tuple[Any, ...]:
    """The spec's ordering across devices: larger model, larger hot context, name; then an
    accelerator over host memory (same model and window, faster), then the larger usable budget
    (more room for everything else), then the lower index."""
    c = dp.chosen
    assert c is not None and c.fit is not None
    return (-(c.entry.params_total_b or 0.0), -c.fit.hot_context_tokens, c.entry.name,
            dp.device.kind not in ACCELERATOR_KINDS, -_budget(dp.device).usable_bytes, dp.device.index)


def _pick(candidates: list[DevicePlan]) -> tuple[DevicePlan, str]:
    kept = [dp for dp in candidates if dp.selection is not None and dp.selection.reused_previous]
    if kept:
        best = min(kept, key=lambda dp: (-(dp.chosen.fit.hot_context_tokens if dp.chosen and dp.chosen.fit else 0),
                                         dp.device.kind not in ACCELERATOR_KINDS, dp.device.index))
        return best, (f"the previous model {best.chosen_name} still qualifies on {device_label(best.device)}, "
                      f"so it is kept there")
    ranked = sorted(candidates, key=_rank)
    best = ranked[0]
    if len(ranked) == 1:
        why = f"{device_label(best.device)} is the only device whose plan qualifies"
    else:
        runner_up = ranked[1]
        a, b = best.chosen, runner_up.chosen
        assert a is not None and b is not None and a.fit is not None and b.fit is not None
        if a.entry.params_total_b != b.entry.params_total_b:
            rule = (f"the larger model ({a.entry.name}, {a.entry.params_total_b}B parameters, over "
                    f"{b.entry.name}, {b.entry.params_total_b}B)")
        elif a.fit.hot_context_tokens != b.fit.hot_context_tokens:
            rule = (f"the larger hot context ({a.fit.hot_context_tokens} over {b.fit.hot_context_tokens} tokens)")
        elif a.entry.name != b.entry.name:
            rule = f"the name ({a.entry.name} before {b.entry.name})"
        elif best.device.kind in ACCELERATOR_KINDS and runner_up.device.kind not in ACCELERATOR_KINDS:
            rule = "a tie (same model and hot context): the accelerator is preferred over host memory"
        elif _budget(best.device).usable_bytes != _budget(runner_up.device).usable_bytes:
            rule = "a tie (same model and hot context): the larger usable budget"
        else:
            rule = "a tie (same model and hot context): the lower device index"
        why = (f"{device_label(best.device)} wins over {device_label(runner_up.device)} by {rule} "
               f"(ordering: parameters, then hot context, then name)")
    return best, why


def _fits_elsewhere(devices: tuple[DevicePlan, ...], exclude: Device) -> list[tuple[str, str]]:
    """(what another device would hold, its --device flag) for each other device with a pick."""
    out = []
    for dp in devices:
        c = dp.chosen
        if dp.device.index == exclude.index or c is None or c.fit is None:
            continue
        flag = dp.device.kind if sum(x.device.kind == dp.device.kind for x in devices) == 1 else str(dp.device.index)
        what = f"{device_label(dp.device)} would hold {c.entry.name} with {c.fit.hot_context_tokens} hot tokens"
        out.append((what, f"--device {flag}"))
    return out


def _refused(devices: tuple[DevicePlan, ...], considered: list[DevicePlan],
             forced: str | None) -> tuple[DevicePlan, str, Refusal | None]:
    """Every considered device refused: the primary refusal (the largest usable budget) with a
    line for every other device, and what another device would hold when --device left it out."""
    primary = max(considered, key=lambda dp: (_budget(dp.device).usable_bytes, -dp.device.index))
    sel = primary.selection
    refusal = None if sel is None else sel.refusal
    extra: list[str] = []
    for dp in considered:
        if dp is primary:
            continue
        first = (dp.selection.refusal.message.splitlines()[0] if dp.selection is not None and dp.selection.refusal
                 else str(dp.error) if dp.error is not None else "refused")
        extra.append(f"Also considered {device_label(dp.device)}: {first}")
    elsewhere = _fits_elsewhere(devices, primary.device) if forced else []
    extra += [f"Not considered (--device {forced}): {line}; force it with {flag}." for line, flag in elsewhere]
    why = (f"no considered device holds a qualifying model; the refusal is for {device_label(primary.device)}, "
           f"the largest usable budget")
    if refusal is not None:
        alts = list(refusal.alternatives)
        alts[:0] = [f"plan for that device instead with {flag} ({line})" for line, flag in elsewhere]
        body = refusal.message.rsplit("\nAlternatives: ", 1)[0]
        msg = "\n".join([body, *extra, "Alternatives: " + "; ".join(alts) + "."])
        refusal = dataclasses.replace(refusal, message=msg, alternatives=tuple(alts))
    return primary, why, refusal


def build_plan(
    probe: ProbeResult,
    entries: Iterable[Entry],
    cache_type: KVCacheType,
    kv_cache_type_source: KVSource = "default",
    *,
    origin: str | None = None,
    backend: str = DEFAULT_BACKEND,
    previous: str | PreviousModel | None = None,
    model: str | None = None,
    device: str | None = None,
    admission: Admission | None = None,
    speed: SpeedPlanning = SpeedPlanning(),
) -> PlanOutcome:
    """Plan every device the probe found (``device``: --device KIND|INDEX, only those) — GPU and
    host memory never added — and take the plan that wins by the spec's ordering, the previous
    model kept while it qualifies on its device. ``model`` = explicit --model NAME (raises when
    it fits no considered device; no fallback). Otherwise never raises for 'no fit' — check ``plan``.
    ``admission``: tool-chat entries grade evidence admits per device (``--admit-graded``; None: curation only).
    ``speed``: the agent prompt every candidate's speed is predicted for, and the opt-in floors."""
    entries = tuple(entries)
    if isinstance(previous, str):
        previous = PreviousModel(previous)
    chosen_devices = choose_devices(probe, device)
    served = served_device_kinds(backend)
    unserved = {d.index: unserved_reason(backend, d, served) for d in probe.devices if d.kind not in served}
    wanted = {d.index for d in chosen_devices if d.index not in unserved}
    if not wanted:  # --device named (or the probe has) only devices this backend cannot run a model on
        raise UsageError((f"--device {device!r}: " if device is not None else "") + unserved[chosen_devices[0].index],
                         hint=f"plan a device the {normalize_backend(backend)} backend serves ("
                              f"{' or '.join(f'--device {k}' for k in sorted(served))}), or use --backend llama",
                         device=device, backend=normalize_backend(backend), served_kinds=sorted(served))
    devices = tuple(DevicePlan(d, False, None, unserved=unserved[d.index]) if d.index in unserved
                    else _plan_device(d, entries, cache_type, origin=origin, backend=backend, previous=previous,
                                      model=model, considered=d.index in wanted,
                                      admitted=admission.on(d) if admission is not None else frozenset(),
                                      speed=speed)
                    for d in probe.devices)
    considered = [dp for dp in devices if dp.considered]
    qualifying = [dp for dp in considered if dp.chosen is not None]
    if qualifying:
        best, why = _pick(qualifying)
        selection = best.selection
        assert selection is not None
    else:
        if model:  # --model fits no considered device: its own error, for the largest budget
            primary = max(considered, key=lambda dp: (_budget(dp.device).usable_bytes, -dp.device.index))
            assert primary.error is not None
            raise primary.error
        best, why, refusal = _refused(devices, considered, device)
        assert best.selection is not None
        selection = dataclasses.replace(best.selection, refusal=refusal)
    chosen_probe = dataclasses.replace(probe, selected=best.device.index)
    budget = selection.budget
    plan = None
    chosen = selection.chosen
    for dp in devices:
        log.info("plan.device", index=dp.device.index, kind=dp.device.kind, name=dp.device.name,
                 considered=dp.considered, model=dp.chosen_name, won=dp is best,
                 judged_free_bytes=dp.judged_free_bytes)
    if chosen is not None and chosen.fit is not None:
        fit = chosen.fit
        plan = Plan(
            entry=chosen.entry,
            probe=chosen_probe,
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
            speed_predicted=None if chosen.speed is None else chosen.speed.to_json() | (
                {} if selection.speed_warning is None else {"warning": selection.speed_warning}),
        )
        log.info("plan.selected", model=chosen.entry.name, hot_context_tokens=fit.hot_context_tokens,
                 kv_cache_type=cache_type.name, kv_cache_type_source=kv_cache_type_source,
                 estimated_kv_bytes=fit.kv_bytes, usable_bytes=budget.usable_bytes,
                 reused_previous=selection.reused_previous, explicit_model=selection.explicit,
                 device_index=best.device.index, device_kind=best.device.kind, device_choice=why,
                 plan_id=plan.plan_id, **({"admitted_by_grade": selection.admitted_by_grade}
                                          if admission is not None else {}))
    else:
        refusal = selection.refusal
        log.warning("plan.refused", origin=selection.origin or "auto", backend=selection.backend,
                    kv_cache_type=cache_type.name, usable_bytes=budget.usable_bytes,
                    smallest=None if refusal is None or refusal.smallest is None else refusal.smallest.name,
                    required_free_bytes=None if refusal is None or refusal.smallest is None
                    else refusal.smallest.required_free_bytes)
    for note in selection.notes:
        log.info("plan.note", note=note)
    _log_speed(selection)
    return PlanOutcome(chosen_probe, selection, kv_cache_type_source, plan, devices, why, device, admission, speed)


def _log_speed(selection: Selection) -> None:
    """One event for the pick's predicted speed, and one warning when its first token is slow."""
    chosen = selection.chosen
    if chosen is not None and chosen.speed is not None:
        log.info("plan.speed", model=chosen.entry.name, **chosen.speed.to_json())
    if selection.speed_warning is not None:
        log.warning("plan.slow_first_token", model=None if chosen is None else chosen.entry.name,
                    warning=selection.speed_warning)


def device_refusal(dp: DevicePlan, devices: tuple[DevicePlan, ...]) -> str | None:
    """One line: why ``dp`` refused, and what another device would hold instead (with its flag)."""
    if dp.chosen is not None:
        return None
    if dp.unserved is not None:
        return dp.unserved
    sel = dp.selection
    why = (str(dp.error) if dp.error is not None
           else sel.refusal.message.splitlines()[0] if sel is not None and sel.refusal is not None else "refused")
    return " ".join([why, *(f"Instead, {line} ({flag})." for line, flag in _fits_elsewhere(devices, dp.device))])


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
    device = outcome.probe.device
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

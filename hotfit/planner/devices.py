"""The choice across devices (pure): every device the probe found planned on its own budget — GPU
and host memory never added — and the plan that ranks first (planner/rank.py), the previous model
kept while it qualifies on its device. When nothing qualifies the outcome carries the refusal, so
``hotfit plan`` can still print every candidate's verdict next to the error.

The device kinds the backend serves come in as data (``served``; the plan stage asks the backend);
logging is the stage's (stages/plan.py), from the outcome.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Iterable, Literal

from hotfit.core.entry import DEFAULT_BACKEND, Entry
from hotfit.core.errors import NoModelQualifies, UsageError
from hotfit.planner.plan import BudgetBreakdown, Placement, Plan
from hotfit.planner.probe import Device, ProbeResult
from hotfit.planner.rank import ORDERING_WORDS, Candidate, rank_key, wins_by
from hotfit.planner.select import Selection, select_auto, select_explicit
from hotfit.registry.budget import DEVICE_KINDS, DeviceBudget, device_budget
from hotfit.registry.kv import KVCacheType
from hotfit.registry.refusal import Refusal
from hotfit.registry.select import normalize_backend
from hotfit.registry.speed import SpeedPlanning
from hotfit.registry.verdict import Verdict

KVSource = Literal["env", "flag", "default"]


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
    def candidate(self) -> Candidate | None:
        """This device's pick as the ranking reads it (None: no pick)."""
        sel = self.selection
        if sel is None or sel.chosen is None:
            return None
        return Candidate(sel.chosen, sel.budget, self.device.index, kept=sel.reused_previous)

    @property
    def chosen_name(self) -> str | None:
        return None if self.chosen is None else self.chosen.entry.name


@dataclass(frozen=True)
class PlanOutcome:
    probe: ProbeResult  # every device the probe found
    placement: Placement  # where the plan goes (nothing qualifies: the primary refusal's device)
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
        return self.admission.evidence_for(self.plan.entry.name, self.placement.device)

    @property
    def kv_cache_type(self) -> str:
        return self.selection.cache_type.name


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
    fast = speed.on(device, normalize_backend(backend))  # the device's speed figures and the floors (registry/speed.py)
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


def _pick(qualifying: list[DevicePlan]) -> tuple[DevicePlan, str]:
    """The device whose pick ranks first (planner/rank.py), and why, in the ranking's own words."""
    ranked = sorted(qualifying, key=lambda dp: rank_key(_candidate(dp)))
    best = ranked[0]
    if _candidate(best).kept:
        return best, (f"the previous model {best.chosen_name} still qualifies on {device_label(best.device)}, "
                      f"so it is kept there")
    if len(ranked) == 1:
        return best, f"{device_label(best.device)} is the only device whose plan qualifies"
    runner_up = ranked[1]
    rule = wins_by(_candidate(best), _candidate(runner_up))
    return best, (f"{device_label(best.device)} wins over {device_label(runner_up.device)} by {rule} "
                  f"(ordering: {ORDERING_WORDS})")


def _candidate(dp: DevicePlan) -> Candidate:
    c = dp.candidate
    assert c is not None  # only devices with a pick are ranked
    return c


def fits_elsewhere(devices: tuple[DevicePlan, ...], exclude: Device) -> list[tuple[str, str]]:
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
    elsewhere = fits_elsewhere(devices, primary.device) if forced else []
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
    served: frozenset[str],
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
    placement = Placement.single(best.device)
    budget = selection.budget
    plan = None
    chosen = selection.chosen
    if chosen is not None and chosen.fit is not None:
        fit = chosen.fit
        plan = Plan(
            entry=chosen.entry,
            probe=probe,
            placement=placement,
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
    return PlanOutcome(probe=probe, placement=placement, selection=selection,
                       kv_cache_type_source=kv_cache_type_source, plan=plan, devices=devices, device_choice=why,
                       forced_device=device, admission=admission, speed=speed)

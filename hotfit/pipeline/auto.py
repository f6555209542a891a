"""The ``hotfit auto`` job: dry run, fast no-op, or the resumable pipeline under the one-per-home lock.

Every path runs stages through the one engine: the dry run and the no-op check run the planning
subset (probe → plan) ephemerally — no lock, no state, no files — and a provisioning runs the whole
stage table against ``state.db`` and writes the manifest. The CLI (pipeline/cli/auto.py) parses the
options and renders what :func:`provision` returns.

``auto --grade`` adds the multi-turn grade after re-check (``stages/grade.py``)
and writes its verdict into the manifest. A failing or inconclusive grade is recorded and does not fail
``auto``: the spec's selection stays curation-only, the grade's thresholds are not yet calibrated
against any registry model, and an inconclusive grade names a stack problem, not the model — so the
provisioning stands and the verdict is evidence for the operator (the manifest, the `auto` summary,
``<home>/grades/``). A gate (``--grade-required``) is left for when the thresholds are calibrated.
A full-tier pass of a tool-chat model is recorded as evidence (:mod:`pipeline.evidence`), which only
``--admit-graded`` counts; without it selection is curation-only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal, cast

import anyio

from hotfit.backends.base import AllocationReport, ManifestFacts
from hotfit.core.entry import template_json
from hotfit.core.errors import HotfitError, Interrupted, UsageError
from hotfit.core.log import get_logger
from hotfit.core.model_files import FetchResult, TemplateResult, VerifyResult
from hotfit.planner.plan import Plan
from hotfit.planner.probe import ProbeResult
from hotfit.core.settings import Settings
from hotfit.pipeline.engine import STOP_SIGNALS, PipelineOutcome, Runner, signal_receiver
from hotfit.pipeline.evidence import record_grade
from hotfit.pipeline.manifest import (
    Manifest,
    grade_summary,
    provisioned_device,
    read_manifest,
    utc_now_iso,
    write_manifest,
)
from hotfit.pipeline.provision import (
    SESSION_STAGES,
    AutoOptions,
    planning_stages,
    provisioning_stages,
)
from hotfit.pipeline.session_stages import GRADE_STAGE, GradeOptions, grade_stage
from hotfit.pipeline.worker import WorkerFacts, find_worker, worker_held_bytes
from hotfit.stages.grade import GradeResult
from hotfit.stages.measure_speed import SPEED_STAGE, SpeedResult
from hotfit.stages.load import LoadResult
from hotfit.planner.devices import PlanOutcome, PreviousModel
from hotfit.planner.document import outcome_json
from hotfit.stages.probe_tool_call import ProbeToolCallResult
from hotfit.state.locks import FileLock
from hotfit.state.store import StateStore

log = get_logger()


@dataclass(frozen=True)
class AutoOutcome:
    """What ``hotfit auto`` did, for the CLI to render."""

    kind: Literal["dry_run", "noop", "provisioned"]
    data: dict[str, Any]  # what --json prints (the manifest, or the dry-run document)
    plan: Plan
    manifest: Manifest | None = None  # noop: the standing one; provisioned: the new one
    resumed: bool = False
    skipped: tuple[str, ...] = ()


def grade_problems(manifest: Manifest, grade: GradeOptions | None) -> list[str]:
    """Why ``auto --grade`` must run although the provisioning still holds ([] = graded as asked)."""
    if grade is None:
        return []
    if manifest.grade is None:
        return ["--grade: the provisioned model has no grade recorded"]
    if manifest.grade.get("tier") != grade.tier:
        return [f"--grade: the recorded grade is {manifest.grade.get('tier')} tier, {grade.tier} asked"]
    return []


def noop_problems(manifest: Manifest, plan: Plan) -> list[str]:
    """Pure-ish: why the last provisioning does not stand for ``plan`` ([] = a fast no-op)."""
    problems: list[str] = []
    if manifest.entry_name != plan.entry.name:
        problems.append(f"the plan picks {plan.entry.name}, not the provisioned {manifest.entry_name}")
    if manifest.kv_cache_type != plan.kv_cache_type:
        problems.append(f"KV type is {plan.kv_cache_type} now, {manifest.kv_cache_type} when provisioned")
    pinned = (manifest.plan.get("entry") or {}).get("artifact")
    now = dataclasses.asdict(plan.entry.artifact) if plan.entry.artifact else None
    if pinned != now:
        problems.append("the registry pins a different artifact for this entry")
    if (manifest.plan.get("entry") or {}).get("chat_template") != template_json(plan.entry.chat_template):
        problems.append("the registry names a different chat template for this entry")
    problems += manifest.files_in_place()
    return problems


@dataclass(frozen=True)
class ProvisionedResults:
    """The typed results of a finished ``hotfit auto`` run the manifest is built from (each a
    fresh result or the same type decoded from its record)."""

    run_id: str
    plan: Plan
    fetched: FetchResult
    template: TemplateResult
    verified: VerifyResult
    loaded: LoadResult
    call: ProbeToolCallResult
    report: AllocationReport
    graded: GradeResult | None = None
    speed: SpeedResult | None = None  # measure-speed (absent with --skip-speed-check)

    @classmethod
    def of(cls, outcome: PipelineOutcome) -> ProvisionedResults:
        assert outcome.plan is not None
        result = outcome.result
        return cls(run_id=outcome.run_id, plan=outcome.plan, fetched=result("fetch-weights", FetchResult),
                   template=result("fetch-template", TemplateResult), verified=result("verify", VerifyResult),
                   loaded=result("load", LoadResult), call=result("probe-tool-call", ProbeToolCallResult),
                   report=cast(AllocationReport, outcome.results["re-check"]),  # a backend's report (a protocol)
                   graded=result(GRADE_STAGE, GradeResult) if GRADE_STAGE in outcome.results else None,
                   speed=result(SPEED_STAGE, SpeedResult) if SPEED_STAGE in outcome.results else None)


def build_manifest(results: ProvisionedResults) -> Manifest:
    """The manifest of a finished run, from the stages' typed results (pure)."""
    plan = results.plan
    verified, template, fetched, loaded = results.verified, results.template, results.fetched, results.loaded
    call, report = results.call, results.report
    device = plan.placement.device
    model_path = verified.weights_path
    assert model_path is not None  # the load stage refuses a verify result without weights (stages/load.py)
    # what the load ran says what the manifest keeps of its session (its runtime's own figures…)
    own = loaded.binary.manifest_facts(
        report=report, session=loaded.record, snapshot_commit=fetched.snapshot.commit if fetched.snapshot else None,
        call_facts=call.backend_facts) if loaded.binary is not None else ManifestFacts(measured={})
    return Manifest(
        run_id=results.run_id,
        plan_id=plan.plan_id,
        written_at=utc_now_iso(),
        entry_name=plan.entry.name,
        model_path=model_path,
        model_size_bytes=verified.size_bytes,
        model_sha256=verified.sha256,
        template_path=template.path or verified.chat_template_path,
        template_sha256=template.sha256 if template.path else None,
        projector_path=fetched.projector.path if fetched.projector else None,
        kv_cache_type=plan.kv_cache_type,
        planned_hot_context_tokens=plan.hot_context_tokens,
        measured={
            # a measurement of one session on one day, not a setting (serve re-checks it)
            "opened_context_tokens": report.opened_context_tokens,
            "estimated_kv_bytes": report.estimated_kv_bytes,
            "actual_kv_bytes": report.actual_kv_bytes,
            "kv_ratio": report.ratio,
            "verdict": report.verdict,
            "warnings": list(report.warnings),
            **own.measured,
            "measured_by_run": results.run_id,
        },
        probe_verdict={
            "passed": call.verdict.passed,
            "reason": call.verdict.reason,
            "tool": call.verdict.tool_name,
            "template": call.template,
            "prompt_tokens_per_s": call.prompt_tokens_per_s,
            "generation_tokens_per_s": call.generation_tokens_per_s,
        },
        backend_build=dict(own.build),
        device={"index": device.index, "kind": device.kind, "name": device.name,
                "total_bytes": device.total_bytes, "free_bytes_at_plan": device.free_bytes,
                "ggml_device": device.ggml_device},
        plan=plan.to_json(),
        extra={"vision": fetched.vision} | dict(own.extra),
        backend=plan.backend,
        grade=grade_summary(results.graded.to_json(), run_id=results.run_id) if results.graded else None,
        speed=speed_summary(plan, results.speed),
    )


def speed_summary(plan: Plan, measured: SpeedResult | None) -> dict[str, Any]:
    """The manifest's ``speed``: the plan's prediction, what the session measured (None: the check was
    skipped with --skip-speed-check) and their ratio (predicted / measured)."""
    predicted = dict(plan.speed_predicted) if plan.speed_predicted else None
    if measured is None:
        return {"predicted": predicted, "measured": None, "ratio": {}, "skipped": "--skip-speed-check"}
    return {"predicted": predicted, "measured": dict(measured.measured), "ratio": dict(measured.ratio)}


async def previous_model(opts: AutoOptions, settings: Settings) -> tuple[Manifest | None, PreviousModel | None]:
    """The standing manifest, and the previous model the planner keeps while it qualifies."""
    manifest, previous, _worker = await _standing(opts, settings, worker_wanted=False)
    return manifest, previous


async def _standing(opts: AutoOptions, settings: Settings, *,
                    worker_wanted: bool) -> tuple[Manifest | None, PreviousModel | None, WorkerFacts | None]:
    """(manifest, the previous model the planner keeps while it qualifies, the live `hotfit serve`
    worker of this home serving the manifest's model, if any). The worker is looked for when the
    previous model is judged, or when ``worker_wanted`` (a run that may provision beside it)."""
    manifest = read_manifest(settings.manifest_path)
    if manifest is None:
        return None, None, None
    keeps_previous = not (opts.refresh or opts.model)
    worker = (await anyio.to_thread.run_sync(find_worker, settings.serve_pid_path, manifest)
              if keeps_previous or worker_wanted else None)
    if not keeps_previous:
        return manifest, None, worker
    # Kept while it qualifies on the device it was provisioned on; a worker of this home
    # serving it right now holds memory that is the previous model's own.
    held = 0
    if worker is not None:
        try:
            held = worker_held_bytes(manifest, worker)
        except (UsageError, KeyError, TypeError, ValueError, AttributeError) as exc:  # unusable plan
            log.info("worker.unjudged", reason=str(exc))
    return manifest, PreviousModel(manifest.entry_name, device=provisioned_device(manifest),
                                   worker_held_bytes=held), worker


def _beside_worker(worker: WorkerFacts | None) -> dict[str, Any]:
    """A run that provisions while `hotfit serve` serves loads its own llama-server beside the
    worker (the load, tool probe and re-check need one) and leaves the worker as it is: said as a
    warning and in the output, so an operator knows the worker still serves the old provisioning."""
    if worker is None:
        return {}
    rec = worker.record
    log.warning("run.beside_worker", pid=rec.pid, port=rec.port, model=rec.entry_name,
                detail=f"`hotfit serve` (pid {rec.pid}, port {rec.port}) is serving {rec.entry_name} from this home; "
                       "this run loads its own llama-server beside it (more memory in use until it ends) and "
                       "does not stop or replace the worker: restart `hotfit serve` to serve what this run provisions")
    return {"serving_worker": {"pid": rec.pid, "port": rec.port, "model": rec.entry_name, "replaced": False}}


async def plan_only(opts: AutoOptions, settings: Settings,
                    previous: PreviousModel | None) -> tuple[ProbeResult, PlanOutcome]:
    """probe → plan through the engine, ephemerally (nothing written, the binary not checked)."""
    seen: list[PlanOutcome] = []
    outcome = await Runner(planning_stages(opts, previous, on_plan=seen.append, check_backend=False), None,
                           settings, handle_signals=False).run()
    probe = outcome.results["probe"]
    assert isinstance(probe, ProbeResult) and seen
    return probe, seen[-1]


async def provision(opts: AutoOptions, settings: Settings, grade: GradeOptions | None = None) -> AutoOutcome:
    """Dry run, fast no-op, or the resumable pipeline under the one-per-home lock; ``grade``: also
    grade the opened model (``auto --grade``), recorded in the manifest."""
    if opts.dry_run:  # changes nothing: no lock, no state, no files
        manifest, previous = await previous_model(opts, settings)
        probe, planned = await plan_only(opts, settings, previous)
        plan = planned.plan
        assert plan is not None
        data = {
            "dry_run": True,
            "probe": probe.to_json(),
            "plan": plan.to_json() | {"plan_id": plan.plan_id},
            "selection": outcome_json(planned),
            "model": plan.entry.name,
            "kv_cache_type": plan.kv_cache_type,
            "estimated_hot_context_tokens": plan.hot_context_tokens,
            "previous_model": manifest.entry_name if manifest else None,
            "device": {"index": plan.placement.device.index, "kind": plan.placement.device.kind,
                       "name": plan.placement.device.name},
            "reused": plan.reused_previous,
            "would": ("nothing (provisioned and still valid)"
                      if manifest and not opts.recheck and not noop_problems(manifest, plan)
                      + grade_problems(manifest, grade) else "provision"),
        }
        return AutoOutcome("dry_run", data, plan)

    lock = FileLock(settings.lock_path, wait=opts.wait, what=f"hotfit home {settings.home}")
    async with held_interruptibly(lock):
        manifest, previous, worker = await _standing(opts, settings, worker_wanted=True)
        if manifest is not None and manifest.rehomed_from is not None:
            # a copied home: its manifest names this home's files from now on (docs/faults-state.md)
            await anyio.to_thread.run_sync(write_manifest, settings.manifest_path, manifest)
            log.info("home.copied", from_home=manifest.rehomed_from, home=str(settings.home),
                     file=str(settings.manifest_path), records=1)
        if manifest is not None and not opts.recheck and not opts.refresh:
            _probe, planned = await plan_only(opts, settings, previous)
            assert planned.plan is not None
            problems = noop_problems(manifest, planned.plan) + grade_problems(manifest, grade)
            if not problems:
                log.info("run.noop", model=manifest.entry_name, plan_id=planned.plan.plan_id,
                         provisioned_by_run=manifest.run_id,
                         serving_worker_held_bytes=previous.worker_held_bytes if previous else 0)
                data = manifest.to_json() | {"noop": True} | _admitted_json(opts, planned)
                return AutoOutcome("noop", data, planned.plan, manifest)
            log.info("run.provisioning_stale", model=manifest.entry_name, reasons=problems)
        beside = _beside_worker(worker)
        store = await StateStore.open(settings.state_db, lock_path=settings.lock_path)
        failed = True
        try:
            planned_now: list[PlanOutcome] = []
            stages = (provisioning_stages(opts, previous, on_plan=planned_now.append)
                      + ([grade_stage(grade)] if grade is not None else []))
            run_args = opts.to_json() | ({"grade": grade.to_json()} if grade is not None else {})
            runner = Runner(stages, store, settings, run_args=run_args,
                            force=(*SESSION_STAGES, SPEED_STAGE, GRADE_STAGE) if opts.recheck else ())
            outcome = await runner.run()
            failed = False
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    # housekeeping: after a failed run (a full or read-only disk) it must not replace
                    # the run's own error (docs/faults.md)
                    with contextlib.suppress(*((OSError, HotfitError) if failed else ())):
                        await prune_runs(store, settings, protect=(manifest.run_id,) if manifest else ())
                finally:
                    await store.aclose()
        new_manifest = build_manifest(ProvisionedResults.of(outcome))
        admitted = _admitted_json(opts, planned_now[-1]) if planned_now else {}
        if admitted.get("admitted_by_grade"):  # what the pick rests on, kept with the provisioning
            new_manifest = dataclasses.replace(new_manifest, extra={**new_manifest.extra, **admitted})
        await anyio.to_thread.run_sync(write_manifest, settings.manifest_path, new_manifest)
        log.info("manifest.written", path=str(settings.manifest_path), model=new_manifest.entry_name,
                 run_id=outcome.run_id, plan_id=new_manifest.plan_id)
        plan = outcome.plan
        assert plan is not None
        data = new_manifest.to_json() | admitted | beside
        graded = outcome.outputs.get(GRADE_STAGE)
        if graded and GRADE_STAGE not in outcome.skipped:  # a reused grade was recorded when it ran
            data["grade_evidence"] = await anyio.to_thread.run_sync(
                lambda: record_grade(settings, plan.entry, plan.placement.device.kind, graded,
                                     grade_record=str(graded.get("path"))))
        return AutoOutcome("provisioned", data, plan, new_manifest,
                           resumed=outcome.resumed, skipped=outcome.skipped)


async def prune_runs(store: StateStore, settings: Settings, protect: tuple[str, ...] = ()) -> list[str]:
    """Keep state.db and runs/ bounded: drop the runs older than the newest ``settings.keep_runs``
    (never the standing manifest's) with their ``runs/<run_id>/`` directories. Only after a run that
    used the store, so a no-op pays nothing for it. A failure to prune is a warning, not the run's
    outcome."""
    try:
        pruned = await store.prune_runs(settings.keep_runs, protect)
    except Exception as exc:  # LockedError (busy), OSError: the next run prunes instead
        log.warning("state.prune_failed", error=str(exc))
        return []
    if pruned:
        def remove_run_dirs() -> None:
            for r in pruned:
                shutil.rmtree(settings.runs_dir / r, ignore_errors=True)

        await anyio.to_thread.run_sync(remove_run_dirs)
        log.info("state.pruned", runs=len(pruned), oldest=pruned[0], newest=pruned[-1], kept=settings.keep_runs)
    return pruned


def _admitted_json(opts: AutoOptions, planned: PlanOutcome) -> dict[str, Any]:
    """With --admit-graded: ``admitted_by_grade`` — the evidence the pick rests on, or None when the
    pick is agentic by curation (so a consumer can tell the two apart); nothing without the flag."""
    if not opts.admit_graded:
        return {}
    ev = planned.admitted_evidence
    return {"admitted_by_grade": None if ev is None else dict(ev)}


@contextlib.asynccontextmanager
async def held_interruptibly(lock: FileLock) -> AsyncIterator[FileLock]:
    """Hold the home lock. SIGINT/SIGTERM/SIGHUP while queued behind another run (--wait) ends with
    Interrupted (exit 130) and a ``lock.wait_interrupted`` event; nothing was written, since
    state belongs to the lock holder. (Once held, the runner handles signals itself.)"""
    received: list[int] = []
    failure: Exception | None = None
    with signal_receiver(*STOP_SIGNALS) as signals:
        async with anyio.create_task_group() as tg:
            async def watch() -> None:
                async for signum in signals:
                    received.append(signum)
                    tg.cancel_scope.cancel()
                    return

            tg.start_soon(watch)
            try:
                await lock.acquire_async()
            except Exception as exc:  # LockedError: kept out of the task group's ExceptionGroup
                failure = exc
            finally:
                tg.cancel_scope.cancel()
    if failure is not None:
        raise failure
    if received:
        lock.release()  # held only if it was granted as the signal arrived
        name = signal.Signals(received[0]).name
        log.warning("lock.wait_interrupted", signal=name, lock=str(lock.path))
        raise Interrupted(f"interrupted by {name} while waiting for {lock.what}; nothing was changed",
                          hint="rerun the same command to queue again", signal=name)
    try:
        yield lock
    finally:
        lock.release()

"""The pipeline engine: ordered stages, persisted state, resume, signals, structured events.

It knows nothing of hotfit's stages (each declares itself in its ``stages/<name>.py``; the order is
:mod:`pipeline.provision`). A :class:`Stage` is a :class:`~stages.declaration.StageDeclaration`: a
name plus one async function taking a :class:`~stages.declaration.StageContext` (run id, settings,
the frozen plan once the plan stage has run, the frozen results of earlier stages, the stage's job)
and returning a frozen result with ``to_json()``. The engine owns everything effectful around it:

* state: one record per (run, stage) in :mod:`state.store`; a stage is marked done only after
  its function returned, i.e. after its files are in place;
* resume: a stage's *inputs hash* covers what it depends on (by default the plan id plus the
  fingerprints of the stages it names in ``deps``) and its ``version``. A done record with the same
  hash, whose outputs decode (``Stage.decode``, once) and are still valid on disk
  (``Stage.still_valid``, handed that decoded result), is reused and the stage logged as ``stage.skip``; downstream then gets
  the same result type a fresh run returns. A record that does not decode is logged
  (``stage.stale``, with the :class:`~core.errors.StageRecordError` naming the stage, the state
  file and the field) and the stage runs again. A changed plan gives new hashes, so everything
  downstream of it runs again;
* live resources: stages in one ``session`` (load → probe-tool-call → re-check share a running
  llama-server) are skipped together or run together; what a stage enters through
  ``ctx.enter_context`` is closed when the pipeline ends, fails or is interrupted;
* signals: SIGINT/SIGTERM/SIGHUP cancel the runner's task group; the running stage is recorded as
  ``interrupted``, entered contexts are closed (llama-server reaped) under a shield, and
  :class:`~core.errors.Interrupted` is raised (exit 130). ``kill -9`` leaves a ``running``
  record that the next run, holding the lock, turns into ``interrupted`` and resumes;
* events: ``run.start``, ``stage.start``, ``stage.skip``, ``stage.done``, ``stage.fail``,
  ``run.done`` — each bound with ``run_id``, ``stage`` and ``plan_id``.

A runner given no store runs *ephemerally* (``hotfit pull``, ``auto --dry-run``, the no-op check):
the same sequencing, failure and cleanup, against an in-memory store, so nothing is written, nothing
is reused, and no run/stage lifecycle events are logged (no run exists that ``hotfit status`` could
show).

Just over 400 lines: sequencing, reuse, sessions, signals and events are the engine's one job.
"""

from __future__ import annotations

import contextlib
import hashlib
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager as AsyncContextManager
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

import anyio

from hotfit.core.errors import HotfitError, Interrupted, StageRecordError
from hotfit.core.log import bind, get_logger, unbind
from hotfit.core.records import canonical_json
from hotfit.planner.plan import Plan
from hotfit.core.settings import Settings
from hotfit.stages.declaration import EnterContext, StageContext
from hotfit.stages.declaration import StageDeclaration as Stage
from hotfit.state.store import IN_MEMORY_PATH, RunStatus, StageRecord, StageStatus, StateStore

__all__ = ["STOP_SIGNALS", "PipelineOutcome", "RunContext", "Runner", "Stage", "StageContext", "inputs_hash",
           "signal_receiver"]

T = TypeVar("T")
log = get_logger()

# The signals that stop a command the way Ctrl-C does (cancelled, cleaned up, exit 130, resumable):
# SIGHUP is an ssh session or terminal that went away (docs/faults-state.md).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# How long closing entered contexts (reaping llama-server) may take after a signal.
CLEANUP_TIMEOUT_S = 30.0


@contextlib.contextmanager
def signal_receiver(*signums: signal.Signals) -> Iterator[Any]:
    """``anyio.open_signal_receiver`` that puts back the handlers it found. asyncio's removal sets
    SIGTERM to its default (exit 143, no message) and SIGINT to Python's (KeyboardInterrupt wherever
    the code is), which would undo the command line's handlers for the rest of the command."""
    saved = {s: signal.getsignal(s) for s in signums}
    try:
        with anyio.open_signal_receiver(*signums) as received:
            yield received
    finally:
        for signum, handler in saved.items():
            if handler is not None:  # None: not installed from Python, nothing to put back
                with contextlib.suppress(ValueError):  # not the main thread
                    signal.signal(signum, handler)


def _typed(results: Mapping[str, object], stage: str, kind: type[T]) -> T:
    value = results[stage]
    if not isinstance(value, kind):  # a stage table wiring bug, not an operator's problem
        raise TypeError(f"stage {stage!r} handed a {type(value).__name__}, not a {kind.__name__}")
    return value


@dataclass(frozen=True)
class RunContext:
    """The engine's :class:`~stages.declaration.StageContext`: one per stage of a run."""

    run_id: str
    run_dir: Path
    settings: Settings
    plan: Plan | None  # set once the plan stage has run
    results: Mapping[str, object]  # read-only: stage name -> frozen result of an earlier stage
    enter_context: EnterContext
    stage_job: object | None = None  # the running stage's declared job

    def result(self, stage: str, kind: type[T]) -> T:
        """The result of an earlier ``stage``, which is a ``kind`` whether it ran or was reused."""
        return _typed(self.results, stage, kind)

    def require_plan(self) -> Plan:
        if self.plan is None:
            raise RuntimeError("this stage runs after the plan stage")  # a stage table wiring bug
        return self.plan

    def job(self, kind: type[T]) -> T:
        if not isinstance(self.stage_job, kind):  # a stage table wiring bug
            raise TypeError(f"this stage was handed a {type(self.stage_job).__name__} job, not a {kind.__name__}")
        return self.stage_job


@dataclass(frozen=True)
class PipelineOutcome:
    run_id: str
    resumed: bool
    plan: Plan | None
    results: Mapping[str, object]
    outputs: Mapping[str, dict[str, Any] | None]
    skipped: tuple[str, ...]
    ran: tuple[str, ...]

    def result(self, stage: str, kind: type[T]) -> T:
        """The result ``stage`` handed on (ran or reused), which is a ``kind``."""
        return _typed(self.results, stage, kind)


@dataclass(frozen=True)
class _Reuse:
    digest: str
    record: StageRecord
    result: object


def inputs_hash(stage: Stage[Any], ctx: StageContext, fingerprints: Mapping[str, Any]) -> str:
    """sha256 of what ``stage`` depends on: its own inputs (default: the plan id), the
    fingerprints of the upstream stages it names, and its version (so a record of another version
    is never reused; version 1 adds nothing, which keeps the records written before versions)."""
    own = stage.inputs(ctx) if stage.inputs else {"plan_id": ctx.plan.plan_id if ctx.plan else None}
    doc: dict[str, Any] = {"stage": stage.name, "inputs": own,
                           "upstream": {d: fingerprints.get(d) for d in stage.deps}}
    if stage.version != 1:
        doc["version"] = stage.version
    return hashlib.sha256(canonical_json(doc).encode()).hexdigest()


def _fingerprint(stage: Stage[Any], result: object, outputs: Mapping[str, Any] | None) -> Any:
    if outputs is None or stage.fingerprint is None:
        return outputs
    return stage.fingerprint(result)


def damaged_record(stage: str, store_path: Path, run_id: str, exc: Exception) -> StageRecordError:
    """The typed error for a record that did not decode: which stage, which file, which field."""
    field = exc.details.get("field") if isinstance(exc, StageRecordError) else None
    what = exc.what if isinstance(exc, StageRecordError) else f"{type(exc).__name__}: {exc}"
    return StageRecordError(
        f"stage {stage}: its record from run {run_id} in {store_path} does not decode ({what})",
        hint="nothing to do: the stage runs again instead of trusting the record",
        stage=stage, state_db=str(store_path), from_run=run_id, field=field)


class Runner:
    """Runs ``stages`` in order against ``store`` (None: ephemerally). One instance per invocation."""

    def __init__(self, stages: Sequence[Stage[Any]], store: StateStore | None, settings: Settings, *,
                 run_args: Mapping[str, Any] | None = None, force: Sequence[str] = (),
                 handle_signals: bool = True, plan_stage: str = "plan") -> None:
        names = [s.name for s in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate stage names: {names}")
        self.stages = list(stages)
        self.store = store
        self.settings = settings
        self.run_args = dict(run_args or {})
        self.force = frozenset(force)
        self.handle_signals = handle_signals
        self.plan_stage = plan_stage
        self.signal_received: int | None = None
        self.recorded = store is not None  # False: ephemeral, no lifecycle events

    def _event(self, level: str, event: str, **fields: Any) -> None:
        if self.recorded:
            getattr(log, level)(event, **fields)

    def _bind(self, **fields: Any) -> None:
        if self.recorded:
            bind(**fields)

    async def run(self) -> PipelineOutcome:
        if self.store is not None:
            return await self._run(self.store)
        store = await StateStore.open(IN_MEMORY_PATH)
        try:
            return await self._run(store)
        finally:
            with anyio.CancelScope(shield=True):
                await store.aclose()

    async def _run(self, store: StateStore) -> PipelineOutcome:
        names = [s.name for s in self.stages]
        # We hold the pipeline lock, so any 'running' record is from a process that died.
        await store.mark_stale_runs_interrupted()
        latest = await store.latest_run()
        resumed = bool(latest and latest.status != "done" and
                       [r.stage for r in await store.stages(latest.run_id)] == names)
        if resumed:
            assert latest is not None
            run_id = latest.run_id
            await store.reopen_run(run_id)
            previous_plan_id = latest.plan_id
        else:
            run_id = (await store.create_run(names, self.run_args)).run_id
            previous_plan_id = None
        run_dir = Path(self.settings.runs_dir) / run_id
        self._bind(run_id=run_id)
        started = time.monotonic()
        self._event("info", "run.start", resumed=resumed, stages=names,
                    **{k: v for k, v in self.run_args.items() if v is not None})
        failure: Exception | None = None
        outcome: PipelineOutcome | None = None
        try:
            async with anyio.create_task_group() as tg:
                if self.handle_signals:
                    await tg.start(self._watch_signals, tg.cancel_scope)
                try:
                    outcome = await self._run_stages(store, run_id, run_dir, resumed, previous_plan_id)
                except Exception as exc:  # kept out of the task group's ExceptionGroup
                    failure = exc
                finally:
                    tg.cancel_scope.cancel()  # stop the signal watcher
            if failure is not None:
                raise failure
        except BaseException as exc:
            if isinstance(exc, HotfitError) and self.signal_received is None:
                await self._finish_failed(store, run_id, "failed", exc.to_json(), started)
                raise
            if self.signal_received is not None:  # whatever the stage raised on its way out
                name = signal.Signals(self.signal_received).name
                err = Interrupted(f"interrupted by {name}; rerun the same command to resume",
                                  hint="completed stages and downloaded bytes are kept", signal=name)
                await self._finish_failed(store, run_id, "interrupted", err.to_json(), started)
                raise err from None
            status: RunStatus = "interrupted" if isinstance(exc, (KeyboardInterrupt, anyio.get_cancelled_exc_class())) \
                else "failed"
            await self._finish_failed(store, run_id, status, {"code": "internal", "message": repr(exc)}, started)
            raise
        if self.signal_received is not None:  # signal arrived after the last await
            name = signal.Signals(self.signal_received).name
            err = Interrupted(f"interrupted by {name}; rerun the same command to resume",
                              hint="completed stages and downloaded bytes are kept", signal=name)
            await self._finish(store, run_id, "interrupted", err.to_json(), started)
            raise err
        assert outcome is not None
        await self._finish(store, run_id, "done", None, started)
        return outcome

    async def _finish_failed(self, store: StateStore, run_id: str, status: RunStatus, error: dict[str, Any],
                             started: float) -> None:
        """:meth:`_finish` while the run's own error unwinds: a store or log that cannot take the record
        (the disk that failed the stage, full or read-only) must not replace that error
        (docs/faults.md); the rerun finds the run 'running' and marks it interrupted."""
        try:
            await self._finish(store, run_id, status, error, started)
        except (OSError, HotfitError):
            if self.recorded:
                unbind("run_id", "stage", "plan_id")

    async def _finish(self, store: StateStore, run_id: str, status: RunStatus, error: dict[str, Any] | None,
                      started: float) -> None:
        with anyio.CancelScope(shield=True):
            await store.finish_run(run_id, status, error)
        self._event("info", "run.done", status=status, duration_s=round(time.monotonic() - started, 3),
                    **({"error": error} if error else {}))
        if self.recorded:
            unbind("run_id", "stage", "plan_id")

    async def _watch_signals(self, scope: anyio.CancelScope, *, task_status: Any) -> None:
        with signal_receiver(*STOP_SIGNALS) as signals:
            task_status.started()
            async for signum in signals:
                self.signal_received = signum
                log.warning("run.signal", signal=signal.Signals(signum).name)
                scope.cancel()
                return

    async def _run_stages(self, store: StateStore, run_id: str, run_dir: Path, resumed: bool,
                          previous_plan_id: str | None) -> PipelineOutcome:
        results: dict[str, object] = {}
        outputs: dict[str, dict[str, Any] | None] = {}
        fingerprints: dict[str, Any] = {}
        skipped: list[str] = []
        ran: list[str] = []
        plan: Plan | None = None
        async with AsyncExitStack() as stack:
            async def enter_context(cm: AsyncContextManager[T]) -> T:
                return await stack.enter_async_context(cm)

            def context(stage: Stage[Any]) -> RunContext:
                return RunContext(run_id=run_id, run_dir=run_dir, settings=self.settings, plan=plan,
                                  results=MappingProxyType(dict(results)), enter_context=enter_context,
                                  stage_job=stage.job)

            def planned(stage: Stage[Any], result: object) -> Plan:
                # the plan stage's result is its Plan unless plan_of maps it there (Stage.plan_of)
                new_plan: Plan = stage.plan_of(result) if stage.plan_of else result  # type: ignore[assignment]
                self._bind(plan_id=new_plan.plan_id)  # from here on every event names the plan
                return new_plan

            session_skip: dict[str, dict[str, _Reuse]] = {}
            try:
                for index, stage in enumerate(self.stages):
                    self._bind(stage=stage.name)
                    ctx = context(stage)
                    if stage.session and stage.session not in session_skip:
                        session_skip[stage.session] = await self._session_reusable(
                            store, [s for s in self.stages[index:] if s.session == stage.session], ctx,
                            fingerprints, plan)
                    reuse: _Reuse | None
                    if stage.session:
                        reuse = session_skip[stage.session].get(stage.name)
                        digest = reuse.digest if reuse else inputs_hash(stage, ctx, fingerprints)
                    else:
                        digest = inputs_hash(stage, ctx, fingerprints)
                        reuse = await self._reusable(store, stage, digest, plan)
                    plan_id = plan.plan_id if plan is not None else None
                    if reuse is not None:
                        record = reuse.record
                        assert record.outputs is not None
                        results[stage.name] = reuse.result
                        outputs[stage.name] = record.outputs
                        fingerprints[stage.name] = _fingerprint(stage, reuse.result, record.outputs)
                        if stage.name == self.plan_stage:
                            plan = planned(stage, reuse.result)
                        await store.stage_skipped(run_id, stage.name, digest, plan_id, record.outputs,
                                                  f"inputs unchanged since run {record.run_id}")
                        self._event("info", "stage.skip", reason="inputs_unchanged", from_run=record.run_id,
                                    inputs_hash=digest[:16])
                        skipped.append(stage.name)
                        continue
                    await store.stage_running(run_id, stage.name, digest, plan_id)
                    self._event("info", "stage.start", inputs_hash=digest[:16])
                    t0 = time.monotonic()
                    try:
                        result = await stage.fn(ctx)
                    except BaseException as exc:
                        await self._record_failure(store, run_id, stage, exc, time.monotonic() - t0)
                        raise
                    encoded = stage.encode(result)
                    if stage.name == self.plan_stage:
                        plan = planned(stage, result)
                    await store.stage_done(run_id, stage.name, encoded)
                    figures = stage.figures(result) if stage.figures else {}
                    self._event("info", "stage.done", duration_s=round(time.monotonic() - t0, 3), **figures)
                    results[stage.name] = result
                    outputs[stage.name] = encoded
                    fingerprints[stage.name] = _fingerprint(stage, result, encoded)
                    ran.append(stage.name)
                    if stage.name == self.plan_stage and plan is not None:
                        await store.set_run_plan(run_id, plan.plan_id)
                        if resumed and previous_plan_id and previous_plan_id != plan.plan_id:
                            downstream = [s.name for s in self.stages[index + 1:]]
                            await store.reset_stages(run_id, downstream)
                            self._event("info", "plan.changed", previous_plan_id=previous_plan_id,
                                        invalidated=downstream)
            finally:
                if self.recorded:
                    unbind("stage")
                # Close entered contexts (llama-server) even when cancelled by a signal.
                with anyio.CancelScope(shield=True) as shield:
                    shield.deadline = anyio.current_time() + CLEANUP_TIMEOUT_S
                    await stack.aclose()
        return PipelineOutcome(run_id=run_id, resumed=resumed, plan=plan,
                               results=MappingProxyType(results), outputs=MappingProxyType(outputs),
                               skipped=tuple(skipped), ran=tuple(ran))

    async def _record_failure(self, store: StateStore, run_id: str, stage: Stage[Any], exc: BaseException,
                              duration_s: float) -> None:
        error: dict[str, Any]
        status: StageStatus
        if self.signal_received is not None or isinstance(exc, (anyio.get_cancelled_exc_class(), KeyboardInterrupt)):
            error, status = {"code": "interrupted", "message": "stage was interrupted"}, "interrupted"
        elif isinstance(exc, HotfitError):
            error, status = exc.to_json(), "failed"
        else:
            error, status = {"code": "internal", "message": repr(exc)}, "failed"
        # Recorded while the stage's error unwinds: a store or log the same failing disk refuses must
        # not replace it (docs/faults.md); the rerun reruns the stage all the same.
        with anyio.CancelScope(shield=True), contextlib.suppress(OSError, HotfitError):
            await store.stage_failed(run_id, stage.name, error, status)
        event = "stage.interrupted" if status == "interrupted" else "stage.fail"
        with contextlib.suppress(OSError, HotfitError):
            self._event("error", event, duration_s=round(duration_s, 3), error=error)

    async def _reusable(self, store: StateStore, stage: Stage[Any], digest: str, plan: Plan | None) -> _Reuse | None:
        if stage.always_run or stage.name in self.force or not self.recorded:
            return None
        record = await store.find_done(stage.name, digest)
        if record is not None and "outputs_json" in record.damaged:  # not JSON, or not an object
            err = damaged_record(stage.name, store.sync.path, record.run_id, StageRecordError(
                "its outputs are not a JSON object", field="outputs_json"))
            log.warning("stage.stale", reason="recorded outputs do not decode", from_run=record.run_id,
                        error=err.to_json())
            return None
        if record is None or record.outputs is None:
            return None
        try:
            result: object = (stage.decode_for_plan(record.outputs, plan) if stage.decode_for_plan and plan
                              else stage.decode(record.outputs) if stage.decode else MappingProxyType(record.outputs))
        except (StageRecordError, KeyError, TypeError, ValueError) as exc:
            err = damaged_record(stage.name, store.sync.path, record.run_id, exc)
            log.warning("stage.stale", reason="recorded outputs do not decode", from_run=record.run_id,
                        error=err.to_json())
            return None
        if stage.still_valid is not None and not await anyio.to_thread.run_sync(stage.still_valid, result):
            log.info("stage.stale", reason="recorded outputs no longer on disk", from_run=record.run_id)
            return None
        return _Reuse(digest, record, result)

    async def _session_reusable(self, store: StateStore, group: list[Stage[Any]], ctx: RunContext,
                                fingerprints: Mapping[str, Any], plan: Plan | None) -> dict[str, _Reuse]:
        """All of a session's stages reusable (chained through their recorded outputs), or none."""
        tentative = dict(fingerprints)
        found: dict[str, _Reuse] = {}
        for stage in group:
            hit = await self._reusable(store, stage, inputs_hash(stage, replace(ctx, stage_job=stage.job), tentative),
                                       plan)
            if hit is None:
                return {}
            found[stage.name] = hit
            tentative[stage.name] = _fingerprint(stage, hit.result, hit.record.outputs)
        return found

"""The pipeline runner: ordered stages, persisted state, resume, signals, structured events.

A :class:`Stage` is a name plus one async function taking a frozen :class:`StageContext` (run
id, settings, the frozen plan once the plan stage has run, the frozen results of earlier stages)
and returning a frozen result with ``to_json()``. The runner owns everything effectful around
it (issue 6, items 2-6):

* state: one record per (run, stage) in :mod:`state.store`; a stage is marked done only after
  its function returned, i.e. after its files are in place;
* resume: a stage's *inputs hash* covers what it depends on (by default the plan id plus the
  outputs of the stages it names in ``deps``). A done record with the same hash, whose outputs
  are still valid on disk, is reused and the stage logged as ``stage.skip``. A changed plan gives
  new hashes, so everything downstream of it runs again;
* live resources: stages in one ``session`` (load → probe-tool-call → re-check share a running
  llama-server) are skipped together or run together; what a stage enters through
  ``ctx.enter_context`` is closed when the pipeline ends, fails or is interrupted;
* signals: SIGINT/SIGTERM cancel the runner's task group; the running stage is recorded as
  ``interrupted``, entered contexts are closed (llama-server reaped) under a shield, and
  :class:`~pipeline.errors.Interrupted` is raised (exit 130). ``kill -9`` leaves a ``running``
  record that the next run, holding the lock, turns into ``interrupted`` and resumes;
* events: ``run.start``, ``stage.start``, ``stage.skip``, ``stage.done``, ``stage.fail``,
  ``run.done`` — each bound with ``run_id``, ``stage`` and ``plan_id``.
"""

from __future__ import annotations

import hashlib
import signal
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, AsyncContextManager, Awaitable, Callable, Mapping, Sequence, TypeVar

import anyio

from pipeline.errors import HotfitError, Interrupted
from pipeline.log import bind, get_logger, unbind
from pipeline.plan import canonical_json
from state.store import StageRecord, StateStore

T = TypeVar("T")
log = get_logger()

# How long closing entered contexts (reaping llama-server) may take after a signal.
CLEANUP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class StageContext:
    run_id: str
    run_dir: Path
    settings: Any
    plan: Any | None  # pipeline.plan.Plan once the plan stage has run
    results: Mapping[str, Any]  # read-only: stage name -> frozen result of an earlier stage
    enter_context: Callable[[AsyncContextManager[Any]], Awaitable[Any]]
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


def _to_json(result: Any) -> dict[str, Any] | None:
    if result is None:
        return None
    if isinstance(result, Mapping):
        return dict(result)
    return result.to_json()


@dataclass(frozen=True)
class Stage:
    name: str
    fn: Callable[[StageContext], Awaitable[Any]]
    deps: tuple[str, ...] = ()  # stages whose outputs are this stage's inputs
    # Extra inputs; default is the plan id (so a new plan re-runs the stage).
    inputs: Callable[[StageContext], Any] | None = None
    always_run: bool = False  # probe and plan: cheap, and the world may have changed
    session: str | None = None  # stages sharing a live resource: skipped or run as one
    decode: Callable[[dict[str, Any]], Any] | None = None  # recorded outputs -> result (skip)
    still_valid: Callable[[dict[str, Any]], bool] | None = None  # are recorded outputs on disk?
    encode: Callable[[Any], dict[str, Any] | None] = _to_json
    figures: Callable[[Any], dict[str, Any]] | None = None  # key figures for stage.done


@dataclass(frozen=True)
class PipelineOutcome:
    run_id: str
    resumed: bool
    plan: Any | None
    results: Mapping[str, Any]
    outputs: Mapping[str, dict[str, Any] | None]
    skipped: tuple[str, ...]
    ran: tuple[str, ...]


def inputs_hash(stage: Stage, ctx: StageContext, outputs: Mapping[str, Any]) -> str:
    own = stage.inputs(ctx) if stage.inputs else {"plan_id": ctx.plan.plan_id if ctx.plan else None}
    doc = {"stage": stage.name, "inputs": own, "upstream": {d: outputs.get(d) for d in stage.deps}}
    return hashlib.sha256(canonical_json(doc).encode()).hexdigest()


class _Signalled(Exception):
    pass


class Runner:
    """Runs ``stages`` in order against ``store``. One instance per pipeline invocation."""

    def __init__(self, stages: Sequence[Stage], store: StateStore, settings: Any, *,
                 run_args: Mapping[str, Any] | None = None, force: Sequence[str] = (),
                 options: Mapping[str, Any] | None = None, handle_signals: bool = True,
                 plan_stage: str = "plan") -> None:
        names = [s.name for s in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate stage names: {names}")
        self.stages = list(stages)
        self.store = store
        self.settings = settings
        self.run_args = dict(run_args or {})
        self.force = frozenset(force)
        self.options = MappingProxyType(dict(options or {}))
        self.handle_signals = handle_signals
        self.plan_stage = plan_stage
        self.signal_received: int | None = None

    async def run(self) -> PipelineOutcome:
        names = [s.name for s in self.stages]
        # We hold the pipeline lock, so any 'running' record is from a process that died.
        await self.store.mark_stale_runs_interrupted()
        latest = await self.store.latest_run()
        resumed = bool(latest and latest.status != "done" and
                       [r.stage for r in await self.store.stages(latest.run_id)] == names)
        if resumed:
            assert latest is not None
            run_id = latest.run_id
            await self.store.reopen_run(run_id)
            previous_plan_id = latest.plan_id
        else:
            run_id = (await self.store.create_run(names, self.run_args)).run_id
            previous_plan_id = None
        run_dir = Path(self.settings.runs_dir) / run_id if hasattr(self.settings, "runs_dir") else Path(".")
        bind(run_id=run_id)
        started = time.monotonic()
        log.info("run.start", resumed=resumed, stages=names, **{k: v for k, v in self.run_args.items()
                                                              if v is not None})
        failure: Exception | None = None
        outcome: PipelineOutcome | None = None
        try:
            async with anyio.create_task_group() as tg:
                if self.handle_signals:
                    await tg.start(self._watch_signals, tg.cancel_scope)
                try:
                    outcome = await self._run_stages(run_id, run_dir, resumed, previous_plan_id)
                except Exception as exc:  # kept out of the task group's ExceptionGroup
                    failure = exc
                finally:
                    tg.cancel_scope.cancel()  # stop the signal watcher
            if failure is not None:
                raise failure
        except HotfitError as exc:
            await self._finish(run_id, "failed", exc.to_json(), started)
            raise
        except BaseException as exc:
            if self.signal_received is not None:
                err = Interrupted(
                    f"interrupted by {signal.Signals(self.signal_received).name}; "
                    "rerun the same command to resume",
                    hint="completed stages and downloaded bytes are kept",
                )
                await self._finish(run_id, "interrupted", err.to_json(), started)
                raise err from None
            status = "interrupted" if isinstance(exc, (KeyboardInterrupt, anyio.get_cancelled_exc_class())) \
                else "failed"
            await self._finish(run_id, status, {"code": "internal", "message": repr(exc)}, started)
            raise
        if self.signal_received is not None:  # signal arrived after the last await
            err = Interrupted("interrupted; rerun the same command to resume")
            await self._finish(run_id, "interrupted", err.to_json(), started)
            raise err
        assert outcome is not None
        await self._finish(run_id, "done", None, started)
        return outcome

    async def _finish(self, run_id: str, status: str, error: dict[str, Any] | None, started: float) -> None:
        with anyio.CancelScope(shield=True):
            await self.store.finish_run(run_id, status, error)  # type: ignore[arg-type]
        log.info("run.done", status=status, duration_s=round(time.monotonic() - started, 3),
                 **({"error": error} if error else {}))
        unbind("run_id", "stage", "plan_id")

    async def _watch_signals(self, scope: anyio.CancelScope, *, task_status: Any) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            task_status.started()
            async for signum in signals:
                self.signal_received = signum
                log.warning("run.signal", signal=signal.Signals(signum).name)
                scope.cancel()
                return

    async def _run_stages(self, run_id: str, run_dir: Path, resumed: bool,
                          previous_plan_id: str | None) -> PipelineOutcome:
        results: dict[str, Any] = {}
        outputs: dict[str, dict[str, Any] | None] = {}
        skipped: list[str] = []
        ran: list[str] = []
        plan: Any = None
        async with AsyncExitStack() as stack:
            async def enter_context(cm: AsyncContextManager[T]) -> T:
                return await stack.enter_async_context(cm)

            def context() -> StageContext:
                return StageContext(run_id=run_id, run_dir=run_dir, settings=self.settings, plan=plan,
                                    results=MappingProxyType(dict(results)), enter_context=enter_context,
                                    options=self.options)

            session_skip: dict[str, dict[str, tuple[str, StageRecord]]] = {}
            try:
                for index, stage in enumerate(self.stages):
                    bind(stage=stage.name)
                    ctx = context()
                    if stage.session and stage.session not in session_skip:
                        session_skip[stage.session] = await self._session_reusable(
                            [s for s in self.stages[index:] if s.session == stage.session], ctx, outputs)
                    reuse: tuple[str, StageRecord] | None
                    if stage.session:
                        reuse = session_skip[stage.session].get(stage.name)
                        digest = reuse[0] if reuse else inputs_hash(stage, ctx, outputs)
                    else:
                        digest = inputs_hash(stage, ctx, outputs)
                        reuse = await self._reusable(stage, digest)
                    plan_id = plan.plan_id if plan is not None else None
                    if reuse is not None:
                        _digest, record = reuse
                        assert record.outputs is not None
                        results[stage.name] = stage.decode(record.outputs) if stage.decode else \
                            MappingProxyType(record.outputs)
                        outputs[stage.name] = record.outputs
                        await self.store.stage_skipped(run_id, stage.name, digest, plan_id, record.outputs,
                                                       f"inputs unchanged since run {record.run_id}")
                        log.info("stage.skip", reason="inputs_unchanged", from_run=record.run_id,
                                 inputs_hash=digest[:16])
                        skipped.append(stage.name)
                        continue
                    await self.store.stage_running(run_id, stage.name, digest, plan_id)
                    log.info("stage.start", attempt_inputs_hash=digest[:16])
                    t0 = time.monotonic()
                    try:
                        result = await stage.fn(ctx)
                    except BaseException as exc:
                        await self._record_failure(run_id, stage, exc, time.monotonic() - t0)
                        raise
                    encoded = stage.encode(result)
                    await self.store.stage_done(run_id, stage.name, encoded)
                    figures = stage.figures(result) if stage.figures else {}
                    log.info("stage.done", duration_s=round(time.monotonic() - t0, 3), **figures)
                    results[stage.name] = result
                    outputs[stage.name] = encoded
                    ran.append(stage.name)
                    if stage.name == self.plan_stage:
                        plan = result
                        bind(plan_id=plan.plan_id)
                        await self.store.set_run_plan(run_id, plan.plan_id)
                        if resumed and previous_plan_id and previous_plan_id != plan.plan_id:
                            downstream = [s.name for s in self.stages[index + 1:]]
                            await self.store.reset_stages(run_id, downstream)
                            log.info("plan.changed", previous_plan_id=previous_plan_id,
                                     invalidated=downstream)
            finally:
                unbind("stage")
                # Close entered contexts (llama-server) even when cancelled by a signal.
                with anyio.CancelScope(shield=True) as shield:
                    shield.deadline = anyio.current_time() + CLEANUP_TIMEOUT_S
                    await stack.aclose()
        return PipelineOutcome(run_id=run_id, resumed=resumed, plan=plan,
                               results=MappingProxyType(results), outputs=MappingProxyType(outputs),
                               skipped=tuple(skipped), ran=tuple(ran))

    async def _record_failure(self, run_id: str, stage: Stage, exc: BaseException, duration_s: float) -> None:
        if isinstance(exc, HotfitError):
            error, status = exc.to_json(), "failed"
        elif isinstance(exc, (anyio.get_cancelled_exc_class(), KeyboardInterrupt)):
            error, status = {"code": "interrupted", "message": "stage was interrupted"}, "interrupted"
        else:
            error, status = {"code": "internal", "message": repr(exc)}, "failed"
        with anyio.CancelScope(shield=True):
            await self.store.stage_failed(run_id, stage.name, error, status)  # type: ignore[arg-type]
        event = "stage.interrupted" if status == "interrupted" else "stage.fail"
        log.error(event, duration_s=round(duration_s, 3), error=error)

    async def _reusable(self, stage: Stage, digest: str) -> tuple[str, StageRecord] | None:
        if stage.always_run or stage.name in self.force:
            return None
        record = await self.store.find_done(stage.name, digest)
        if record is None or record.outputs is None:
            return None
        if stage.still_valid is not None and not await anyio.to_thread.run_sync(stage.still_valid, record.outputs):
            log.info("stage.stale", reason="recorded outputs no longer on disk", from_run=record.run_id)
            return None
        return digest, record

    async def _session_reusable(self, group: list[Stage], ctx: StageContext,
                                outputs: Mapping[str, Any]) -> dict[str, tuple[str, StageRecord]]:
        """All of a session's stages reusable (chained through their recorded outputs), or none."""
        tentative = dict(outputs)
        found: dict[str, tuple[str, StageRecord]] = {}
        for stage in group:
            hit = await self._reusable(stage, inputs_hash(stage, ctx, tentative))
            if hit is None:
                return {}
            found[stage.name] = hit
            tentative[stage.name] = hit[1].outputs
        return found

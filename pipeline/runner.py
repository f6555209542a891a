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
  :class:`~core.errors.Interrupted` is raised (exit 130). ``kill -9`` leaves a ``running``
  record that the next run, holding the lock, turns into ``interrupted`` and resumes;
* events: ``run.start``, ``stage.start``, ``stage.skip``, ``stage.done``, ``stage.fail``,
  ``run.done`` — each bound with ``run_id``, ``stage`` and ``plan_id``.
"""

from __future__ import annotations

import functools
import hashlib
import signal
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, AsyncContextManager, Awaitable, Callable, Mapping, Sequence, TypeVar

import anyio

from core.errors import HotfitError, Interrupted
from core.log import bind, get_logger, unbind
from core.plan import canonical_json
from download import check_disk
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
    plan: Any | None  # core.plan.Plan once the plan stage has run
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
    # What downstream stages hash of this stage's outputs (default: all of them). Lets volatile
    # facts (bytes transferred this run, a server's port) stay out of the inputs downstream.
    fingerprint: Callable[[Mapping[str, Any]], Any] | None = None


@dataclass(frozen=True)
class PipelineOutcome:
    run_id: str
    resumed: bool
    plan: Any | None
    results: Mapping[str, Any]
    outputs: Mapping[str, dict[str, Any] | None]
    skipped: tuple[str, ...]
    ran: tuple[str, ...]


def inputs_hash(stage: Stage, ctx: StageContext, fingerprints: Mapping[str, Any]) -> str:
    """sha256 of what ``stage`` depends on: its own inputs (default: the plan id) and the
    fingerprints of the upstream stages it names."""
    own = stage.inputs(ctx) if stage.inputs else {"plan_id": ctx.plan.plan_id if ctx.plan else None}
    doc = {"stage": stage.name, "inputs": own, "upstream": {d: fingerprints.get(d) for d in stage.deps}}
    return hashlib.sha256(canonical_json(doc).encode()).hexdigest()


def _fingerprint(stage: Stage, outputs: Mapping[str, Any] | None) -> Any:
    if outputs is None or stage.fingerprint is None:
        return outputs
    return stage.fingerprint(outputs)


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
        except BaseException as exc:
            if isinstance(exc, HotfitError) and self.signal_received is None:
                await self._finish(run_id, "failed", exc.to_json(), started)
                raise
            if self.signal_received is not None:  # whatever the stage raised on its way out
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
        fingerprints: dict[str, Any] = {}
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
                            [s for s in self.stages[index:] if s.session == stage.session], ctx, fingerprints)
                    reuse: tuple[str, StageRecord] | None
                    if stage.session:
                        reuse = session_skip[stage.session].get(stage.name)
                        digest = reuse[0] if reuse else inputs_hash(stage, ctx, fingerprints)
                    else:
                        digest = inputs_hash(stage, ctx, fingerprints)
                        reuse = await self._reusable(stage, digest)
                    plan_id = plan.plan_id if plan is not None else None
                    if reuse is not None:
                        _digest, record = reuse
                        assert record.outputs is not None
                        results[stage.name] = stage.decode(record.outputs) if stage.decode else \
                            MappingProxyType(record.outputs)
                        outputs[stage.name] = record.outputs
                        fingerprints[stage.name] = _fingerprint(stage, record.outputs)
                        await self.store.stage_skipped(run_id, stage.name, digest, plan_id, record.outputs,
                                                       f"inputs unchanged since run {record.run_id}")
                        log.info("stage.skip", reason="inputs_unchanged", from_run=record.run_id,
                                 inputs_hash=digest[:16])
                        skipped.append(stage.name)
                        continue
                    await self.store.stage_running(run_id, stage.name, digest, plan_id)
                    log.info("stage.start", inputs_hash=digest[:16])
                    t0 = time.monotonic()
                    try:
                        result = await stage.fn(ctx)
                    except BaseException as exc:
                        await self._record_failure(run_id, stage, exc, time.monotonic() - t0)
                        raise
                    encoded = stage.encode(result)
                    if stage.name == self.plan_stage:
                        plan = result
                        bind(plan_id=plan.plan_id)  # from here on every event names the plan
                    await self.store.stage_done(run_id, stage.name, encoded)
                    figures = stage.figures(result) if stage.figures else {}
                    log.info("stage.done", duration_s=round(time.monotonic() - t0, 3), **figures)
                    results[stage.name] = result
                    outputs[stage.name] = encoded
                    fingerprints[stage.name] = _fingerprint(stage, encoded)
                    ran.append(stage.name)
                    if stage.name == self.plan_stage:
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
        if self.signal_received is not None or isinstance(exc, (anyio.get_cancelled_exc_class(), KeyboardInterrupt)):
            error, status = {"code": "interrupted", "message": "stage was interrupted"}, "interrupted"
        elif isinstance(exc, HotfitError):
            error, status = exc.to_json(), "failed"
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
                                fingerprints: Mapping[str, Any]) -> dict[str, tuple[str, StageRecord]]:
        """All of a session's stages reusable (chained through their recorded outputs), or none."""
        tentative = dict(fingerprints)
        found: dict[str, tuple[str, StageRecord]] = {}
        for stage in group:
            hit = await self._reusable(stage, inputs_hash(stage, ctx, tentative))
            if hit is None:
                return {}
            found[stage.name] = hit
            tentative[stage.name] = _fingerprint(stage, hit[1].outputs)
        return found


# ============================================================================ the hotfit stages
#
# probe → plan → fetch-weights → fetch-template → verify → load → probe-tool-call → re-check.
# Each adapter below is thin: it pulls what the stage module needs out of the context and calls
# it. The stage modules own the work; the runner owns state, skip and cleanup.

STAGE_NAMES: tuple[str, ...] = (
    "probe", "plan", "fetch-weights", "fetch-template", "verify", "load", "probe-tool-call", "re-check",
)
SESSION_STAGES: tuple[str, ...] = ("load", "probe-tool-call", "re-check")
SERVER_SESSION = "llama-server"


def _pins(ctx: StageContext) -> dict[str, Any]:
    """What the downloaded bytes depend on: the pinned artifacts, not the window or budget."""
    import dataclasses as _dc

    entry = ctx.plan.entry
    return {
        "entry": entry.name,
        "artifact": _dc.asdict(entry.artifact) if entry.artifact else None,
        "projector": _dc.asdict(entry.projector) if entry.projector else None,
        "models_dir": str(ctx.settings.models_dir),
    }


def _template_pin(ctx: StageContext) -> dict[str, Any]:
    import dataclasses as _dc

    entry = ctx.plan.entry
    return {"entry": entry.name, "chat_template": _dc.asdict(entry.chat_template) if entry.chat_template else None,
            "models_dir": str(ctx.settings.models_dir)}


def _verify_inputs(ctx: StageContext) -> dict[str, Any]:
    import dataclasses as _dc

    entry = ctx.plan.entry
    # verify cross-checks the GGUF header against the entry's architecture facts too
    return {**_pins(ctx), "architecture": entry.architecture, "config": _dc.asdict(entry.config),
            "context_limit": entry.context_limit}


def _files_still_there(outputs: Mapping[str, Any]) -> bool:
    """A recorded download/verify is reusable only while its files are on disk at their size."""
    for path, size in _recorded_files(outputs):
        p = Path(path)
        if not p.is_file() or (size is not None and p.stat().st_size != size):
            return False
    return True


def _recorded_files(outputs: Any) -> list[tuple[str, int | None]]:
    """(path, size) pairs anywhere in a stage's outputs: ``{"path": ..., "size_bytes": ...}``
    objects and ``*_path`` keys (size unknown)."""
    found: list[tuple[str, int | None]] = []
    if isinstance(outputs, Mapping):
        if isinstance(outputs.get("path"), str):
            size = outputs.get("size_bytes")
            found.append((outputs["path"], size if isinstance(size, int) else None))
        for key, value in outputs.items():
            if key.endswith("_path") and isinstance(value, str) and key not in ("log_path", "stderr_path"):
                found.append((value, None))
            elif isinstance(value, (Mapping, list, tuple)):
                found.extend(_recorded_files(value))
    elif isinstance(outputs, (list, tuple)):
        for item in outputs:
            found.extend(_recorded_files(item))
    return found


def _opts(ctx: StageContext) -> Any:
    return ctx.options["auto"]


def compute_plan(opts: Any, settings: Any, probe: Any, previous: Any) -> Any:
    """Selection for ``probe`` (stages.plan). Returns the ``PlanOutcome``; raises the fail-closed
    :class:`NoModelQualifies` (logged as ``plan.rejected``) when nothing qualifies."""
    from core.errors import NoModelQualifies
    from registry.catalog import load_registry
    from stages.plan import build_plan, resolve_kv_cache_type

    registry = load_registry(opts.registry_file)
    cache_type, source = resolve_kv_cache_type(opts.kv_cache_type_flag, settings.kv_cache_type_raw)
    try:
        outcome = build_plan(probe, registry.entries, cache_type, source, origin=opts.origin,
                             backend=opts.backend, previous=previous, model=opts.model,
                             device=getattr(opts, "device", None))
        if outcome.plan is None:
            outcome.selection.raise_if_refused()
    except NoModelQualifies as exc:
        log.error("plan.rejected", kv_cache_type=cache_type.name, origin=opts.origin or "auto",
                  backend=opts.backend, model=opts.model, error=exc.to_json())
        raise
    return outcome


async def _probe_stage(ctx: StageContext) -> Any:
    from stages.probe import load_probe_file, probe_devices

    path = _opts(ctx).probe_file
    if path is not None:
        return await anyio.to_thread.run_sync(load_probe_file, path)
    from backends.llama_server import gpu_listing_binaries

    binaries = gpu_listing_binaries(ctx.settings)
    return await anyio.to_thread.run_sync(functools.partial(probe_devices, ggml_binaries=binaries))


def _probe_figures(probe: Any) -> dict[str, Any]:
    d = probe.device
    return {"device_kind": d.kind, "device_name": d.name, "total_bytes": d.total_bytes, "free_bytes": d.free_bytes}


async def _plan_stage(ctx: StageContext) -> Any:
    outcome = compute_plan(_opts(ctx), ctx.settings, ctx.results["probe"], ctx.options.get("previous"))
    plan = outcome.plan
    if plan.backend == "llama":
        # The binary that will serve this plan must exist, answer --version, suit this CPU and
        # the plan's device before a single weight byte is fetched (issue 9 item 4).
        from backends.llama_server import find_llama_server

        await anyio.to_thread.run_sync(
            functools.partial(find_llama_server, ctx.settings, device_kind=plan.probe.device.kind))
    elif plan.backend == "openvino":
        # The OpenVINO equivalent: the extra importable, a device and a KV precision the session
        # takes — each refused here with its fix rather than after the download.
        from stages.openvino_session import openvino_device, openvino_kv_precision, require_openvino

        require_openvino()
        openvino_device(plan)
        openvino_kv_precision(plan.kv_cache_type)
    return plan


def _plan_figures(plan: Any) -> dict[str, Any]:
    return {"model": plan.entry.name, "hot_context_tokens": plan.hot_context_tokens,
            "kv_cache_type": plan.kv_cache_type, "kv_cache_type_source": plan.kv_cache_type_source,
            "estimated_kv_bytes": plan.estimated_kv_bytes, "usable_bytes": plan.budget.usable_bytes,
            "reused_previous": plan.reused_previous, "explicit_model": plan.explicit_model}


def _model_lock(ctx: StageContext) -> Any:
    from state.locks import FileLock

    dest = ctx.settings.model_dir(ctx.plan.entry.name)
    # the lock `hotfit pull` takes, so a pull of the same entry never writes beside us
    return FileLock(dest / ".partial" / "pull.lock", wait=_opts(ctx).wait,
                    what=f"model directory {dest}").async_held()


async def _fetch_weights_stage(ctx: StageContext) -> Any:
    from stages.fetch_weights import fetch_weights

    entry = ctx.plan.entry
    dest = ctx.settings.model_dir(entry.name)
    await anyio.to_thread.run_sync(check_disk, entry, dest)
    async with _model_lock(ctx):
        return await fetch_weights(entry, dest, settings=ctx.settings, wait=_opts(ctx).wait)


def _file_fp(f: Mapping[str, Any] | None) -> Any:
    return None if f is None else {k: f.get(k) for k in ("path", "size_bytes", "sha256")}


def _fetch_fingerprint(out: Mapping[str, Any]) -> Any:
    snap = out.get("snapshot")
    return {"weights": _file_fp(out.get("weights")), "projector": _file_fp(out.get("projector")),
            "snapshot": None if snap is None else {k: snap.get(k) for k in ("commit", "directory", "size_bytes")}}


def _fetch_figures(result: Any) -> dict[str, Any]:
    w = result.weights
    if w is None:
        return {"vision": result.vision}
    return {"file": w.file, "size_bytes": w.size_bytes, "bytes_transferred": w.bytes_transferred,
            "resumed_from_bytes": w.resumed_from_bytes, "already_present": w.already_present,
            "sha256": w.sha256, "vision": result.vision}


def _weights_path(ctx: StageContext) -> Path | None:
    entry = ctx.plan.entry
    if entry.artifact is None or entry.artifact.file is None:
        return None
    return ctx.settings.model_dir(entry.name) / entry.artifact.file


async def _fetch_template_stage(ctx: StageContext) -> Any:
    from stages.fetch_template import fetch_template

    entry = ctx.plan.entry
    async with _model_lock(ctx):
        return await fetch_template(entry, ctx.settings.model_dir(entry.name), settings=ctx.settings,
                                    weights_path=_weights_path(ctx), wait=_opts(ctx).wait)


def _template_fingerprint(out: Mapping[str, Any]) -> Any:
    return {k: out.get(k) for k in ("path", "sha256", "source")}


def _template_still_there(out: Mapping[str, Any]) -> bool:
    """The template is a few KiB: hash it, so text edited behind our back is fetched again
    instead of being trusted by verify and load through a skipped record."""
    path = out.get("path")
    if path is None:
        return True
    try:
        data = Path(path).read_bytes()
    except OSError:
        return False
    return hashlib.sha256(data).hexdigest() == out.get("sha256")


async def _verify_stage(ctx: StageContext) -> Any:
    from stages.verify import verify

    entry = ctx.plan.entry
    async with _model_lock(ctx):
        return await verify(entry, ctx.settings.model_dir(entry.name))


def _verify_fingerprint(out: Mapping[str, Any]) -> Any:
    return {k: out.get(k) for k in ("weights_path", "size_bytes", "sha256", "chat_template_path")}


def _verify_still_there(out: Mapping[str, Any]) -> bool:
    path = out.get("weights_path")
    if path is None:
        return False
    p = Path(path)
    if p.is_dir():
        return True
    return p.is_file() and p.stat().st_size == out.get("size_bytes")


@dataclass(frozen=True)
class LoadResult:
    """The live llama-server (valid until the pipeline ends) and the binary it runs."""

    server: Any  # stages.load.LoadedServer
    backend: Any  # backends.llama_server.Backend

    def to_json(self) -> dict[str, Any]:
        return {**self.server.to_json(), "backend": self.backend.to_json()}


@dataclass(frozen=True)
class OpenVinoLoadResult:
    """The live OpenVINO session (valid until the pipeline ends): its worker, settings, GenAI version."""

    session: Any  # stages.openvino_session.OpenVinoSession

    def to_json(self) -> dict[str, Any]:
        return {**self.session.to_json(), "backend": {"name": "openvino",
                                                      "genai_version": self.session.opened.get("genai_version")}}


async def _load_stage(ctx: StageContext) -> LoadResult | OpenVinoLoadResult:
    from backends.llama_server import find_llama_server
    from stages.load import open_server

    plan = ctx.plan
    if plan.backend == "openvino":
        from stages.openvino_session import open_openvino_session

        verified = ctx.results["verify"]
        snapshot = verified["weights_path"] if isinstance(verified, Mapping) else verified.weights_path
        session = await ctx.enter_context(open_openvino_session(plan, Path(snapshot), ctx.run_dir))
        return OpenVinoLoadResult(session)
    backend = await anyio.to_thread.run_sync(
        functools.partial(find_llama_server, ctx.settings, device_kind=plan.probe.device.kind))
    verified = ctx.results["verify"]
    weights = verified["weights_path"] if isinstance(verified, Mapping) else verified.weights_path
    template_path = verified["chat_template_path"] if isinstance(verified, Mapping) else verified.chat_template_path
    server = await ctx.enter_context(open_server(
        plan, Path(weights), binary=backend.server_path, run_dir=ctx.run_dir,
        template_path=Path(template_path) if template_path else None, build=backend.build))
    return LoadResult(server=server, backend=backend)


def _load_fingerprint(out: Mapping[str, Any]) -> Any:
    # the port, pid and timing change every start; the command line without the port does not
    if "config" in out:  # OpenVINO: every pipeline setting; the pid and timing are volatile
        return {"config": out.get("config")}
    argv = list(out.get("argv") or [])
    if "--port" in argv:
        i = argv.index("--port")
        del argv[i:i + 2]
    return {"argv": argv, "template": out.get("template")}


def _load_figures(result: LoadResult | OpenVinoLoadResult) -> dict[str, Any]:
    if isinstance(result, OpenVinoLoadResult):
        ov = result.session
        return {"pid": ov.pid, "load_seconds": round(ov.load_seconds, 3), "backend": "openvino",
                "kv_precision": ov.config.kv_precision, "num_kv_blocks": ov.config.num_kv_blocks,
                "capacity_tokens": ov.config.capacity_tokens, "device": ov.config.device}
    s = result.server
    return {"pid": s.pid, "load_seconds": round(s.load_seconds, 3), "template": s.template.describe(),
            "llama_server": str(result.backend.server_path)}


async def _probe_tool_call_stage(ctx: StageContext) -> Any:
    from stages.probe_tool_call import probe_tool_call

    load = ctx.results["load"]
    if isinstance(load, OpenVinoLoadResult):
        from stages.openvino_probe import probe_openvino_tool_call

        return await probe_openvino_tool_call(load.session)
    return await probe_tool_call(load.server)


def _probe_call_figures(result: Any) -> dict[str, Any]:
    # llama-server's ProbeResult and OpenVinoProbeResult share the verdict and the generation speed
    return {"passed": result.verdict.passed, "reason": result.verdict.reason, "tool": result.verdict.tool_name,
            "prompt_tokens_per_s": getattr(result, "prompt_tokens_per_s", None),
            "generation_tokens_per_s": result.generation_tokens_per_s}


def _probe_call_fingerprint(out: Mapping[str, Any]) -> Any:
    verdict = out.get("verdict") or {}
    return {"passed": verdict.get("passed"), "template": out.get("template")}


async def _recheck_stage(ctx: StageContext) -> Any:
    from stages.recheck import recheck_allocation

    load = ctx.results["load"]
    if isinstance(load, OpenVinoLoadResult):
        from stages.openvino_recheck import recheck_openvino_allocation

        report: Any = await recheck_openvino_allocation(load.session)
    else:
        report = await recheck_allocation(load.server, ctx.plan)
    opened = opened_context_tokens(report.to_json())
    # contenox `auto`: an opened session holding less than half the estimate is worth a warning
    if opened is not None and opened * 2 < ctx.plan.hot_context_tokens:
        log.warning("recheck.below_half_estimate", opened_context_tokens=opened,
                    planned_hot_context_tokens=ctx.plan.hot_context_tokens)
    return report


def opened_context_tokens(recheck: Mapping[str, Any]) -> int | None:
    """The window the re-check verified, from either backend's report: llama-server's smallest slot,
    or what OpenVINO's allocated bytes hold."""
    if "opened_n_ctx_per_slot" in recheck:
        slots = recheck.get("opened_n_ctx_per_slot") or []
        return min(slots) if slots else None
    value = recheck.get("opened_context_tokens")
    return int(value) if value is not None else None


def _recheck_figures(report: Any) -> dict[str, Any]:
    data = report.to_json()  # llama-server: the window per slot; OpenVINO: the one window its bytes hold
    opened = list(data["opened_n_ctx_per_slot"]) if "opened_n_ctx_per_slot" in data else data.get("opened_context_tokens")
    return {"verdict": report.verdict, "opened_context_tokens": opened,
            "planned_hot_context_tokens": report.planned_hot_context_tokens,
            "estimated_kv_bytes": report.estimated_kv_bytes, "actual_kv_bytes": report.actual_kv_bytes,
            "ratio": round(report.ratio, 6) if report.ratio is not None else None}


def hotfit_stages() -> list[Stage]:
    """The pipeline of ``hotfit auto``, in order (issue 6)."""
    return [
        Stage("probe", _probe_stage, always_run=True, figures=_probe_figures),
        Stage("plan", _plan_stage, deps=("probe",), always_run=True, figures=_plan_figures),
        Stage("fetch-weights", _fetch_weights_stage, inputs=_pins, still_valid=_files_still_there,
              fingerprint=_fetch_fingerprint, figures=_fetch_figures),
        Stage("fetch-template", _fetch_template_stage, deps=("fetch-weights",), inputs=_template_pin,
              still_valid=_template_still_there, fingerprint=_template_fingerprint),
        Stage("verify", _verify_stage, deps=("fetch-weights", "fetch-template"), inputs=_verify_inputs,
              still_valid=_verify_still_there, fingerprint=_verify_fingerprint),
        Stage("load", _load_stage, deps=("verify",), session=SERVER_SESSION, fingerprint=_load_fingerprint,
              figures=_load_figures),
        Stage("probe-tool-call", _probe_tool_call_stage, deps=("load",), session=SERVER_SESSION,
              fingerprint=_probe_call_fingerprint, figures=_probe_call_figures),
        Stage("re-check", _recheck_stage, deps=("load", "probe-tool-call"), session=SERVER_SESSION,
              figures=_recheck_figures),
    ]

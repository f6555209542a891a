"""load: open the planned model exactly as planned, through the Backend boundary.

The stage picks the backend from the plan (:func:`backends.select.backend_for`) and opens the
verified files with it; everything server-specific — argv, environment and device pin, process
lifetime, health, diagnosis of a failed start — is behind :class:`backends.base.Backend`
(llama-server: :mod:`backends.llama_server`; OpenVINO: :mod:`backends.openvino`). The binary the
plan-stage preflight resolved rides in, so it is found once per run.

The session is always stopped and reaped on leaving the context (success, error, cancellation,
Ctrl-C). Nothing is deleted on a failed load: the verified weights stay in place and a rerun
resumes at load.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hotfit.backends.base import BackendBinary, ModelFiles, Session
from hotfit.backends.select import BACKENDS, backend_for
from hotfit.core.errors import IntegrityError, StageRecordError
from hotfit.core.model_files import VerifyResult
from hotfit.core.records import stage_record_fail
from hotfit.planner.plan import Plan
from hotfit.core.settings import Settings
from hotfit.stages.declaration import StageContext, StageDeclaration
from hotfit.stages.plan import PlannedRun

__all__ = ["DECLARATION", "SERVER_SESSION", "LoadJob", "LoadResult", "OpenTarget", "decode_load", "model_files",
           "open_session", "preflight"]

# The engine skips or runs the stages on one opened session (load, probe-tool-call, re-check, grade) together.
SERVER_SESSION = "llama-server"


@dataclass(frozen=True)
class LoadResult:
    """What the load record keeps (the session's ``to_json()`` and the binary's, as the backend wrote
    them: opaque here, checked and read by the backend) and, in the run that opened it, the live
    session. A load reused from ``state.db`` is the same type without the live parts; the engine
    reuses the session's stages as one, so nothing asks a reused load for them. ``backend``: the
    name of the backend that wrote the record (the plan's), which reads it."""

    record: Mapping[str, Any]
    backend: str
    session: Session | None = field(default=None, compare=False, repr=False)
    binary: BackendBinary | None = field(default=None, compare=False, repr=False)

    @classmethod
    def opened(cls, session: Session, binary: BackendBinary | None) -> LoadResult:
        backend = binary.to_json() if binary is not None else {"name": session.backend}
        return cls({**session.to_json(), "backend": backend}, session.backend, session, binary)

    def live(self) -> Session:
        if self.session is None:  # a wiring bug, not an operator's problem
            raise RuntimeError("load was reused from a record: no live session in this run")
        return self.session

    def to_json(self) -> dict[str, Any]:
        return dict(self.record)


def preflight(plan: Plan, settings: Settings) -> BackendBinary:
    """Refuse, before any weight byte is fetched, a plan this machine's backend cannot serve
    (blocking: run it in a thread). The result is handed to :func:`open_session`."""
    return backend_for(plan.backend).preflight(plan, settings)


def model_files(verified: VerifyResult) -> ModelFiles:
    """The verified files as the backend opens them. Whether the GGUF embeds a chat template is
    what verify read from the header (once per run, bounded reader): load never opens the GGUF
    itself — ``gguf.GGUFReader`` maps every tensor, seconds and hundreds of MiB a CPU plan never
    budgeted for."""
    if verified.weights_path is None:
        raise IntegrityError(f"verify of {verified.entry} handed no weights path",
                             hint="rerun `hotfit auto`; verify puts the checked files in place")
    template = Path(verified.chat_template_path) if verified.chat_template_path else None
    return ModelFiles(Path(verified.weights_path), template, verified.gguf_embeds_chat_template)


def open_session(plan: Plan, files: ModelFiles, *, run_dir: Path, settings: Settings,
                 binary: BackendBinary | None = None) -> AbstractAsyncContextManager[Session]:
    """Open ``files`` for ``plan`` with its backend; ``binary``: the preflight's result (None:
    resolve it now)."""
    return backend_for(plan.backend).open(plan, files, run_dir=run_dir, binary=binary, settings=settings)


# --------------------------------------------------------------------------- the stage


def decode_load(record: Mapping[str, Any]) -> LoadResult:
    """A load record back, without its plan: as the first backend that accepts it (each is asked,
    as :func:`stages.recheck.decode_recheck` does); StageRecordError names a damaged field. The
    engine decodes with the plan (:func:`decode_load_for_plan`)."""
    errors: list[StageRecordError] = []
    for name, backend in BACKENDS.items():
        try:
            backend.decode_load(record)
        except StageRecordError as exc:
            errors.append(exc)
            continue
        return LoadResult(dict(record), name)
    raise next((e for e in errors if e.details.get("field")), errors[0])


def decode_load_as(record: Mapping[str, Any], backend: str) -> LoadResult:
    """The load record checked by ``backend`` (its name), with the binary it ran decoded by it."""
    found = backend_for(backend)
    if not isinstance(record, Mapping):
        raise stage_record_fail("(document)", f"must be an object, got {type(record).__name__}", "")
    found.decode_load(record)
    return LoadResult(dict(record), backend, binary=found.decode_binary(record["backend"], path="backend"))


def decode_load_for_plan(record: Mapping[str, Any], plan: Plan) -> LoadResult:
    """:func:`decode_load_as` the plan's backend (the engine's decoder of a reused load)."""
    return decode_load_as(record, plan.backend)


@dataclass(frozen=True)
class OpenTarget:
    """What load opens: the verified files, the binary a preflight found (None: resolve it now) and
    the directory the session writes its log to."""

    files: ModelFiles
    binary: BackendBinary | None
    run_dir: Path


@dataclass(frozen=True)
class LoadJob:
    """Where load finds its :class:`OpenTarget`. ``target_stage`` None (``hotfit auto``): the verify
    stage's files, the plan stage's preflight and the run's directory; else the result of that stage
    (``hotfit grade``'s target, pipeline/grade.py), which is an OpenTarget."""

    target_stage: str | None = None


def _target(ctx: StageContext) -> OpenTarget:
    stage = ctx.job(LoadJob).target_stage
    if stage is not None:
        return ctx.result(stage, OpenTarget)
    return OpenTarget(model_files(ctx.result("verify", VerifyResult)), ctx.result("plan", PlannedRun).backend,
                      ctx.run_dir)


async def load_work(ctx: StageContext) -> LoadResult:
    plan = ctx.require_plan()
    target = _target(ctx)
    session = await ctx.enter_context(open_session(plan, target.files, run_dir=target.run_dir,
                                                   settings=ctx.settings, binary=target.binary))
    return LoadResult.opened(session, target.binary)


def load_fingerprint(loaded: LoadResult) -> Any:
    """What the backend hashes of its record (how the session was started, not its port or pid)."""
    return backend_for(loaded.backend).load_fingerprint(loaded.record)


def load_figures(loaded: LoadResult) -> dict[str, Any]:
    return loaded.live().load_figures()


DECLARATION = StageDeclaration(
    "load", load_work, deps=("verify",), session=SERVER_SESSION, decode=decode_load,
    decode_for_plan=decode_load_for_plan, fingerprint=load_fingerprint, figures=load_figures, version=1,
    result_type=LoadResult, job=LoadJob())

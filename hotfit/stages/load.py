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
from hotfit.backends.select import backend_for
from hotfit.core.errors import IntegrityError
from hotfit.core.model_files import VerifyResult
from hotfit.planner.plan import Plan
from hotfit.core.records import decode_record
from hotfit.core.settings import Settings
from hotfit.stages.declaration import StageContext, StageDeclaration
from hotfit.stages.plan import PlannedRun

__all__ = ["DECLARATION", "SERVER_SESSION", "LoadResult", "decode_load", "model_files", "open_session", "preflight"]

# The engine skips or runs the stages on one opened session (load, probe-tool-call, re-check, grade) together.
SERVER_SESSION = "llama-server"


@dataclass(frozen=True)
class LoadResult:
    """What the load record keeps (the session's ``to_json()`` and the binary's) and, in the run that
    opened it, the live session. A load reused from ``state.db`` is the same type without the live
    parts; the engine reuses the session's stages as one, so nothing asks a reused load for them."""

    record: Mapping[str, Any]
    session: Session | None = field(default=None, compare=False, repr=False)
    binary: BackendBinary | None = field(default=None, compare=False, repr=False)

    @classmethod
    def opened(cls, session: Session, binary: BackendBinary | None) -> LoadResult:
        backend = binary.to_json() if binary is not None else {"name": session.backend}
        return cls({**session.to_json(), "backend": backend}, session, binary)

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


@dataclass(frozen=True)
class _TemplateShape:
    kind: str  # backends.llama_server.process.TemplateKind
    path: str | None


@dataclass(frozen=True)
class _LlamaLoadShape:
    """What a llama-server load record must hold (the manifest, the fingerprint and serve read it)."""

    pid: int
    base_url: str
    argv: tuple[str, ...]
    log_path: str
    stderr_path: str
    template: _TemplateShape
    load_seconds: float
    backend: dict[str, Any]  # the binary's to_json()


@dataclass(frozen=True)
class _OpenVinoLoadShape:
    """What an OpenVINO load record must hold; the rest is what the worker reported on opening."""

    pid: int
    config: dict[str, Any]
    backend: dict[str, Any]


def decode_load(record: Mapping[str, Any]) -> LoadResult:
    """The load record back (its shape checked; StageRecordError names a damaged field)."""
    if "config" in record:  # OpenVINO: every pipeline setting
        decode_record(_OpenVinoLoadShape, {k: record.get(k) for k in ("pid", "config", "backend")})
    else:
        decode_record(_LlamaLoadShape, record)
    return LoadResult(dict(record))


def decode_load_for_plan(record: Mapping[str, Any], plan: Plan) -> LoadResult:
    """:func:`decode_load`, with the binary it ran decoded by the plan's backend."""
    loaded = decode_load(record)
    binary = backend_for(plan.backend).decode_binary(record["backend"], path="backend")
    return LoadResult(loaded.record, binary=binary)


async def load_work(ctx: StageContext) -> LoadResult:
    plan = ctx.require_plan()
    files = model_files(ctx.result("verify", VerifyResult))
    binary = ctx.result("plan", PlannedRun).backend  # the plan stage's preflight (None: resolve it now)
    session = await ctx.enter_context(open_session(plan, files, run_dir=ctx.run_dir, settings=ctx.settings,
                                                   binary=binary))
    return LoadResult.opened(session, binary)


def load_fingerprint(loaded: LoadResult) -> Any:
    # the port, pid and timing change every start; the command line without the port does not
    out = loaded.record
    if "config" in out:  # OpenVINO: every pipeline setting; the pid and timing are volatile
        return {"config": out.get("config")}
    argv = list(out.get("argv") or [])
    if "--port" in argv:
        i = argv.index("--port")
        del argv[i:i + 2]
    return {"argv": argv, "template": out.get("template")}


def load_figures(loaded: LoadResult) -> dict[str, Any]:
    return loaded.live().load_figures()


DECLARATION = StageDeclaration(
    "load", load_work, deps=("verify",), session=SERVER_SESSION, decode=decode_load,
    decode_for_plan=decode_load_for_plan, fingerprint=load_fingerprint, figures=load_figures, version=1,
    result_type=LoadResult)

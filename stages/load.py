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

from backends.base import BackendBinary, ModelFiles, Session
from backends.select import backend_for
from core.errors import IntegrityError
from core.model_files import VerifyResult
from core.plan import Plan
from core.settings import Settings

__all__ = ["LoadResult", "model_files", "open_session", "preflight"]


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

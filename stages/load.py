"""load: open the planned model exactly as planned, through the Backend boundary (issue 5 item 1).

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

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from backends.base import BackendBinary, ModelFiles, Session
from backends.select import backend_for
from core.errors import IntegrityError
from core.plan import Plan
from core.settings import Settings
from stages.verify import read_gguf_header

__all__ = ["LoadResult", "model_files", "open_session", "preflight"]


@dataclass(frozen=True)
class LoadResult:
    """The live session (valid until the pipeline ends) and the binary or runtime it runs."""

    session: Session
    binary: BackendBinary | None

    def to_json(self) -> dict[str, Any]:
        backend = self.binary.to_json() if self.binary is not None else {"name": self.session.backend}
        return {**self.session.to_json(), "backend": backend}


def preflight(plan: Plan, settings: Settings) -> BackendBinary:
    """Refuse, before any weight byte is fetched, a plan this machine's backend cannot serve
    (blocking: run it in a thread). The result is handed to :func:`open_session`."""
    return backend_for(plan.backend).preflight(plan, settings)


def _gguf_has_chat_template(model_path: Path) -> bool | None:
    """Does the GGUF embed ``tokenizer.chat_template``? None when the header cannot be read.

    The bounded header reader, not ``gguf.GGUFReader``: that one maps and parses every tensor,
    7–33 s and hundreds of MiB for the real test models (0.4–0.8 s here), memory a CPU plan
    never budgeted for."""
    try:
        return read_gguf_header(model_path).has_chat_template
    except (IntegrityError, OSError):  # a broken file is load's business to report, not this helper's
        return None


async def model_files(plan: Plan, weights: Path, template: Path | None) -> ModelFiles:
    """The verified files as the backend opens them (a GGUF's embedded-template fact read here)."""
    embedded = None
    if plan.backend == "llama" and weights.is_file():
        embedded = await anyio.to_thread.run_sync(_gguf_has_chat_template, weights)
    return ModelFiles(weights, template, embedded)


def open_session(plan: Plan, files: ModelFiles, *, run_dir: Path, settings: Settings,
                 binary: BackendBinary | None = None) -> AbstractAsyncContextManager[Session]:
    """Open ``files`` for ``plan`` with its backend; ``binary``: the preflight's result (None:
    resolve it now)."""
    return backend_for(plan.backend).open(plan, files, run_dir=run_dir, binary=binary, settings=settings)

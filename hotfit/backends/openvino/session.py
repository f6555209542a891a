"""OpenVINO process lifetime: open a verified IR snapshot exactly as planned.

The pipeline lives in a child process (:mod:`backends.openvino.worker`, which says why) started in
its own session, killed at a deadline, and always reaped on leaving :func:`open_openvino_session`:
success, error, cancellation or signal. Its log (GenAI's and OpenVINO's own output) is a file in
the run directory. :class:`OpenVinoSession` is OpenVINO's :class:`backends.base.Session`; its
chat call (render with the model's template, forced generation, the family's parser) is
:mod:`backends.openvino.chat`, its allocation report :mod:`backends.openvino.allocation`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, Literal

import anyio

from hotfit.backends.base import AllocationReport
from hotfit.backends.openvino import allocation, chat
from hotfit.backends.openvino.config import (
    CLOSE_GRACE_S,
    OPEN_TIMEOUT_S,
    SESSION_FILE,
    WORKER_LOG,
    SessionConfig,
    check_ir_dir,
    diagnose_openvino_failure,
    prompt_cap_problem,
    require_openvino,
    session_config,
)
from hotfit.backends.openvino.protocol import WorkerGone, worker_request
from hotfit.core.errors import LoadError
from hotfit.core.log import get_logger
from hotfit.planner.plan import Plan
from hotfit.grading.protocol import ChatEndpoint, ChatReply

__all__ = ["OpenVinoSession", "open_openvino_session", "worker_env"]

log = get_logger()

# ---------------------------------------------------------------- effects


class OpenVinoSession:
    """An opened pipeline in its worker process (valid inside :func:`open_openvino_session`)."""

    def __init__(self, *, process: subprocess.Popen[bytes], config: SessionConfig, plan: Plan,
                 run_dir: Path, log_path: Path, opened: Mapping[str, Any]) -> None:
        self.process = process
        self.config = config
        self.plan = plan
        self.run_dir = run_dir
        self.log_path = log_path
        self.opened = dict(opened)
        self.load_seconds = float(opened.get("load_seconds", 0.0))
        self.ir_dir = Path(config.ir_dir)

    @property
    def pid(self) -> int:
        return self.process.pid

    def returncode(self) -> int | None:
        return self.process.poll()

    def describe_exit(self) -> str:
        code = self.returncode()
        if code is None:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exited with status {code}"

    def log_tail(self, limit: int = 12) -> list[str]:
        try:
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return []
        return [ln for ln in lines if ln.strip()][-limit:]

    async def request(self, op: str, timeout_s: float, **fields: Any) -> dict[str, Any]:
        """One request to the worker; a reply that does not come within ``timeout_s`` kills it."""
        return await worker_request(self.process, {"op": op, **fields}, timeout_s)

    # ------------------------------------------------------------ backends.base.Session

    backend: Literal["openvino"] = "openvino"
    server_name = "OpenVINO"

    @property
    def prompt_max_tokens(self) -> int | None:
        """The most prompt tokens the export's tokenizer passes, when fewer than the plan (worker._prompt_cap)."""
        cap = self.opened.get("prompt_max_tokens")
        return cap if isinstance(cap, int) and cap > 0 else None

    def load_figures(self) -> dict[str, Any]:
        return {"pid": self.pid, "load_seconds": round(self.load_seconds, 3), "backend": "openvino",
                "kv_precision": self.config.kv_precision, "num_kv_blocks": self.config.num_kv_blocks,
                "capacity_tokens": self.config.capacity_tokens, "device": self.config.device,
                "prompt_max_tokens": self.prompt_max_tokens}

    async def call_tools(self, request: Mapping[str, Any], *, timeout_s: float, purpose: str,
                         family: str | None = None) -> ChatReply:
        return await chat.call_tools(self, request, timeout_s=timeout_s, purpose=purpose, family=family)

    def tool_call_fix(self, cause: str, answer: ChatReply | None) -> str:
        return chat.tool_call_fix(cause, answer)

    def chat_endpoint(self) -> AbstractAsyncContextManager[ChatEndpoint]:
        return chat.SessionChatEndpoint(self)

    async def allocation_report(self, plan: Plan, *, floor_tokens: int, tolerance: float,
                                timeout_s: float) -> AllocationReport:
        return await allocation.read_allocation(self, plan, floor_tokens=floor_tokens, tolerance=tolerance,
                                                timeout_s=timeout_s)

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "config": self.config.to_json(), "load_seconds": self.load_seconds,
                "log_path": str(self.log_path), **{k: v for k, v in self.opened.items() if k != "ok"}}


def _kill_group(process: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


async def _reap(process: subprocess.Popen[bytes]) -> None:
    """Close the worker: ask, then SIGTERM the group, then SIGKILL; always waited for."""
    if process.poll() is None:
        with contextlib.suppress(Exception):
            with anyio.move_on_after(CLOSE_GRACE_S):
                await worker_request(process, {"op": "close"}, CLOSE_GRACE_S)
                while process.poll() is None:
                    await anyio.sleep(0.05)
    if process.poll() is None:
        _kill_group(process, signal.SIGTERM)
        with anyio.move_on_after(CLOSE_GRACE_S):
            while process.poll() is None:
                await anyio.sleep(0.05)
    if process.poll() is None:
        _kill_group(process, signal.SIGKILL)
    await anyio.to_thread.run_sync(process.wait)
    for stream in (process.stdin, process.stdout):
        with contextlib.suppress(OSError):
            if stream is not None:
                stream.close()


def worker_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The worker's environment: ours, with OpenVINO's property dump on (level 3 prints the compiled
    model's KV_CACHE_PRECISION and the SchedulerConfig to the log: evidence of the effective
    settings) and telemetry off."""
    env = dict(os.environ if base is None else base)
    env["OPENVINO_LOG_LEVEL"] = "3"
    env["CI"] = "true"  # opt-in telemetry of OpenVINO tooling stays off
    env["PYTHONUNBUFFERED"] = "1"
    return env


@contextlib.asynccontextmanager
async def open_openvino_session(
    plan: Plan,
    ir_dir: Path,
    run_dir: Path,
    *,
    timeout_s: float = OPEN_TIMEOUT_S,
    cache_dir: Path | None = None,
    python: str | None = None,
) -> AsyncIterator[OpenVinoSession]:
    """Open ``ir_dir`` as ``plan`` says in a worker process; reap it on leaving, whatever happens.

    Raises :class:`BackendNotFound` without openvino-genai, :class:`LoadError` (``details.cause``:
    ``missing_files``, ``vision_path``, ``damaged_ir``, ``out_of_memory``, ``timeout``, ...)."""
    require_openvino()
    config = session_config(plan, ir_dir, cache_dir=cache_dir)
    check_ir_dir(ir_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / WORKER_LOG
    (run_dir / SESSION_FILE).write_text(json.dumps(config.to_json(), indent=2) + "\n", encoding="utf-8")
    started = time.monotonic()

    def spawn() -> subprocess.Popen[bytes]:
        with open(log_path, "ab") as log_file:
            return subprocess.Popen(
                [python or sys.executable, "-m", f"{__package__}.worker", str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file,
                # the folder that holds the top-level package, so `-m` finds it from any interpreter
                cwd=str(Path(__file__).parents[len(__package__.split("."))]), env=worker_env(),
                start_new_session=True,
            )  # fmt: skip

    process = await anyio.to_thread.run_sync(spawn)
    log.info("openvino.start", pid=process.pid, ir_dir=str(ir_dir), **config.scheduler_json(),
             kv_precision=config.kv_precision, device=config.device)

    def failed(what: str, cause: str, hint: str, **details: Any) -> LoadError:
        tail = _tail(log_path)
        log.error("openvino.load_failed", cause=cause, what=what, pid=process.pid)
        return LoadError(what, hint=hint, cause=cause, ir_dir=str(ir_dir), log_path=str(log_path),
                         log_lines=tail, returncode=process.poll(), pid=process.pid, **details)

    try:
        try:
            reply = await worker_request(process, {}, timeout_s)  # the worker's "ready" line
            if reply.get("ok"):
                reply = await worker_request(process, {"op": "open", "ir_dir": str(ir_dir), "device": config.device,
                                                 "scheduler": config.scheduler_json(),
                                                 "planned_tokens": config.planned_tokens,
                                                 "properties": dict(config.properties)},
                                       max(1.0, timeout_s - (time.monotonic() - started)))
        except TimeoutError:
            raise failed(f"the OpenVINO pipeline did not open within {timeout_s:.0f} s", "timeout",
                         "the worker was killed; a cold compile of a large IR can take minutes on a slow "
                         "disk, otherwise the runtime hangs: see the worker log") from None
        except WorkerGone as exc:
            await anyio.to_thread.run_sync(process.wait)
            cause, hint = diagnose_openvino_failure(" ".join(_tail(log_path)), process.returncode)
            raise failed(f"the OpenVINO worker {_describe(process)} while opening {ir_dir} ({exc})", cause,
                         hint) from None
        if not reply.get("ok"):
            error = str(reply.get("error", ""))
            cause, hint = diagnose_openvino_failure(error, None)
            first = error.strip().splitlines()[-1] if error.strip() else reply.get("exception", "error")
            raise failed(f"OpenVINO could not open {ir_dir}: {first}", cause, hint, error=error[-2000:])
        session = OpenVinoSession(process=process, config=config, plan=plan, run_dir=run_dir,
                                  log_path=log_path, opened=reply)
        log.info("openvino.loaded", pid=process.pid, load_seconds=round(session.load_seconds, 3),
                 capacity_tokens=config.capacity_tokens)
        if session.prompt_max_tokens is not None:
            log.warning("openvino.prompt_cap", prompt_max_tokens=session.prompt_max_tokens,
                        planned_tokens=config.planned_tokens, ir_dir=str(ir_dir),
                        problem=prompt_cap_problem(session.prompt_max_tokens, config.planned_tokens))
        yield session
    finally:
        with anyio.CancelScope(shield=True):
            await _reap(process)


def _describe(process: subprocess.Popen[bytes]) -> str:
    code = process.poll()
    if code is None:
        return "stopped answering"
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


def _tail(path: Path, limit: int = 12) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    picked = [ln for ln in lines if re.search(r"error|exception|fail|incorrect|unable|cannot", ln, re.IGNORECASE)]
    return (picked or [ln for ln in lines if ln.strip()])[-limit:]


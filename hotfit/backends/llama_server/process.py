"""llama-server's process lifetime: start, health, stop, and the :class:`LoadedServer` session.

The process is a child we own:

- started in its own session/process group, with ``PR_SET_PDEATHSIG`` so that even a SIGKILL of
  hotfit takes it down;
- always reaped on leaving :func:`open_server` (success, error, cancellation, Ctrl-C): SIGTERM to
  the group, then SIGKILL after a grace period;
- its logs go straight to files in the run directory (:mod:`backends.llama_server.logs`).

The API key is random per start, handed over in the environment (``LLAMA_API_KEY``), never in
argv (world-readable in ``/proc/<pid>/cmdline``), never logged or stored by hotfit. A server that
dies by a signal is diagnosed by :mod:`backends.llama_server.crash`. Nothing is deleted on a
failed load: the verified weights stay in place and a rerun resumes at load.

:class:`LoadedServer` is llama-server's :class:`backends.base.Session`: its chat call and
allocation report live in :mod:`~backends.llama_server.chat` and
:mod:`~backends.llama_server.allocation`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import time
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, ClassVar, Literal, Mapping

import anyio

from hotfit.backends.base import AllocationReport
from hotfit.backends.http_chat import HttpChatEndpoint
from hotfit.backends.llama_server import allocation, chat
from hotfit.backends.llama_server.crash import signal_death_report
from hotfit.backends.llama_server.discovery import BuildInfo
from hotfit.backends.llama_server.flags import (
    API_KEY_ENV,
    ServerFeatures,
    TemplateUsed,
    child_env,
    llama_server_argv,
    new_api_key,
    probe_server_features,
    template_used,
)
from hotfit.backends.llama_server.logs import (
    STDERR_LOG,
    STDOUT_LOG_JSONL,
    STDOUT_LOG_TEXT,
    LogLine,
    diagnose_load_failure,
    read_server_log,
    relevant_log_lines,
)
from hotfit.core.errors import LoadError
from hotfit.core.lazy_import import lazy_module
from hotfit.core.log import get_logger
from hotfit.planner.plan import Plan
from hotfit.grading.protocol import ChatEndpoint, ChatReply

if TYPE_CHECKING:  # the type checker reads the real module; at run time it loads on first use
    import httpx
else:
    httpx = lazy_module("httpx")  # third-party, imported on first use (core.lazy_import says why)

__all__ = ["HEALTH_TIMEOUT_S", "TERM_GRACE_S", "LoadedServer", "free_port", "open_server"]

log = get_logger()
# Loading a large model from a cold disk takes minutes; a server that is not healthy after this
# long is reported as failed (with its log), never waited on forever.
HEALTH_TIMEOUT_S = 600.0
_HEALTH_POLL_S = 0.1
# After SIGTERM llama-server frees its buffers and exits within a second or two; a process still
# there after this grace period is killed.
TERM_GRACE_S = 10.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


_PR_SET_PDEATHSIG = 1
_prctl: Callable[..., int] | None
try:  # resolved here, in the parent: the forked child must not dlopen or import anything
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: the context manager's reaping still applies
    _prctl = None


def _child_setup(parent_pid: int) -> None:
    """Runs in the child between fork and exec: die with hotfit, even on SIGKILL (Linux)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent_pid:  # hotfit died before prctl took effect
        os._exit(1)



@dataclass(eq=False, repr=False)  # a live process: one object is one server; __repr__ hides the key
class LoadedServer:
    """A running llama-server opened by :func:`open_server` (valid inside the ``async with``)."""

    process: subprocess.Popen[bytes]
    argv: tuple[str, ...]
    host: str
    port: int
    api_key: str
    run_dir: Path
    log_path: Path
    stderr_path: Path
    template: TemplateUsed
    features: ServerFeatures
    plan: Plan
    model_path: Path
    load_seconds: float = 0.0  # set once /health answers
    build: BuildInfo | None = None  # what the binary is (backend, ISA build); None: not known to the caller

    def __repr__(self) -> str:  # never show the key
        return f"LoadedServer(pid={self.pid}, base_url={self.base_url!r}, log={str(self.log_path)!r})"

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def auth_headers(self) -> dict[str, str]:
        # A build without LLAMA_API_KEY support runs keyless: an empty "Bearer " is an illegal header
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, timeout_s: float) -> httpx.AsyncClient:
        """An HTTP client for this server (authorised; proxies from the environment ignored)."""
        return httpx.AsyncClient(
            base_url=self.base_url, headers=self.auth_headers, timeout=timeout_s, trust_env=False
        )

    def returncode(self) -> int | None:
        return self.process.poll()

    def log_lines(self) -> list[LogLine]:
        return read_server_log(self.run_dir)

    def describe_exit(self) -> str:
        return _describe_returncode(self.process.poll())

    # ------------------------------------------------------------ backends.base.Session

    backend: ClassVar[Literal["llama"]] = "llama"
    server_name: ClassVar[str] = "llama-server"
    prompt_max_tokens: ClassVar[None] = None  # llama-server takes any prompt its window holds

    def load_figures(self) -> dict[str, Any]:
        return {"pid": self.pid, "load_seconds": round(self.load_seconds, 3), "template": self.template.describe(),
                "llama_server": self.argv[0]}

    async def call_tools(self, request: Mapping[str, Any], *, timeout_s: float, purpose: str) -> ChatReply:
        return await chat.call_tools(self, request, timeout_s=timeout_s, purpose=purpose)

    def tool_call_fix(self, cause: str, answer: ChatReply | None) -> str:
        return chat.tool_call_fix(cause, answer)

    def chat_endpoint(self) -> AbstractAsyncContextManager[ChatEndpoint]:
        return HttpChatEndpoint(self.base_url, api_key=self.api_key or None)

    async def allocation_report(self, plan: Plan, *, floor_tokens: int, tolerance: float,
                                timeout_s: float) -> AllocationReport:
        return await allocation.read_allocation(self, plan, floor_tokens=floor_tokens, tolerance=tolerance,
                                                timeout_s=timeout_s)

    def to_json(self) -> dict[str, Any]:
        """What a stage record keeps (no key; argv holds none)."""
        return {
            "pid": self.pid,
            "base_url": self.base_url,
            "argv": list(self.argv),
            "log_path": str(self.log_path),
            "stderr_path": str(self.stderr_path),
            "template": {"kind": self.template.kind, "path": str(self.template.path) if self.template.path else None},
            "load_seconds": round(self.load_seconds, 3),
        }


def _describe_returncode(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


async def _reap(process: subprocess.Popen[bytes], grace_s: float = TERM_GRACE_S) -> None:
    """SIGTERM the child's process group, SIGKILL it after ``grace_s``, wait until it is gone.
    Runs shielded: a cancelled caller still waits for the child to be reaped."""
    with anyio.CancelScope(shield=True):
        if process.poll() is None:
            _signal_group(process, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while process.poll() is None and time.monotonic() < deadline:
                await anyio.sleep(0.05)
            if process.poll() is None:
                _signal_group(process, signal.SIGKILL)
                log.warning("load.server_killed", pid=process.pid, grace_s=grace_s)
        while process.poll() is None:
            await anyio.sleep(0.02)
        # The group may still hold children of the server (none today); make sure of it.
        _signal_group(process, signal.SIGKILL)


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)  # start_new_session: the group id is the child's pid
    except (ProcessLookupError, PermissionError):
        pass


@contextlib.asynccontextmanager
async def open_server(
    plan: Plan,
    model_path: Path,
    *,
    binary: Path,
    run_dir: Path,
    template_path: Path | None = None,
    health_timeout_s: float = HEALTH_TIMEOUT_S,
    host: str = "127.0.0.1",
    threads: int | None = None,
    warmup: bool = True,
    build: BuildInfo | None = None,
    embedded_template: bool | None = None,
) -> AsyncIterator[LoadedServer]:
    """Start llama-server for ``plan``, wait until ``/health`` answers 200, yield it, and always
    stop and reap it on leaving (normally, on error, on cancellation).

    Raises :class:`LoadError` quoting the relevant log lines when the server exits early or is
    not healthy within ``health_timeout_s``. ``build`` (``Backend.build`` from
    :func:`backends.llama_server.find_llama_server`) is what a death by signal is diagnosed against;
    without it the ``build-info.json`` beside ``binary`` is read, if there is one.
    ``embedded_template``: whether the GGUF embeds a chat template (the verified header's fact;
    None: unknown), which names the template the server formats with."""
    model_path = Path(model_path)
    if not model_path.is_file():
        raise LoadError(
            f"model file {model_path} does not exist",
            hint="run the fetch and verify stages first (`hotfit pull NAME`)",
            model_path=str(model_path),
        )
    if template_path is not None and not Path(template_path).is_file():
        raise LoadError(
            f"chat template {template_path} does not exist",
            hint="re-run fetch-template (`hotfit pull NAME`)",
            template_path=str(template_path),
        )
    features = await probe_server_features(binary)
    run_dir.mkdir(parents=True, exist_ok=True)
    template = template_used(template_path, embedded_template)
    if not features.log_jsonl:
        log.warning("load.no_log_jsonl", binary=str(binary), note="capturing plain-text logs")
    if not features.api_key_env:
        log.warning("load.api_key_env_unsupported", binary=str(binary), note="server runs without an API key")

    api_key = new_api_key()
    env = child_env(plan, api_key)
    if not features.api_key_env:  # older build: no key at all rather than one in argv
        env.pop(API_KEY_ENV, None)
        api_key = ""

    attempts = 3  # a free port can be taken between our probe and the server's bind
    for attempt in range(1, attempts + 1):
        port = free_port(host)
        argv = llama_server_argv(
            plan, model_path, template_path, port, binary=binary, features=features, host=host,
            threads=threads, warmup=warmup,
        )  # fmt: skip
        log_path = run_dir / (STDOUT_LOG_JSONL if features.log_jsonl else STDOUT_LOG_TEXT)
        stderr_path = run_dir / STDERR_LOG
        log.info(
            "load.start",
            argv=argv,
            log_path=str(log_path),
            template=template.describe(),
            hot_context_tokens=plan.hot_context_tokens,
            kv_cache_type=plan.kv_cache_type,
            attempt=attempt,
        )
        started = time.monotonic()
        with open(log_path, "wb") as out, open(stderr_path, "wb") as err:
            parent = os.getpid()
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=env,
                cwd=Path(argv[0]).parent,  # ggml also loads backend modules from the working directory
                start_new_session=True,
                preexec_fn=lambda: _child_setup(parent),
            )
        server = LoadedServer(
            process=process, argv=tuple(argv), host=host, port=port, api_key=api_key, run_dir=run_dir,
            log_path=log_path, stderr_path=stderr_path, template=template, features=features,
            plan=plan, model_path=model_path, build=build,
        )  # fmt: skip
        try:
            try:
                await _wait_healthy(server, health_timeout_s)
            except LoadError as exc:
                if exc.details.get("cause") == "port_in_use" and attempt < attempts:
                    log.warning("load.port_taken", port=port, attempt=attempt)
                    continue
                raise
            server.load_seconds = time.monotonic() - started
            log.info("load.healthy", pid=server.pid, port=port, load_seconds=round(server.load_seconds, 3))
            yield server
            return
        finally:
            await _reap(process)
            log.info("load.stopped", pid=process.pid, how=_describe_returncode(process.poll()))


async def _wait_healthy(server: LoadedServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=server.base_url, timeout=5.0, trust_env=False) as client:
        while True:
            code = server.returncode()
            if code is not None:
                await anyio.sleep(0.05)  # let the last log lines reach the file
                raise _load_error(server, f"llama-server {_describe_returncode(code)} before it was healthy")
            # The deadline is checked before each poll, so an answer that arrives after it (a
            # fast load on a slow machine included) never counts as healthy in time.
            if time.monotonic() >= deadline:
                raise _load_error(server, f"llama-server not healthy after {timeout_s:.0f} s")
            try:
                resp = await client.get("/health")
                if resp.status_code == 200 and server.returncode() is None:
                    return  # (a 200 while our child is dead would come from someone else's server)
            except httpx.TransportError:
                pass  # not listening yet
            await anyio.sleep(_HEALTH_POLL_S)



def _signal_error(server: LoadedServer, sig: int) -> LoadError:
    message, hint, details = signal_death_report(server, sig, "while loading or warming up the model")
    log.error("load.killed_by_signal", signal=details["signal"], binary=details["binary"],
              backend=details["backend"], variant=details["variant"],
              missing_cpu_features=details["missing_cpu_features"], log_path=str(server.log_path),
              lines=details["log_lines"])
    return LoadError(message, hint=hint, cause="killed_by_signal", log_path=str(server.log_path),
                     model_path=str(server.model_path), **details)


def _load_error(server: LoadedServer, what: str) -> LoadError:
    code = server.returncode()
    if code is not None and code < 0:  # died by a signal: the binary and the CPU are the suspects
        return _signal_error(server, -code)
    lines = server.log_lines()
    cause, hint = diagnose_load_failure(lines)
    quoted = relevant_log_lines(lines)
    log.error("load.failed", cause=cause, log_path=str(server.log_path), lines=quoted)
    body = "\n".join(f"    {m}" for m in quoted)
    return LoadError(
        f"{what} ({cause.replace('_', ' ')}); llama-server said:\n{body}",
        hint=f"{hint}; full log: {server.log_path}",
        cause=cause,
        log_lines=quoted,
        log_path=str(server.log_path),
        returncode=server.returncode(),
        model_path=str(server.model_path),
    )


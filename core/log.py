"""structlog set-up: events are stable names plus key/value facts.

One renderer is chosen at start-up: JSON lines (machines, log pipelines) or console (a person at
a TTY). Every event, whatever ``-q``/``-v`` say, is appended as JSON to ``<home>/logs/hotfit.jsonl``:
the verbosity filters only what the stream shows, so the file is the complete record an operator
reads after an unattended run. Secrets are scrubbed by a processor so no token or API key reaches
a log line.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import sys
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import structlog
from structlog.typing import EventDict, Processor

from core.diskspace import from_os_error, is_disk_full

SECRET_KEYS = frozenset({"token", "hf_token", "api_key", "authorization", "password", "secret"})
_VERBOSITY_LEVELS = {-1: logging.WARNING, 0: logging.INFO, 1: logging.DEBUG}
_LEVEL_NUMBERS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "warn": logging.WARNING,
                  "error": logging.ERROR, "critical": logging.CRITICAL, "exception": logging.ERROR}
_file_sink: BinaryIO | None = None  # the open log file of the last configure(), closed by the next one


def _scrub_secrets(_logger: Any, _name: str, event: EventDict) -> EventDict:
    for key in list(event):
        if key.lower() in SECRET_KEYS and event[key] is not None:
            event[key] = "***"
    return event


def configure(
    log_format: str | None = None,
    verbosity: int = 0,
    log_file: Path | None = None,
    stream: TextIO | None = None,
) -> None:
    """Configure structlog once per process. ``log_format`` None = console on a TTY, else json."""
    stream = stream or sys.stderr
    if log_format is None:
        log_format = "console" if stream.isatty() else "json"
    stream_level = _VERBOSITY_LEVELS[max(-1, min(1, verbosity))]
    global _file_sink
    if _file_sink is not None:
        with contextlib.suppress(OSError):  # a full disk already said so when the write failed
            _file_sink.close()
        _file_sink = None
    file_sink: BinaryIO | None = None
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        # unbuffered: one event, one write, and a failed write leaves nothing behind to retry
        file_sink = open(log_file, "ab", buffering=0)
        _file_sink = file_sink

    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _scrub_secrets,
    ]
    console_renderer = (
        structlog.dev.ConsoleRenderer(colors=stream.isatty()) if log_format == "console" else None
    )

    sink_failed: list[bool] = []

    def emit(_logger: Any, _name: str, event: EventDict) -> str:
        line = json.dumps(event, default=str, sort_keys=False)
        if file_sink is not None and not sink_failed:
            try:
                data = memoryview((line + "\n").encode("utf-8"))
                while data:  # unbuffered: a short write (a nearly full disk) returns a count, not an error
                    written = file_sink.write(data)
                    if not written:
                        raise OSError(errno.ENOSPC, "no bytes written", str(log_file))
                    data = data[written:]
            except OSError as exc:
                # Once: the file stops taking events (unbuffered, so nothing retries the write), the
                # stream still shows them, and a full disk is exit 4 naming the log.
                sink_failed.append(True)
                if is_disk_full(exc):
                    raise from_os_error(exc, log_file, needed_bytes=len(line) + 1, what="the event log") from None
                raise
        if _LEVEL_NUMBERS.get(str(event.get("level")), logging.INFO) < stream_level:
            raise structlog.DropEvent  # kept in the file, not shown on the stream
        if console_renderer is not None:
            return console_renderer(_logger, _name, dict(event))
        return line

    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, emit],
        # Nothing is filtered before emit: the file takes every level, emit filters the stream.
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )


def get_logger(**initial: Any) -> Any:
    return structlog.get_logger("hotfit", **initial)


def bind(**facts: Any) -> None:
    """Bind run-wide facts (run_id, stage, plan_id) to every following event of this task."""
    structlog.contextvars.bind_contextvars(**facts)


def unbind(*keys: str) -> None:
    structlog.contextvars.unbind_contextvars(*keys)

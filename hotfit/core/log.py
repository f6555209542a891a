"""structlog set-up: events are stable names plus key/value facts.

One renderer is chosen at start-up: JSON lines (machines, log pipelines) or console (a person at
a TTY). Every event, whatever ``-q``/``-v`` say, is appended as JSON to ``<home>/logs/hotfit.jsonl``:
the verbosity filters only what the stream shows, so the file is the complete record an operator
reads after an unattended run. Secrets are scrubbed by a processor so no token or API key reaches
a log line.

The file stays bounded: when it has reached ``max_bytes`` at start-up it is rotated
(``hotfit.jsonl`` → ``hotfit.jsonl.1`` → … → ``.<keep>``, the oldest dropped), so the log takes at
most about ``(keep + 1) × max_bytes`` plus one command's events. Every event name and its fields
are catalogued in docs/events.md (tests/test_event_catalogue.py holds the code to it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import sys
from pathlib import Path
from collections.abc import MutableMapping
from typing import Any, BinaryIO, TextIO

import structlog
from structlog.typing import EventDict, Processor

from hotfit.core.diskspace import write_failure

SECRET_KEYS = frozenset({"token", "hf_token", "api_key", "authorization", "password", "secret"})
_VERBOSITY_LEVELS = {-1: logging.WARNING, 0: logging.INFO, 1: logging.DEBUG}
_LEVEL_NUMBERS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "warn": logging.WARNING,
                  "error": logging.ERROR, "critical": logging.CRITICAL, "exception": logging.ERROR}
_file_sink: BinaryIO | None = None  # the open log file of the last configure(), closed by the next one
# Events are "file only" with this key set (a command's own outcome, which it already printed for
# a person): the key is dropped and the event kept from the stream.
FILE_ONLY = "_file_only"
DEFAULT_LOG_MAX_BYTES = 10 << 20  # rotate at 10 MiB: weeks of hourly no-op runs, quick to ship
DEFAULT_LOG_KEEP = 5  # rotated files kept beside the live one
_seen: list[MutableMapping[str, Any]] = []  # this process's events since configure() (pipeline/metrics.py reads them)


class _CurrentStderr:
    """Whatever ``sys.stderr`` is when an event is written, not when logging was configured: a
    replaced stderr (a test's capture, an embedding caller's redirect) that was closed since must
    not turn every later event into "I/O operation on closed file"."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def _scrub_secrets(_logger: Any, _name: str, event: EventDict) -> EventDict:
    for key in list(event):
        if key.lower() in SECRET_KEYS and event[key] is not None:
            event[key] = "***"
    return event


def rotate_if_full(log_file: Path, max_bytes: int, keep: int) -> bool:
    """Rotate ``log_file`` when it has reached ``max_bytes`` (True if this call rotated it).

    One ``stat`` when there is nothing to do. The renames happen under an flock beside the log, and
    the size is looked at again once it is held, so two commands starting together rotate once. A
    process that still has the old file open (a long ``auto``) finishes its events into ``.1``.
    """
    try:
        if os.stat(log_file).st_size < max_bytes:
            return False
    except FileNotFoundError:
        return False
    with open(log_file.parent / ".rotate.lock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            if os.stat(log_file).st_size < max_bytes:
                return False  # another command rotated it while this one waited
        except FileNotFoundError:
            return False
        for index in range(keep - 1, 0, -1):
            older = log_file.with_name(f"{log_file.name}.{index}")
            if older.exists():
                os.replace(older, log_file.with_name(f"{log_file.name}.{index + 1}"))
        if keep > 0:
            os.replace(log_file, log_file.with_name(f"{log_file.name}.1"))
        else:
            os.unlink(log_file)
    return True


def events_seen() -> list[MutableMapping[str, Any]]:
    """The events this process emitted since the last :func:`configure` (as written to the file)."""
    return list(_seen)


def configure(
    log_format: str | None = None,
    verbosity: int = 0,
    log_file: Path | None = None,
    stream: TextIO | None = None,
    *,
    max_bytes: int = DEFAULT_LOG_MAX_BYTES,
    keep: int = DEFAULT_LOG_KEEP,
) -> None:
    """Configure structlog once per process. ``log_format`` None = console on a TTY, else json.
    ``max_bytes``/``keep``: rotate ``log_file`` first if it is full (:func:`rotate_if_full`)."""
    out: TextIO | _CurrentStderr = stream if stream is not None else _CurrentStderr()
    if log_format is None:
        log_format = "console" if out.isatty() else "json"
    stream_level = _VERBOSITY_LEVELS[max(-1, min(1, verbosity))]
    global _file_sink
    if _file_sink is not None:
        with contextlib.suppress(OSError):  # a full disk already said so when the write failed
            _file_sink.close()
        _file_sink = None
    _seen.clear()
    file_sink: BinaryIO | None = None
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        rotate_if_full(log_file, max_bytes, keep)
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
        structlog.dev.ConsoleRenderer(colors=out.isatty()) if log_format == "console" else None
    )

    sink_failed: list[bool] = []

    def emit(_logger: Any, _name: str, event: EventDict) -> str:
        file_only = event.pop(FILE_ONLY, False)
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
                if (mapped := write_failure(exc, log_file, needed_bytes=len(line) + 1, what="the event log")) is not None:
                    raise mapped from None
                raise
        _seen.append(event)
        if file_only or _LEVEL_NUMBERS.get(str(event.get("level")), logging.INFO) < stream_level:
            raise structlog.DropEvent  # kept in the file, not shown on the stream
        if console_renderer is not None:
            return console_renderer(_logger, _name, dict(event))
        return line

    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, emit],
        # Nothing is filtered before emit: the file takes every level, emit filters the stream.
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        logger_factory=structlog.PrintLoggerFactory(file=out),  # type: ignore[arg-type]  # a write()/flush() object
        cache_logger_on_first_use=False,
    )


def get_logger(**initial: Any) -> Any:
    return structlog.get_logger("hotfit", **initial)


def bind(**facts: Any) -> None:
    """Bind run-wide facts (run_id, stage, plan_id) to every following event of this task."""
    structlog.contextvars.bind_contextvars(**facts)


def unbind(*keys: str) -> None:
    structlog.contextvars.unbind_contextvars(*keys)

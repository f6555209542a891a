"""Waiting in tests: the one poll of a condition, with a hang guard, and the socket facts tests wait on.

No sleep stands in for synchronisation (CONTRIBUTING.md "Set-up and tests"): a test waits until a
condition it can observe holds — a file, a log event, a process gone, bytes at a port — and the
deadline only turns a hang into a failure that names what never happened; it is no timing assertion.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Generator
from pathlib import Path

import anyio

DEFAULT_TIMEOUT_S = 60.0
POLL_INTERVAL_S = 0.02


def _polls(predicate: Callable[[], object], what: str, timeout_s: float,
           proc: subprocess.Popen[str] | subprocess.Popen[bytes] | None) -> Generator[None, None, None]:
    """Yield once per failed look at ``predicate`` (the caller sleeps, sync or async); return once it
    holds. Fails naming ``what`` when ``timeout_s`` passes or ``proc`` has exited first."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process exited ({proc.returncode}) before {what}{_stderr_tail(proc)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout_s:g} s waiting for {what}")
        yield


def _stderr_tail(proc: subprocess.Popen[str] | subprocess.Popen[bytes]) -> str:
    if proc.stderr is None or proc.stderr.closed:
        return ""
    err = proc.stderr.read()
    text = err.decode(errors="replace") if isinstance(err, bytes) else err
    return f": {text[-2000:]}"


def wait_until(predicate: Callable[[], object], what: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
               proc: subprocess.Popen[str] | subprocess.Popen[bytes] | None = None,
               interval_s: float = POLL_INTERVAL_S) -> None:
    """Return once ``predicate()`` is true; an AssertionError naming ``what`` when ``timeout_s``
    passes first, or when ``proc`` (the process expected to bring it about) exits before it.
    ``interval_s``: between looks (shorter to catch a brief state, longer for a costly look)."""
    for _ in _polls(predicate, what, timeout_s, proc):
        time.sleep(interval_s)


async def wait_until_async(predicate: Callable[[], object], what: str, *,
                           timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """:func:`wait_until` for a test whose event loop must keep running while it waits."""
    for _ in _polls(predicate, what, timeout_s, None):
        await anyio.sleep(POLL_INTERVAL_S)


def accepts_connections(port: int) -> bool:
    """Whether a server on 127.0.0.1:``port`` accepts a TCP connection now."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


# /proc/net/tcp's states (include/net/tcp_states.h)
TCP_ESTABLISHED = 0x01
TCP_LISTEN = 0x0A


def tcp_sockets_at(port: int) -> list[tuple[int, int]]:
    """(state, rx_queue) of each TCP socket of this network namespace whose local port is ``port``.

    For a listening socket Linux reports the connections waiting in its accept queue as rx_queue;
    for an accepted or queued connection, the bytes that arrived and its server has not read
    (proc(5), /proc/net/tcp)."""
    found = []
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        try:
            rows = table.read_text().splitlines()[1:]
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
        for row in rows:
            fields = row.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port:
                found.append((int(fields[3], 16), int(fields[4].split(":")[1], 16)))
    return found


def unread_request_bytes_at(port: int) -> int:
    """Bytes clients sent to the server listening on ``port`` that it has not read yet."""
    return sum(rx for state, rx in tcp_sockets_at(port) if state == TCP_ESTABLISHED)


def connections_to_accept_at(port: int) -> int:
    """Connections the kernel completed for the listener on ``port`` that it has not accepted yet."""
    return sum(rx for state, rx in tcp_sockets_at(port) if state == TCP_LISTEN)

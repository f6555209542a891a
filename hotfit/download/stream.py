"""One ranged GET into the partial file: the write path of the block scheduler.

Each block is one ``Range`` request on a kept-alive connection (``download.wire``: a blocking socket
in a worker thread); the answer is checked against the pin (206 with the asked range of a file of
the pinned size, or 200 with the pinned length for a whole-file stream) before a byte is written.
The body is read with ``readinto1`` straight into the file's pooled 1 MiB receive buffers, each handed
to the write-behind thread of ``download.hashing`` at its absolute offset when full or after one
checkpoint interval (written in place, sha256 of the same memory, no copy in Python); whatever is
received when the stream breaks is still written, so a cut loses no received byte. The event loop
only waits: cancelling it (Ctrl-C) shuts the socket down, so a blocked ``recv`` returns at once. A
200 to a ranged GET is :class:`RangeIgnored`: the scheduler restarts the file as one stream from
byte 0.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import anyio

from hotfit.core.errors import PinMismatch, TransferError
from hotfit.download.disk import disk_error
from hotfit.download.hashing import WRITE_QUEUE_BYTES, OrderedHasher
from hotfit.download.hub import HubSession
from hotfit.download.hub_errors import Retryable, hub_error_from_response
from hotfit.download.progress import ProgressReporter
from hotfit.download.proxy import proxy_refused
from hotfit.download.sidecar import Block, Sidecar
from hotfit.download.wire import Opened, finish, open_get, read_some, transport_error

T = TypeVar("T")

_CONTENT_RANGE_RE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class RangeIgnored(Exception):
    """The server answered 200 (whole body) to a ranged GET."""


def parse_content_range(value: str | None) -> tuple[int, int, int | None] | None:
    m = _CONTENT_RANGE_RE.match((value or "").strip())
    if not m:
        return None
    total = None if m.group(3) == "*" else int(m.group(3))
    return int(m.group(1)), int(m.group(2)), total


def _check_answer(resp: Any, session: HubSession, side: Sidecar, block: Block, offset: int, whole: bool) -> None:
    """Raise unless ``resp`` carries exactly the bytes asked for of the pinned file."""
    proxy = session.proxy_for(str(resp.url))
    if resp.status_code == 407 and proxy is not None:
        raise proxy_refused(proxy, f"{side.file}: GET")
    if resp.status_code == 206:
        cr = parse_content_range(resp.headers.get("content-range"))
        if cr is None or cr[0] != offset or cr[1] >= block.end or (cr[2] is not None and cr[2] != side.size_bytes):
            raise PinMismatch(
                f"{side.file}: server answered range {resp.headers.get('content-range')!r} "
                f"to bytes={offset}-{block.end - 1} of a {side.size_bytes}-byte file",
                hint="the server's file differs from the pinned one; nothing was written",
                repo=side.repo, file=side.file)
    elif resp.status_code == 200:
        if offset != 0 or not whole:
            raise RangeIgnored()
        length = resp.headers.get("content-length", "")
        if length.isdigit() and int(length) != side.size_bytes:
            raise PinMismatch(
                f"{side.file}: server sends {length} bytes, the pin says {side.size_bytes}",
                hint="the served file is not the pinned one; fix the registry entry after review",
                repo=side.repo, file=side.file, served_size_bytes=int(length),
                expected_size_bytes=side.size_bytes)
    elif resp.status_code == 416:
        raise PinMismatch(
            f"{side.file}: server refused bytes={offset}- ({resp.headers.get('content-range')})",
            hint="the served file is shorter than the pin says; fix the registry entry after review",
            repo=side.repo, file=side.file)
    elif resp.status_code in (401, 403, 410) and not session.is_own_origin(str(resp.url)):
        # A signed CDN link expired (real ones do, hours into a pull): the retry re-HEADs the
        # Hub for a fresh one, and the Hub itself answers gating/not-found properly.
        raise Retryable(f"{side.file}: CDN answered HTTP {resp.status_code} (link expired?)")
    else:
        from_endpoint = session.is_own_origin(str(resp.url))
        raise hub_error_from_response(resp, repo=side.repo, revision=side.revision, path=side.file,
                                      endpoint=session.endpoint if from_endpoint else None)
    encoding = resp.headers.get("content-encoding", "identity").lower()
    if encoding not in ("identity", ""):
        raise TransferError(f"{side.file}: server compressed the body ({encoding}); byte offsets unusable",
                            hint="use an endpoint that serves raw bytes", file=side.file)


class _Writer:
    """The loop's side of one block's writes: waits for the write-behind threads and raises what failed
    there; ``add``/``flush`` hand over bytes received on the loop (a stream receives in a thread)."""

    def __init__(self, partial: Path, block: Block, pos: int, hasher: OrderedHasher,
                 reporter: ProgressReporter | None, counters: dict[str, Any]) -> None:
        self.partial, self.block, self.pos = partial, block, pos
        self.hasher, self.reporter, self.counters = hasher, reporter, counters
        self.parts: list[bytes] = []
        self.gathered = 0

    def add(self, chunk: bytes) -> None:
        self.parts.append(chunk)
        self.gathered += len(chunk)

    async def flush(self) -> None:
        if self.parts:
            todo, n = self.parts, self.gathered
            self.parts, self.gathered = [], 0
            self.hasher.write(self.pos, todo, n, self.block)
            self.pos += n
            self.counters["transferred"] += n
            if self.reporter:
                self.reporter.advance(n)
        self.raise_write_error()
        if self.hasher.write_queued_bytes > WRITE_QUEUE_BYTES:  # the disk is slower than the network
            await anyio.to_thread.run_sync(self.hasher.wait_written, WRITE_QUEUE_BYTES // 2)

    async def drain(self) -> None:
        """Wait until every byte handed over is written and hashed (``block.done`` is then exact)."""
        await anyio.to_thread.run_sync(self.hasher.wait_written, 0)
        self.raise_write_error()

    def raise_write_error(self) -> None:
        if self.hasher.thread_error is not None:
            raise self.hasher.thread_error
        if self.hasher.write_error is not None:
            exc, at = self.hasher.write_error
            # what the file still lacks past its in-order prefix: at most this much more must fit
            mapped = disk_error(exc, self.partial, at, self.hasher.size_bytes - self.hasher.frontier)
            if mapped is not None:
                raise mapped from exc
            raise exc


class _Receiver:
    """One block's GET in worker threads; :meth:`cancel` (from the loop) unblocks a waiting ``recv``
    by shutting the socket down, so Ctrl-C never waits for the network."""

    def __init__(self) -> None:
        self.cancelled = False
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()

    def on_socket(self, sock: socket.socket | None) -> None:
        with self._lock:
            self._sock = sock
            if self.cancelled:
                _shutdown(sock)

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            _shutdown(self._sock)

    def _guarded(self, fn: Callable[[], T]) -> Callable[[], T | None]:
        def run() -> T | None:
            with self._lock:
                if self.cancelled:
                    return None
                self._idle.clear()
            try:
                return fn()
            finally:
                self._idle.set()
        return run

    async def run(self, fn: Callable[[], T], *, wait_on_cancel: bool) -> T | None:
        """``fn()`` in a worker thread. Cancelled: the socket is shut down and, when
        ``wait_on_cancel``, the thread is waited for (it may still be handing bytes to the writer)."""
        try:
            return await anyio.to_thread.run_sync(self._guarded(fn), abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():
            self.cancel()
            if wait_on_cancel:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(self._idle.wait)
            raise


def _shutdown(sock: socket.socket | None) -> None:
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


_COUNT_LOCK = threading.Lock()  # receiving threads of one file share its counters and progress


def _receive(rx: _Receiver, opened: Opened, session: HubSession, side: Sidecar, block: Block, pos: int,
             hasher: OrderedHasher, reporter: ProgressReporter | None, counters: dict[str, Any]) -> int:
    """(worker thread) Read the body into pooled buffers, each handed to the write-behind thread at
    its offset; the position reached. Stops early, without error, when cancelled or a write failed."""
    resp, what = opened.resp, f"{side.file}: GET"
    pool = hasher.receive_buffers(session.options.chunk_bytes)
    interval_s = session.options.checkpoint_interval_s

    def stop() -> bool:
        return rx.cancelled or hasher.write_error is not None or hasher.thread_error is not None

    complete = False
    try:
        while pos < block.end and not stop():
            buf = pool.take(stop)
            if buf is None:
                break
            view = memoryview(buf)[:min(len(buf), block.end - pos)]
            n, failed, ended = 0, None, False
            # A buffer is handed over when full or after a checkpoint interval, whichever comes first:
            # on a slow link bytes are written (and so claimable by a checkpoint) within the interval
            # instead of after a whole buffer's worth of seconds.
            handover_at = time.monotonic() + interval_s
            try:
                while n < len(view):
                    got = read_some(resp, view[n:])
                    if not got:
                        ended = True
                        break
                    n += got
                    if time.monotonic() >= handover_at:
                        break
            except (OSError, http.client.HTTPException) as exc:
                failed = exc
            if n:
                hasher.write(pos, [view[:n]], n, block, release=functools.partial(pool.put, buf))
                pos += n
                with _COUNT_LOCK:
                    counters["transferred"] += n
                    if reporter:
                        reporter.advance(n)
            else:
                pool.put(buf)
            if failed is not None:
                if rx.cancelled:
                    break
                raise transport_error(what, failed) from failed
            if ended:  # the server closed the body early: the retry resumes at block.done
                break
        if pos >= block.end and not resp.isclosed():  # a body without Content-Length may go on
            try:
                more = resp.read(1)
            except (OSError, http.client.HTTPException) as exc:
                raise transport_error(what, exc) from exc
            if more:
                raise PinMismatch(f"{side.file}: server sent more than {side.size_bytes} bytes",
                                  hint="the served file is not the pinned one", repo=side.repo, file=side.file)
        complete = pos >= block.end and not rx.cancelled
    finally:
        if complete:
            finish(session.wire, opened.url, opened.conn, resp)
        else:
            opened.conn.close()
    return pos


async def stream_block(session: HubSession, side: Sidecar, block: Block, url: str, *, whole: bool,
                       partial: Path, hasher: OrderedHasher, reporter: ProgressReporter | None,
                       counters: dict[str, Any]) -> None:
    """GET what ``block`` still lacks from ``url`` and write it in place; Retryable when the stream
    ended short (the retry resumes at the new ``block.done``)."""
    offset = block.start + block.done
    extra = {} if (whole and block.done == 0) else {"range": f"bytes={offset}-{block.end - 1}"}
    rx = _Receiver()
    # Headers: nothing is written yet, so a cancelled wait (connect, a slow first byte) is not waited for.
    opened = await rx.run(lambda: open_get(session.wire, url, lambda u: session.headers_for(u, extra),
                                           f"{side.file}: GET", rx.on_socket), wait_on_cancel=False)
    assert opened is not None  # None only when cancelled, and then run() raised
    try:
        _check_answer(opened.answer, session, side, block, offset, whole)
    except BaseException:
        opened.conn.close()  # the body is not read: the connection cannot be reused
        raise
    writer = _Writer(partial, block, offset, hasher, reporter, counters)
    try:
        reached = await rx.run(lambda: _receive(rx, opened, session, side, block, offset, hasher, reporter,
                                                counters), wait_on_cancel=True)
        writer.pos = reached if reached is not None else writer.pos
    finally:
        # Even when the stream broke: what was received is written, and a retry resumes at the
        # exact ``block.done``. Shielded: a cancelled download still leaves its bytes counted.
        with anyio.CancelScope(shield=True):
            await writer.drain()
    if not block.complete:
        raise Retryable(f"{side.file}: connection closed at byte {writer.pos} of block ending {block.end}")

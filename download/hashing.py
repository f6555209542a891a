"""sha256 (and optionally the git blob sha1) computed while the bytes stream in, off the event loop.

sha256 must see bytes in order, ranges arrive out of order. A hashing thread consumes the contiguous
prefix: chunks at the frontier are hashed as they arrive; chunks ahead of it wait in a bounded memory
buffer (``hash_buffer_bytes``) and are hashed once the frontier reaches them; what does not fit is
*spilled* — already on disk, read back once when the frontier arrives (hot in the page cache: written
moments before). On resume the bytes already on disk are read back once. Every byte read back is
counted in ``reread_bytes``; no second pass over a completed file ever happens.
"""

from __future__ import annotations

import errno
import hashlib
import os
import queue
import threading
from typing import Any

from core.errors import TransferError

MiB = 1024 * 1024


class OrderedHasher:
    """sha256 (and optionally git blob sha1) of a file whose bytes arrive out of order.

    ``feed(offset, data)`` is called from the event loop *after* ``data`` was written at ``offset``;
    it only enqueues. A daemon thread keeps the frontier: data at the frontier is hashed, data ahead
    of it is buffered (bounded by ``buffer_bytes``) or, past the bound, remembered as an on-disk
    interval and read back with ``pread`` when the frontier reaches it (counted in ``reread_bytes``).
    ``mark_on_disk(start, end)`` declares bytes written by an earlier run (resume).
    """

    _STOP = object()

    def __init__(self, fd: int, size_bytes: int, *, buffer_bytes: int, git_sha1: bool = False) -> None:
        self._fd = fd
        self.size_bytes = size_bytes
        self._buffer_limit = buffer_bytes
        self._sha256 = hashlib.sha256()
        self._sha1 = hashlib.sha1(b"blob %d\0" % size_bytes) if git_sha1 else None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued_bytes = 0  # data bytes sitting in the queue (memory held)
        self.frontier = 0
        self.reread_bytes = 0
        self._pending: dict[int, bytes | list[bytes]] = {}
        self._pending_bytes = 0
        self._on_disk: dict[int, int] = {}  # start -> end of intervals to read back
        self._error: BaseException | None = None
        self._abort = False
        self._thread = threading.Thread(target=self._run, name="hotfit-hash", daemon=True)
        self._thread.start()

    def feed(self, offset: int, data: bytes | list[bytes]) -> None:
        n = len(data) if isinstance(data, bytes) else sum(map(len, data))
        with self._lock:
            over = self._queued_bytes + n > self._buffer_limit
            if not over:
                self._queued_bytes += n
        if over:  # bound memory: the bytes are on disk already, read them back later
            self._queue.put((offset, offset + n, None))
        else:
            self._queue.put((offset, offset + n, data))

    def mark_on_disk(self, start: int, end: int) -> None:
        if end > start:
            self._queue.put((start, end, None))

    def _hash(self, data: bytes | list[bytes]) -> None:
        for part in [data] if isinstance(data, bytes) else data:
            self._sha256.update(part)
            if self._sha1 is not None:
                self._sha1.update(part)

    @staticmethod
    def _size(data: bytes | list[bytes]) -> int:
        return len(data) if isinstance(data, bytes) else sum(map(len, data))

    def _read_back(self, start: int, end: int) -> None:
        pos = start
        while pos < end:
            chunk = os.pread(self._fd, min(8 * MiB, end - pos), pos)
            if not chunk:
                raise OSError(errno.EIO, f"short read at byte {pos} while hashing")
            self._hash(chunk)
            pos += len(chunk)
        self.reread_bytes += end - start

    def _drain(self) -> None:
        while True:
            data = self._pending.pop(self.frontier, None)
            if data is not None:
                n = self._size(data)
                self._pending_bytes -= n
                self._hash(data)
                self.frontier += n
                continue
            end = self._on_disk.pop(self.frontier, None)
            if end is not None:
                self._read_back(self.frontier, end)
                self.frontier = end
                continue
            return

    def _run(self) -> None:
        try:
            while True:
                item = self._queue.get()
                if item is self._STOP or self._abort:
                    return
                start, end, data = item
                if data is not None:
                    with self._lock:
                        self._queued_bytes -= end - start
                if end <= self.frontier:
                    continue  # already hashed (cannot happen with a correct caller; harmless)
                if start < self.frontier:  # overlap: keep only the unhashed tail
                    if data is not None:
                        data = (data if isinstance(data, bytes) else b"".join(data))[self.frontier - start:]
                    start = self.frontier
                if start == self.frontier:
                    if data is not None:
                        self._hash(data)
                    else:
                        self._read_back(start, end)
                    self.frontier = end
                    self._drain()
                elif data is not None and self._pending_bytes + (end - start) <= self._buffer_limit:
                    self._pending[start] = data
                    self._pending_bytes += end - start
                else:
                    self._on_disk[start] = end
        except BaseException as exc:  # surfaced by finish()
            self._error = exc

    def abort(self) -> None:
        self._abort = True
        self._queue.put(self._STOP)

    def finish(self) -> tuple[str, str | None]:
        """Block until every byte is hashed; (sha256 hex, git sha1 hex or None)."""
        self._queue.put(self._STOP)
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self.frontier != self.size_bytes:
            raise TransferError(f"internal: hashed {self.frontier} of {self.size_bytes} bytes",
                                hint="rerun; the partial file resumes")
        return self._sha256.hexdigest(), (self._sha1.hexdigest() if self._sha1 else None)


class NoHasher(OrderedHasher):
    """Benchmark baseline only (``TransferOptions.hash_while_streaming=False``)."""

    def __init__(self) -> None:  # noqa: D107 - no thread, no state
        self.reread_bytes = 0

    def feed(self, offset: int, data: bytes | list[bytes]) -> None:
        pass

    def mark_on_disk(self, start: int, end: int) -> None:
        pass

    def abort(self) -> None:
        pass

    def finish(self) -> tuple[str, str | None]:
        return "", None

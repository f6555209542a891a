"""The file's write-behind threads: received bytes written in place, then hashed in order.

Why threads: on one stream the event loop was the bound (scripts/bench-download: the HTTP parser,
``recv`` and a ``pwritev`` of every chunk all on one core). Bytes are received off the loop
(``download.wire``); one thread per file writes each chunk at its offset (``pwrite`` in pieces, GIL released),
starts its writeback and counts it in its block's ``done`` (so a checkpoint claims only written
bytes); a second thread hashes it (sha256 releases the GIL too), so on one stream the write and the
hash of successive chunks overlap instead of adding up (sha256 alone is ~0.6 s/GiB on one core).
Memory is bounded: receivers wait for one of the file's ``WRITE_QUEUE_BYTES`` of receive buffers,
which come back once their bytes are written and hashed.

sha256 must see bytes in order, ranges arrive out of order. The thread keeps the frontier: chunks at
it are hashed as they arrive; chunks ahead of it wait in a bounded memory buffer
(``hash_buffer_bytes``) and are hashed once the frontier reaches them; what does not fit is
*spilled* — already on disk, read back once when the frontier arrives (hot in the page cache:
written moments before). On resume the bytes already on disk are read back once. Every byte read
back is counted in ``reread_bytes``; no second pass over a completed file ever happens.
"""

from __future__ import annotations

import errno
import hashlib
import os
import queue
import threading
from typing import Any, Callable, Protocol

from hotfit.core.errors import TransferError
from hotfit.download.disk import start_writeback
from hotfit.download.wire import BufferPool

MiB = 1024 * 1024
# What the loop may have received but the thread not yet written: memory held, and at most this much
# is lost to a kill -9 beyond what the last checkpoint did not claim anyway.
WRITE_QUEUE_BYTES = 16 * MiB
# One pwrite's size, not one receive buffer's: the kernel sizes a new page-cache folio by the write
# (large folios: ext4 since Linux 6.16; this VM runs 6.18), and large ones come from the large free
# blocks a VM with free-page reporting has handed back to its host, so every first touch faults
# there. scripts/bench-download on such a VM (Firecracker, page_reporting_order 9), one stream, two
# runs: 64 KiB writes 1046-1139 MB/s, one 1 MiB write per buffer 495-526, curl (16 KiB writes)
# 872-878. README "Measured".
WRITE_PIECE_BYTES = 64 * 1024
Data = bytes | list[bytes]


class Counted(Protocol):
    done: int


class OrderedHasher:
    """sha256 (and optionally git blob sha1) of a file whose bytes arrive out of order.

    ``write(offset, parts, n, block)`` hands the thread ``n`` bytes *not yet* written: it writes them
    at ``offset``, adds them to ``block.done``, then hashes them. A failed write is kept in
    ``write_error`` (later writes are dropped) for the loop to raise. ``feed(offset, data)`` is for
    bytes already on disk at ``offset``: hashed, buffered (bounded by ``buffer_bytes``) or, past the
    bound, read back with ``pread`` when the frontier reaches them (counted in ``reread_bytes``).
    ``mark_on_disk(start, end)`` declares bytes written by an earlier run (resume).
    ``hashing=False`` (the benchmark's download-alone baseline) only writes.
    """

    _STOP = object()

    def __init__(self, fd: int, size_bytes: int, *, buffer_bytes: int, git_sha1: bool = False,
                 hashing: bool = True) -> None:
        self._fd = fd
        self.size_bytes = size_bytes
        self._hashing = hashing
        self._buffer_limit = buffer_bytes
        self._sha256 = hashlib.sha256()
        self._sha1 = hashlib.sha1(b"blob %d\0" % size_bytes) if git_sha1 else None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued_bytes = 0  # fed data bytes sitting in the queue (memory held)
        self._cond = threading.Condition()
        self._write_queued = 0  # bytes handed to write() and not yet written (or dropped)
        self.write_error: tuple[OSError, int] | None = None  # the failed write and the offset it reached
        self._stopped = False
        self.frontier = 0
        self.reread_bytes = 0
        self._pending: dict[int, Data] = {}
        self._pending_bytes = 0
        self._on_disk: dict[int, int] = {}  # start -> end of intervals to read back
        self._error: BaseException | None = None
        self._abort = False
        self._buffers: BufferPool | None = None
        self._hash_queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._hash_queued = 0  # written bytes not yet hashed (their buffers are still held)
        self._hash_stopped = False
        self._thread = threading.Thread(target=self._run, name="hotfit-write", daemon=True)
        self._hash_thread = threading.Thread(target=self._run_hash, name="hotfit-hash", daemon=True)
        self._thread.start()
        self._hash_thread.start()

    # ---------------------------------------------------------------- called from the event loop

    def write(self, offset: int, parts: list[Any], n: int, block: Counted,
              release: Callable[[], None] | None = None) -> None:
        """Thread-safe (the loop or a receiving thread). ``release``: the parts are views of a reused
        buffer, called once the thread is done with them (bytes it must keep for later are copied)."""
        with self._cond:
            self._write_queued += n
        self._queue.put(("w", offset, parts, n, block, release))

    def receive_buffers(self, size_bytes: int) -> BufferPool:
        """The file's receive buffers (shared by its connections): ``WRITE_QUEUE_BYTES`` in all, so
        received-but-unwritten bytes stay bounded per file, as the loop's wait bounded them."""
        with self._lock:
            if self._buffers is None or self._buffers.size_bytes != size_bytes:
                self._buffers = BufferPool(WRITE_QUEUE_BYTES // max(1, size_bytes), size_bytes)
            return self._buffers

    @property
    def write_queued_bytes(self) -> int:
        """Bytes handed over and still held: not yet written, or written and not yet hashed."""
        return self._write_queued + self._hash_queued

    @property
    def thread_error(self) -> BaseException | None:
        """What stopped a thread (a read-back that failed): nothing handed over after it is hashed."""
        return self._error

    def wait_written(self, below_bytes: int = 0) -> None:
        """Block (in a worker thread) until at most ``below_bytes`` are held (:attr:`write_queued_bytes`),
        or a thread has stopped."""
        with self._cond:
            self._cond.wait_for(lambda: self._write_queued + self._hash_queued <= below_bytes or self._stopped
                                or self._hash_stopped)

    def feed(self, offset: int, data: Data) -> None:
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

    def abort(self) -> None:
        self._abort = True
        self._queue.put(self._STOP)

    def finish(self) -> tuple[str, str | None]:
        """Block until every byte is written and hashed; (sha256 hex, git sha1 hex or None)."""
        self._queue.put(self._STOP)
        self._thread.join()
        self._hash_thread.join()
        if self._error is not None:
            raise self._error
        if not self._hashing:
            return "", None
        if self.frontier != self.size_bytes:
            raise TransferError(f"internal: hashed {self.frontier} of {self.size_bytes} bytes",
                                hint="rerun; the partial file resumes")
        return self._sha256.hexdigest(), (self._sha1.hexdigest() if self._sha1 else None)

    # ---------------------------------------------------------------- the threads

    def _run(self) -> None:
        """The write thread: write each chunk, count it, pass it on to the hash thread in order."""
        try:
            while True:
                item = self._queue.get()
                if item is self._STOP or self._abort:
                    return
                if item[0] == "w":
                    _w, offset, parts, n, block, release = item
                    hashing = self._hashing
                    if hashing:  # counted before the write's own count drops: never a moment of "nothing held"
                        with self._cond:
                            self._hash_queued += n
                    ok = False
                    try:
                        ok = self._write(offset, parts, n, block) and hashing
                    finally:
                        if not ok:
                            if hashing:
                                with self._cond:
                                    self._hash_queued -= n
                                    self._cond.notify_all()
                            if release is not None:
                                release()
                    if ok:
                        self._hash_queue.put(("h", offset, n, parts, release))
                    continue
                self._hash_queue.put(item)  # bytes already on disk: hashed in file order with the rest
        except BaseException as exc:  # surfaced by finish()
            self._error = exc
        finally:
            self._hash_queue.put(self._STOP)
            with self._cond:
                self._stopped = True
                self._cond.notify_all()

    def _run_hash(self) -> None:
        """The hash thread: sha256 runs beside the writes (one stream's pwrite and hash overlap)."""
        try:
            while True:
                item = self._hash_queue.get()
                if item is self._STOP or self._abort:
                    return
                if item[0] == "h":
                    _h, offset, n, parts, release = item
                    try:
                        self._take(offset, offset + n, parts, borrowed=release is not None)
                    except BaseException as exc:
                        self._error = exc  # before the count drops below: a waiter that wakes must see it
                        raise
                    finally:
                        if release is not None:
                            release()
                        with self._cond:
                            self._hash_queued -= n
                            self._cond.notify_all()
                    continue
                start, end, data = item
                if data is not None:
                    with self._lock:
                        self._queued_bytes -= end - start
                if self._hashing:
                    self._take(start, end, data)
        except BaseException as exc:  # surfaced by finish(), and by the loop's next check
            self._error = exc
        finally:
            with self._cond:
                self._hash_stopped = True
                self._cond.notify_all()

    def _write(self, offset: int, parts: list[bytes], n_todo: int, block: Counted) -> bool:
        """Write ``parts`` at ``offset`` in ``WRITE_PIECE_BYTES`` pieces; False after a failed write
        (this one or an earlier one)."""
        n = 0
        try:
            if self.write_error is not None:
                return False
            try:
                for part in parts:
                    view = memoryview(part)
                    at = 0
                    while at < len(view):  # a short write (file-size limit, disk full) goes on where it stopped
                        wrote = os.pwrite(self._fd, view[at:at + WRITE_PIECE_BYTES], offset + n)
                        at += wrote
                        n += wrote
            except OSError as exc:
                self.write_error = (exc, offset + n)
                block.done += n  # what did land is kept and counted (not hashed: the download fails)
                return False
            start_writeback(self._fd, offset, n_todo)
            block.done += n_todo
            return True
        finally:
            with self._cond:
                self._write_queued -= n_todo
                self._cond.notify_all()

    def _hash(self, data: Data) -> None:
        for part in [data] if isinstance(data, bytes) else data:
            self._sha256.update(part)
            if self._sha1 is not None:
                self._sha1.update(part)

    @staticmethod
    def _size(data: Data) -> int:
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

    def _take(self, start: int, end: int, data: Data | None, borrowed: bool = False) -> None:
        """Bytes ``[start, end)`` are on disk (``data`` in memory, or None): hash, hold or spill them.
        ``borrowed``: ``data`` views a buffer that is reused after this call, so what is held is copied."""
        if end <= self.frontier:
            return  # already hashed (cannot happen with a correct caller; harmless)
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
            self._pending[start] = b"".join(data) if borrowed and not isinstance(data, bytes) else data
            self._pending_bytes += end - start
        else:
            self._on_disk[start] = end

"""Advisory file locks between hotfit processes (``fcntl.flock``), naming their holder.

One primitive for every "only one writer" rule:

- fetch-weights / fetch-template / verify take one lock **per target file**
  (``<model dir>/.partial/<file>.lock``), so two processes never write one partial file;
- the pipeline takes ``<home>/pipeline.lock`` (``Settings.lock_path``): one pipeline per home.

Semantics:

- ``FileLock(path, wait=False).acquire()`` takes an exclusive ``flock`` on ``path`` (created if
  missing, parents too) and writes the holder's PID and command line into it, so the *next*
  process can say who holds it. The kernel drops a ``flock`` when its holder dies (``kill -9``,
  crash, reboot), so a stale lock never blocks: a dead holder's text is simply overwritten.
- Held by another process: ``wait=False`` raises :class:`core.errors.LockedError` naming the
  holder PID and command; ``wait=True`` polls until it is free (``timeout_s`` bounds the wait,
  then ``LockedError`` too). Polling — not a blocking ``flock`` in a thread — keeps the wait
  cancellable from anyio (``acquire_async``) and from SIGINT.
- ``release()`` empties the file and unlocks it. The file itself is never deleted: unlinking a
  flock'd file races with a process that has it open and is about to lock the old inode.
- Locks are per open file description: the same process taking the same path twice through two
  ``FileLock`` objects conflicts with itself (as two processes would). Not re-entrant.

Use as ``with FileLock(p, wait=args.wait): ...`` or ``async with FileLock(p).async_held(): ...``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Generator

import anyio

from hotfit.core.diskspace import write_failure
from hotfit.core.errors import LockedError
from hotfit.core.log import get_logger
from hotfit.state.files import checked_write_path

__all__ = ["FileLock", "LockHolder", "current_holder", "read_holder"]

log = get_logger()

POLL_INTERVAL_S = 0.1  # short: waiting for a lock is rare and the holder may finish any moment
_MAX_HOLDER_TEXT_BYTES = 4096  # holder line is ours; a bigger file is not trusted past this


@dataclass(frozen=True)
class LockHolder:
    """What a lock file says about its holder (may be stale if the holder is gone)."""

    pid: int | None
    command: str

    def describe(self) -> str:
        return f"PID {self.pid} ({self.command})" if self.pid is not None else "an unknown process"


def read_holder(path: Path) -> LockHolder:
    """Parse ``"<pid> <command>"`` from a lock file; unreadable or empty → pid None."""
    try:
        with open(path, "rb") as fh:
            text = fh.read(_MAX_HOLDER_TEXT_BYTES).decode("utf-8", "replace").strip()
    except OSError:
        return LockHolder(None, "")
    pid_text, _, command = text.partition(" ")
    try:
        return LockHolder(int(pid_text), command)
    except ValueError:
        return LockHolder(None, text)


def _flock_owners(path: Path) -> list[int] | None:
    """PIDs holding a ``flock`` on ``path``'s inode, from ``/proc/locks`` (None: it cannot be read)."""
    try:
        st = os.stat(path)
        with open("/proc/locks", encoding="ascii", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    owners = []
    for line in lines:  # "1: FLOCK  ADVISORY  WRITE 4242 fe:00:5343811 0 EOF"
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode and fields[4].lstrip("-").isdigit():
            owners.append(int(fields[4]))
    return owners


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def current_holder(path: Path) -> LockHolder | None:
    """Who holds the lock at ``path`` now, without taking it (a reader must never make a writer fail),
    or None. The PID a lock file names is trusted only while the kernel says that process holds the
    lock: after a ``kill -9`` the file still names the dead holder, whose PID may since be another
    process's. Where ``/proc/locks`` cannot be read, a live PID is taken at its word."""
    holder = read_holder(path)
    if holder.pid is None or holder.pid == os.getpid():
        return None
    owners = _flock_owners(path)
    if owners is None:
        return holder if _pid_alive(holder.pid) else None
    return holder if holder.pid in owners else None


def _current_command() -> str:
    return " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:512]


class FileLock:
    """An exclusive ``flock`` on ``path`` that records its holder (see the module docstring)."""

    def __init__(self, path: os.PathLike[str] | str, *, wait: bool = False,
                 timeout_s: float | None = None, what: str | None = None) -> None:
        self.path = Path(path)
        self.wait = wait
        self.timeout_s = timeout_s
        self.what = what or str(self.path)  # used in the error message ("model dir X", "home Y")
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _open(self) -> int:
        checked_write_path(self.path)  # never a lock through a symlink, nor a directory (docs/faults.md)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)

    def _try_lock(self, fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def _claim(self, fd: int) -> None:
        holder = f"{os.getpid()} {_current_command()}\n".encode()
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder, 0)
        except OSError as exc:
            fcntl.flock(fd, fcntl.LOCK_UN)
            if (mapped := write_failure(exc, self.path, needed_bytes=len(holder), what="the lock file")) is not None:
                raise mapped from None
            raise
        self._fd = fd

    def _locked_error(self) -> LockedError:
        holder = read_holder(self.path)
        return LockedError(
            f"{self.what} is locked by {holder.describe()}",
            hint="wait for it to finish, or rerun with --wait to queue behind it",
            lock=str(self.path), holder_pid=holder.pid, holder_command=holder.command,
        )

    def _attempts(self) -> Generator[None, None, None]:
        """Try the lock; yield once per busy attempt (the caller sleeps, sync or async), return
        holding it. Not waiting, or past the deadline, raises LockedError naming the holder."""
        if self._fd is not None:
            raise RuntimeError(f"lock {self.path} already held by this object")
        fd = self._open()
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        waited = False
        try:
            while not self._try_lock(fd):
                if not self.wait or (deadline is not None and time.monotonic() >= deadline):
                    raise self._locked_error()
                if not waited:  # an operator watching the log sees why nothing happens yet
                    waited = True
                    holder = read_holder(self.path)
                    log.info("lock.wait", lock=str(self.path), holder_pid=holder.pid,
                             holder_command=holder.command)
                yield
            self._claim(fd)
        except BaseException:  # GeneratorExit too: a cancelled async wait closes the fd
            if self._fd is None:
                os.close(fd)
            raise

    def acquire(self) -> "FileLock":
        """Take the lock (blocking poll when ``wait``); raises LockedError otherwise."""
        for _ in self._attempts():
            time.sleep(POLL_INTERVAL_S)
        return self

    async def acquire_async(self) -> "FileLock":
        """As :meth:`acquire`, but waits with ``anyio.sleep`` so the wait can be cancelled."""
        attempts = self._attempts()
        try:
            for _ in attempts:
                await anyio.sleep(POLL_INTERVAL_S)
        finally:
            attempts.close()
        return self

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            # Emptying the holder line is a courtesy (a reader trusts a PID only while the kernel
            # shows it holding the flock: current_holder). On a disk that failed or turned read-only
            # it fails too, and must not replace the error that is unwinding through this release.
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> "FileLock":
        return self.acquire()

    def __exit__(self, *_exc: object) -> None:
        self.release()

    @contextlib.asynccontextmanager
    async def async_held(self) -> AsyncIterator["FileLock"]:
        await self.acquire_async()
        try:
            yield self
        finally:
            self.release()

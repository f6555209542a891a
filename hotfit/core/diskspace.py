"""Out of disk space, or a disk that refuses writes, wherever it strikes: the one DiskSpaceError
(exit 4) naming the path, the bytes being written and the bytes free, and the one DiskWriteError
(exit 4) naming the path, the errno and the mount to remount (docs/faults.md).

Every writer hotfit has (a partial's bytes, a resume sidecar, a receipt, a template, the manifest,
the state database, the event log, a lock) maps ENOSPC / EDQUOT / EFBIG, and EROFS / EIO, here
(:func:`write_failure`), so an operator reads the same facts whichever file met the fault, and
nothing is a traceback.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import TypeGuard

from hotfit.core.errors import DiskSpaceError, DiskWriteError, TransferError

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
# A filesystem the kernel turned read-only (after a disk error, ext4's errors=remount-ro) or a disk
# failing under a write: nothing hotfit can free makes room, the operator must repair and remount.
UNWRITABLE_ERRNOS = (errno.EROFS, errno.EIO)
RERUN_HINT = ("free space on that filesystem (or point --home / HOTFIT_HOME at a larger one), then rerun the "
              "same command: partial downloads are kept and resume where they stopped")


def is_disk_full(exc: BaseException) -> TypeGuard[OSError]:
    """An OSError that says the disk (or quota, or file-size limit) is full."""
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


def free_bytes(path: Path | str) -> int:
    """Free bytes for this user on the filesystem that holds (or will hold) ``path``; 0 when unknown."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def disk_full_error(path: Path | str, *, needed_bytes: int | None, what: str, errno_: int | None = errno.ENOSPC,
                    **details: object) -> DiskSpaceError:
    """The error for ``what`` (e.g. "the resume sidecar") that could not write ``needed_bytes`` at
    ``path``: it names both, and the bytes free now (``needed_bytes`` None: not known)."""
    free = free_bytes(path)
    reason = "file size limit reached" if errno_ == errno.EFBIG else "disk full"
    need = "" if needed_bytes is None else f"need {max(0, needed_bytes)} bytes, "
    return DiskSpaceError(
        f"{reason} writing {what} {path}: {need}{free} free",
        hint=RERUN_HINT, path=str(path), needed_bytes=None if needed_bytes is None else max(0, needed_bytes),
        free_bytes=free, errno=errno_, **details)


def from_os_error(exc: OSError, path: Path | str | None, *, needed_bytes: int | None, what: str,
                  **details: object) -> DiskSpaceError:
    """:func:`disk_full_error` for an OSError already caught (its own file name when ``path`` is None)."""
    where = path if path is not None else (exc.filename or "?")
    return disk_full_error(where, needed_bytes=needed_bytes, what=what, errno_=exc.errno, **details)


def is_write_failure(exc: BaseException) -> TypeGuard[OSError]:
    """An OSError a disk gives a writer: full (:data:`DISK_FULL_ERRNOS`) or refusing (:data:`UNWRITABLE_ERRNOS`)."""
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS + UNWRITABLE_ERRNOS


def mount_point(path: Path | str) -> Path:
    """The mount that holds (or would hold) ``path``: what an operator remounts."""
    probe = Path(os.path.abspath(path))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    while not os.path.ismount(probe) and probe != probe.parent:
        probe = probe.parent
    return probe


def refused_errno(path: Path | str) -> int:
    """EROFS when the filesystem holding ``path`` is mounted read-only now, else EIO: for a writer
    (SQLite) that reports a refused write without its errno."""
    try:
        return errno.EROFS if os.statvfs(mount_point(path)).f_flag & os.ST_RDONLY else errno.EIO
    except OSError:
        return errno.EIO


def unwritable_error(path: Path | str, *, what: str, errno_: int | None, **details: object) -> DiskWriteError:
    """The error for ``what`` at ``path`` that the filesystem refused: read-only (EROFS) or an I/O
    error (EIO). Names the path, the errno and the mount, and says the rerun resumes."""
    mount = mount_point(path)
    if errno_ == errno.EROFS:
        reason = f"the filesystem at {mount} is read-only (EROFS; the kernel does this after a disk error)"
        fix = f"check the disk (dmesg), remount {mount} read-write (mount -o remount,rw {mount})"
    else:
        reason = f"the disk under {mount} failed the write (EIO, an I/O error)"
        fix = f"check the disk (dmesg, fsck), make {mount} writable again"
    return DiskWriteError(
        f"cannot write {what} {path}: {reason}",
        hint=f"the downloaded bytes are kept; {fix} and rerun the same command: it resumes",
        path=str(path), mount=str(mount), errno=errno.errorcode.get(errno_ or 0, errno_), **details)


def write_failure(exc: OSError, path: Path | str | None, *, needed_bytes: int | None, what: str,
                  **details: object) -> TransferError | None:
    """The one mapping of a writer's OSError: DiskSpaceError for a full disk, DiskWriteError for a
    read-only or failing one, None for anything else (the caller re-raises it). ``path`` None: the
    error's own file name."""
    if exc.errno in DISK_FULL_ERRNOS:
        return from_os_error(exc, path, needed_bytes=needed_bytes, what=what, **details)
    if exc.errno in UNWRITABLE_ERRNOS:
        return unwritable_error(path if path is not None else (exc.filename or "?"), what=what, errno_=exc.errno,
                                **details)
    return None

"""Out of disk space, wherever it strikes: the one DiskSpaceError (exit 4) naming the path, the bytes
being written and the bytes free (docs/faults.md).

Every writer hotfit has (a partial's bytes, a resume sidecar, a receipt, a template, the manifest,
the state database, the event log) maps ENOSPC / EDQUOT / EFBIG here, so an operator reads the same
facts whichever file filled the disk, and nothing is a traceback.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import TypeGuard

from hotfit.core.errors import DiskSpaceError

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
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

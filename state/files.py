"""Durable file writes: a reader, a crash or a power cut sees the old file or the new one.

One implementation for every small file hotfit writes in place (manifest, registry lock, saved
probe, template, receipts, download sidecars) and for renaming a verified download into place;
and one reader of such a file (:func:`read_text_document`) whose failures are the format's error.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from contextlib import suppress
from pathlib import Path
from typing import Literal, overload

from core.errors import UsageError
from core.records import DocumentFail


def unusable_home(home: Path, named: str, reason: str, **details: object) -> UsageError:
    """The one error for a home hotfit cannot write (exit 2), whichever step found it."""
    return UsageError(
        f"{named} cannot be used as hotfit's home: {reason}",
        hint="point --home (or HOTFIT_HOME) at a directory this user can write, e.g. ~/.local/share/hotfit "
             "(created with its parents if missing)",
        home=str(home), **details)


def prepare_home(home: Path, named: str, logs_dir: Path) -> None:
    """Create ``home`` and its ``logs_dir`` (parents too) and check the home is a writable directory.

    Every command appends to the event log, so this runs before any of them: a regular file, a
    read-only or missing parent that cannot be created, or a pseudo-filesystem (``/proc``) is one
    UsageError naming the home, never a traceback from wherever the first write happened to be.
    """
    if home.exists() and not home.is_dir():
        raise unusable_home(home, named, "it is not a directory", errno=errno.ENOTDIR)
    try:
        logs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        where = f" (at {exc.filename})" if exc.filename and str(exc.filename) != str(logs_dir) else ""
        raise unusable_home(home, named, f"cannot create {logs_dir}: {exc.strerror or exc}{where}",
                            errno=exc.errno) from None
    if not os.access(home, os.W_OK | os.X_OK) or not os.access(logs_dir, os.W_OK | os.X_OK):
        raise unusable_home(home, named, "this user cannot write there (read-only filesystem or permissions)",
                            errno=errno.EACCES)


@overload
def read_text_document(path: Path, fail: DocumentFail, *, missing_ok: Literal[False] = ...) -> str: ...
@overload
def read_text_document(path: Path, fail: DocumentFail, *, missing_ok: bool) -> str | None: ...


def read_text_document(path: Path, fail: DocumentFail, *, missing_ok: bool = False) -> str | None:
    """The UTF-8 text of a small file hotfit reads whole (registry, manifest, probe file, receipt).

    A file that cannot be read, or is not UTF-8, is ``fail``'s error (the format names itself and
    the fix); a missing file is None when ``missing_ok`` (the manifest: nothing provisioned yet)."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        if missing_ok:
            return None
        raise fail(f"cannot be read ({exc.strerror or exc})", "pass an existing file") from None
    except OSError as exc:
        raise fail(f"cannot be read ({exc.strerror or exc})", "pass a file this user can read") from None
    except UnicodeDecodeError as exc:
        raise fail(f"not UTF-8 text (byte {exc.start}); it must be a JSON file",
                   "pass the JSON file hotfit wrote (or a copy of it)") from None


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (the directory entry is data too)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str, *, durable: bool = True) -> None:
    """Write ``text`` beside ``path`` and rename it over ``path``, keeping an existing file's mode.

    ``durable`` fsyncs the data and the directory, so the new content survives a power cut.
    Without it (frequent checkpoints whose loss only costs a little redone work) the rename is
    still atomic, so a reader never sees half a file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o644
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.chmod(tmp_name, mode)
        os.replace(tmp_name, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    if durable:
        fsync_dir(path.parent)


def finalize_file(partial: Path, final: Path) -> None:
    """fsync a finished file, rename it into place atomically, fsync the directory."""
    final.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(partial, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(partial, final)
    fsync_dir(final.parent)

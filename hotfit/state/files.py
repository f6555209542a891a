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
from typing import Any, Literal, overload

from hotfit.core.diskspace import refused_errno, unwritable_error, write_failure
from hotfit.core.errors import UsageError
from hotfit.core.records import DocumentFail

# The home every write is confined to (:func:`checked_write_path`); set by :func:`prepare_home`,
# which every command runs first. The home itself may be a symlink (an operator's choice); nothing
# below it may be.
_confine_root: Path | None = None


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
    if home_is_read_only(home) and refused_errno(home) == errno.EROFS:
        # a filesystem turned read-only (after a disk error): the same exit 4 and repair as mid-run
        raise unwritable_error(home, what="hotfit's home", errno_=errno.EROFS)
    try:
        logs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        where = f" (at {exc.filename})" if exc.filename and str(exc.filename) != str(logs_dir) else ""
        raise unusable_home(home, named, f"cannot create {logs_dir}: {exc.strerror or exc}{where}",
                            errno=exc.errno) from None
    if not os.access(home, os.W_OK | os.X_OK) or not os.access(logs_dir, os.W_OK | os.X_OK):
        raise unusable_home(home, named, "this user cannot write there (read-only filesystem or permissions)",
                            errno=errno.EACCES)
    confine_writes_to(home)
    checked_write_path(logs_dir, kind="directory")


def rehome_paths(value: Any, old_home: str, new_home: str) -> Any:
    """``value`` (a JSON document) with every path under ``old_home`` moved under ``new_home``: what a
    home copied with ``cp -a`` (or moved) recorded about itself — the manifest's files, a stage's
    results — names its own files again, not the original home's (docs/faults-state.md)."""
    if isinstance(value, str):
        if value == old_home or value.startswith(old_home.rstrip("/") + "/"):
            return new_home + value[len(old_home.rstrip("/")):]
        return value
    if isinstance(value, list):
        return [rehome_paths(v, old_home, new_home) for v in value]
    if isinstance(value, dict):
        return {k: rehome_paths(v, old_home, new_home) for k, v in value.items()}
    return value


def same_directory(a: str | Path, b: str | Path) -> bool:
    """``a`` and ``b`` name one directory (equal, or one a symlink to the other); False when either is gone."""
    if os.path.abspath(a) == os.path.abspath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def home_is_read_only(home: Path) -> bool:
    """The home is a directory this user cannot write: its filesystem is read-only (after a disk
    error), or permissions. A reader (``hotfit status``) still reads it (docs/faults-state.md)."""
    return home.is_dir() and not os.access(home, os.W_OK | os.X_OK)


def confine_writes_to(home: Path | None) -> None:
    """Make :func:`checked_write_path` refuse symlinks anywhere below ``home`` (None: no home known,
    only the path's own last component is checked)."""
    global _confine_root
    _confine_root = None if home is None else Path(os.path.abspath(home))


def _unsafe(path: Path, problem: str, fix: str) -> UsageError:
    return UsageError(f"{path} {problem}; hotfit writes nothing through a symlink or outside its home",
                      hint=fix, path=str(path), field="path")


def checked_write_path(path: Path, *, kind: Literal["file", "directory"] = "file") -> Path:
    """The one check before hotfit writes, creates, renames onto or locks ``path`` (docs/faults.md):
    no component from the home down to ``path`` is a symlink, each existing one is a directory, and
    what is at ``path`` is a ``kind`` (a missing one is fine). A path outside the home (a registry file
    an operator named) is only checked for its type; with no home known (a library caller), the last
    component is checked. UsageError (exit 2) names the path.
    Writes then open with O_NOFOLLOW where they can, so a symlink made after this check fails too."""
    target = Path(os.path.abspath(path))
    root = _confine_root
    chain: list[Path] = [target]
    follow = False
    if root is not None and target != root and target.is_relative_to(root):
        chain = [root / Path(*target.relative_to(root).parts[:i + 1])
                 for i in range(len(target.relative_to(root).parts))]
    elif root is not None:
        follow = True  # outside the home: a file the operator named, wherever their symlink points
    for i, p in enumerate(chain):
        try:
            st = os.stat(p) if follow else os.lstat(p)
        except FileNotFoundError:
            return target  # nothing below a missing component exists yet
        except NotADirectoryError:
            raise _unsafe(p, "is below a file, not a directory", f"remove {p.parent} (it is not hotfit's)") from None
        last = i == len(chain) - 1
        if stat.S_ISLNK(st.st_mode):
            raise _unsafe(p, f"is a symlink (to {os.readlink(p)!r})",
                          f"remove the symlink {p} and rerun; to keep models on another disk point --home "
                          "(or HOTFIT_HOME) there instead")
        if not last and not stat.S_ISDIR(st.st_mode):
            raise _unsafe(p, "is not a directory", f"remove {p} (hotfit needs a directory there) and rerun")
        if last and kind == "directory" and not stat.S_ISDIR(st.st_mode):
            raise _unsafe(p, "is not a directory", f"remove {p} (hotfit needs a directory there) and rerun")
        if last and kind == "file" and not stat.S_ISREG(st.st_mode):
            what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise _unsafe(p, f"is {what}, where hotfit keeps a file",
                          f"remove {p} and rerun (a download resumes from what else is kept)")
    return target


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


def write_text_atomic(path: Path, text: str, *, durable: bool = True, what: str = "file") -> None:
    """Write ``text`` beside ``path`` and rename it over ``path``, keeping an existing file's mode.

    ``durable`` fsyncs the data and the directory, so the new content survives a power cut.
    Without it (frequent checkpoints whose loss only costs a little redone work) the rename is
    still atomic, so a reader never sees half a file. A full disk is DiskSpaceError naming ``what``
    (e.g. "receipt"), ``path`` and the bytes; the old file stays as it was.
    """
    checked_write_path(path)
    data = text.encode("utf-8")
    try:
        checked_write_path(path.parent, kind="directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o644
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        if (mapped := write_failure(exc, path, needed_bytes=len(data), what=what)) is not None:
            raise mapped from None
        raise
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.chmod(tmp_name, mode)
        os.replace(tmp_name, path)
    except BaseException as exc:
        with suppress(FileNotFoundError):
            os.unlink(tmp_name)
        if isinstance(exc, OSError) and (mapped := write_failure(exc, path, needed_bytes=len(data),
                                                                 what=what)) is not None:
            raise mapped from None
        raise
    if durable:
        fsync_dir(path.parent)


def finalize_file(partial: Path, final: Path) -> None:
    """fsync a finished file, rename it into place atomically, fsync the directory."""
    checked_write_path(partial)
    checked_write_path(final)
    checked_write_path(final.parent, kind="directory")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(partial, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(partial, final)
        fsync_dir(final.parent)
    except OSError as exc:  # the partial stays where it was: the rerun verifies it again
        if (mapped := write_failure(exc, final, needed_bytes=None, what="the verified download")) is not None:
            raise mapped from None
        raise

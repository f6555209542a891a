"""Durable file writes: a reader, a crash or a power cut sees the old file or the new one.

One implementation for every small file hotfit writes in place (manifest, registry lock, saved
probe, template, receipts, download sidecars) and for renaming a verified download into place.
"""

from __future__ import annotations

import os
import stat
import tempfile
from contextlib import suppress
from pathlib import Path


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

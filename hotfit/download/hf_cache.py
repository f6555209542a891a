"""Pinned files taken from the Hugging Face cache instead of the network (docs/network.md).

huggingface_hub's cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``;
``core.settings.default_hf_hub_cache``) keeps a repository's files as::

    models--{org}--{name}/blobs/<etag>                        the bytes (etag: sha256 for LFS files,
                                                              git blob sha1 otherwise)
    models--{org}--{name}/snapshots/<commit>/<path>  ->  ../../blobs/<etag>

Only ``snapshots/<pinned commit>/<path>`` is looked at (never a branch in ``refs/``), and it is trusted
only for what hotfit can check itself: the exact pinned size, then the pinned sha256 (or, where
nothing pins a sha256, the git blob id the cache names the blob by). The bytes reach the partial slot
as a hard link when the file is on the same filesystem, owned by this user and writable by no one
else (nothing else could then change the verified model through the cache's name); else as a copy,
hashed while it is copied. Either way the partial has no sidecar, so the download engine never writes
into it (it discards a sidecar-less partial before fetching), and verify then checks it like a
download. The cache is only read: nothing is written there.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hotfit.download.options import safe_relpath

_CHUNK_BYTES = 8 << 20
_SHA256_LEN, _SHA1_LEN = 64, 40


def repo_folder(cache_dir: Path, repo: str) -> Path:
    """``models--{org}--{name}`` (huggingface_hub's ``repo_folder_name`` for a model repository)."""
    return cache_dir / ("models--" + repo.replace("/", "--"))


def snapshot_path(cache_dir: Path, repo: str, commit: str, file: str) -> Path:
    return repo_folder(cache_dir, repo) / "snapshots" / commit / safe_relpath(file)


@dataclass(frozen=True)
class CacheHit:
    """A cached file now in the partial slot, checked."""

    source: str  # the snapshot path in the cache
    how: Literal["hardlink", "copy"]
    size_bytes: int
    sha256: str
    git_sha1: str | None


@dataclass(frozen=True)
class CacheMiss:
    """Why the cache did not serve a file; ``damaged`` ones are warned about (a present file that
    fails a check), absent ones are not."""

    source: str
    reason: str  # "absent" | "unverifiable" | "size" | "sha256" | "git_sha1" | "unreadable"
    detail: str = ""

    @property
    def damaged(self) -> bool:
        return self.reason not in ("absent", "unverifiable")


def _git_sha1_of_size(size: int) -> "hashlib._Hash":
    return hashlib.sha1(b"blob %d\0" % size)


def _link_allowed(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid() and not (st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _device_of(directory: Path) -> int:
    """The filesystem ``directory`` is (or will be, once created) on: its nearest existing ancestor's."""
    probe = Path(os.path.abspath(directory))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return os.stat(probe).st_dev


def cache_write_bytes(cache_dir: Path | None, *, repo: str, commit: str, file: str, size_bytes: int,
                      dest_dir: Path) -> int | None:
    """What :func:`take_from_cache` would write into ``dest_dir`` for the cached ``repo@commit/file``:
    0 when it hard-links (on the same filesystem, and the blob is one :func:`take_from_cache` links),
    ``size_bytes`` when it copies; None when the cache does not hold it at that size (it is downloaded).
    From the file's metadata only: its hash is checked when it is taken, and a file that fails then is
    downloaded under the engine's own per-file disk check (docs/faults.md, "A tight disk")."""
    if cache_dir is None:
        return None
    try:
        st = os.stat(snapshot_path(cache_dir, repo, commit, file))
        same_filesystem = st.st_dev == _device_of(dest_dir)
    except (OSError, ValueError):
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size != size_bytes:
        return None
    return 0 if same_filesystem and _link_allowed(st) else size_bytes


def _hash_file(path: Path, size: int, want_git: bool) -> tuple[str, str | None]:
    sha, git = hashlib.sha256(), (_git_sha1_of_size(size) if want_git else None)
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK_BYTES):
            sha.update(chunk)
            if git is not None:
                git.update(chunk)
    return sha.hexdigest(), git.hexdigest() if git is not None else None


def _copy_hashing(src: Path, dest: Path, size: int, want_git: bool) -> tuple[str, str | None]:
    sha, git = hashlib.sha256(), (_git_sha1_of_size(size) if want_git else None)
    with open(src, "rb") as fin, open(dest, "xb") as fout:
        while chunk := fin.read(_CHUNK_BYTES):
            sha.update(chunk)
            if git is not None:
                git.update(chunk)
            fout.write(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return sha.hexdigest(), git.hexdigest() if git is not None else None


def take_from_cache(cache_dir: Path | None, *, repo: str, commit: str, file: str, dest: Path,
                    size_bytes: int | None, sha256: str | None = None, git_sha1: str | None = None,
                    max_size_bytes: int | None = None) -> CacheHit | CacheMiss:
    """Put the cached ``repo@commit/file`` at ``dest`` (absent before the call) when it is exactly
    ``size_bytes`` (None: any size up to ``max_size_bytes``) and hashes to ``sha256`` — or, with no
    sha256 to check, to the git blob id ``git_sha1`` (the caller's, else the id or sha256 the cache
    names its blob by: what the Hub's ETag said). ``dest`` is removed again when a check fails.
    Blocking (reads the whole file once)."""
    source = snapshot_path(cache_dir, repo, commit, file) if cache_dir is not None else Path()
    shown = str(source)
    if cache_dir is None:
        return CacheMiss(shown, "absent")
    try:
        st = os.stat(source)  # follows the snapshot's symlink to the blob
    except OSError:
        return CacheMiss(shown, "absent")
    if not stat.S_ISREG(st.st_mode):
        return CacheMiss(shown, "absent")
    if size_bytes is not None and st.st_size != size_bytes:
        return CacheMiss(shown, "size", f"{st.st_size} bytes, the pin says {size_bytes}")
    if max_size_bytes is not None and st.st_size > max_size_bytes:
        return CacheMiss(shown, "size", f"{st.st_size} bytes, more than {max_size_bytes}")
    size = st.st_size
    if sha256 is None and git_sha1 is None:
        blob = os.path.basename(os.path.realpath(source))
        if len(blob) == _SHA1_LEN:  # a non-LFS file's blob is named by its git blob id
            git_sha1 = blob
        elif len(blob) == _SHA256_LEN:
            sha256 = blob
    if sha256 is None and git_sha1 is None:
        return CacheMiss(shown, "unverifiable", "nothing to check it against")
    real = Path(os.path.realpath(source))
    dest.parent.mkdir(parents=True, exist_ok=True)
    how: Literal["hardlink", "copy"] = "copy"
    try:
        if _link_allowed(st):
            try:
                os.link(real, dest)
                how = "hardlink"
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EACCES, errno.EMLINK, errno.ENOTSUP):
                    raise
        if how == "hardlink":
            got_sha, got_git = _hash_file(dest, size, git_sha1 is not None)
        else:
            got_sha, got_git = _copy_hashing(real, dest, size, git_sha1 is not None)
        if os.stat(dest).st_size != size:  # changed while it was read
            raise ValueError("size")
    except (OSError, ValueError) as exc:
        dest.unlink(missing_ok=True)
        return CacheMiss(shown, "unreadable", f"{type(exc).__name__}: {exc}")
    if sha256 is not None and got_sha != sha256:
        dest.unlink(missing_ok=True)
        return CacheMiss(shown, "sha256", f"sha256 {got_sha}, the pin says {sha256}")
    if sha256 is None and git_sha1 is not None and got_git != git_sha1:
        dest.unlink(missing_ok=True)
        return CacheMiss(shown, "git_sha1", f"git blob id {got_git}, expected {git_sha1}")
    return CacheHit(source=shown, how=how, size_bytes=size, sha256=got_sha, git_sha1=got_git)


def take_into_partial(cache_dir: Path | None, *, partial: Path, sidecar: Path, **checks: Any) -> CacheHit | CacheMiss:
    """:func:`take_from_cache` into the partial slot: staged beside it first, so a partial download
    in progress there (and its sidecar) gives way only to a complete file that passed the checks."""
    staged = partial.with_name(partial.name + ".hf-cache")
    staged.unlink(missing_ok=True)
    found = take_from_cache(cache_dir, dest=staged, **checks)
    if isinstance(found, CacheHit):
        sidecar.unlink(missing_ok=True)  # the sidecar first: a kill between leaves no claim on the bytes
        os.replace(staged, partial)
    return found

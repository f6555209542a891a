"""verify's OpenVINO half: a snapshot's hashed partials into place, and the placed directory re-confirmed.

:func:`place_snapshot` checks each file fetch-weights left (size, LFS sha256 or git blob id; the
streamed hash reused while the partial is the file that was hashed), renames it into
``<dest>/snapshot/`` with its receipt, drops files the commit no longer lists and writes
``snapshot.json``; :func:`verify_snapshot_dir` re-confirms a placed snapshot against that manifest.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from hotfit.core.errors import IntegrityError
from hotfit.core.log import get_logger
from hotfit.core.model_files import PARTIAL_DIRNAME, SNAPSHOT_DIRNAME, SNAPSHOT_MANIFEST, SnapshotResult, check_integrity
from hotfit.download import discard_partial, partial_paths, safe_relpath
from hotfit.state.files import finalize_file, write_text_atomic
from hotfit.state.receipts import Receipt, file_identity, write_receipt

log = get_logger()

__all__ = ["place_snapshot", "snapshot_commit", "verify_snapshot_dir"]


def _rehash(path: Path, *, git_blob: bool) -> tuple[str, str | None]:
    """(sha256, git blob id or None) in one read; the blob id is sha1 of ``blob <size>\\0`` + content."""
    sha256 = hashlib.sha256()
    sha1 = hashlib.sha1(b"blob %d\0" % path.stat().st_size) if git_blob else None
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            sha256.update(chunk)
            if sha1 is not None:
                sha1.update(chunk)
    return sha256.hexdigest(), sha1.hexdigest() if sha1 is not None else None


def place_snapshot(dest_dir: Path, snapshot: SnapshotResult, *, rehash: bool = False) -> int:
    """Check each hashed partial of an OpenVINO snapshot (size, LFS sha256 or git blob id; the
    streamed hash reused while the partial is unchanged), rename it into ``<dest>/snapshot/`` with its
    receipt, drop files the commit no longer lists, then write ``snapshot.json``. Returns files placed."""
    snap_dir = dest_dir / SNAPSHOT_DIRNAME
    placed = 0
    for sf in snapshot.listed:
        partial = Path(sf.partial_path) if sf.partial_path else None
        if partial is None or not partial.is_file():
            continue  # in place already (its receipt matched at fetch), or placed by an earlier verify
        git_blob = sf.lfs_sha256 is None
        if not rehash and sf.identity == file_identity(partial):
            sha, git_sha1 = sf.sha256, sf.git_sha1
        else:
            log.info("verify.rehash", file=sf.path, reason="forced" if rehash else "the partial changed since it was hashed")
            sha, git_sha1 = _rehash(partial, git_blob=git_blob)
        _p, sidecar, _l = partial_paths(dest_dir / PARTIAL_DIRNAME, snapshot.repo, sf.path)
        try:
            check_integrity(file=sf.path, size_bytes=partial.stat().st_size, sha256=sha, expected_size=sf.size_bytes,
                            registry_sha256=None, hub_sha256=sf.lfs_sha256, git_sha1=git_sha1,
                            hub_git_sha1=sf.blob_id if git_blob else None)
        except IntegrityError:
            discard_partial(partial, sidecar)
            raise
        finalize_file(partial, snap_dir / sf.path)
        write_receipt(dest_dir, Receipt(repo=snapshot.repo, revision=snapshot.commit, commit_listed=snapshot.commit,
                                        file=sf.path, size_bytes=sf.size_bytes, sha256=sha, git_sha1=git_sha1),
                      key=f"{SNAPSHOT_DIRNAME}/{sf.path}")
        discard_partial(partial, sidecar)
        placed += 1
    if not snapshot.listed:  # a record from before the snapshot's files were listed: nothing to place
        return 0
    # Files of an older snapshot that the current commit no longer lists are removed.
    keep = {sf.path for sf in snapshot.listed}
    if snap_dir.is_dir():
        for path in sorted(snap_dir.rglob("*"), reverse=True):
            if path.is_file() and path.relative_to(snap_dir).as_posix() not in keep:
                path.unlink()
    manifest = {"schema": 1, "repo": snapshot.repo, "revision_requested": snapshot.revision_requested,
                "commit": snapshot.commit,
                "files": [{"path": sf.path, "size_bytes": sf.size_bytes, "lfs_sha256": sf.lfs_sha256,
                           "blob_id": sf.blob_id} for sf in snapshot.listed]}
    write_text_atomic(dest_dir / SNAPSHOT_MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    return placed


def verify_snapshot_dir(dest_dir: Path, *, rehash: bool = False) -> tuple[int, int]:
    """Every file of ``snapshot.json`` present with its size (and, with ``rehash``, its hash)."""
    try:
        manifest = json.loads((dest_dir / SNAPSHOT_MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        raise IntegrityError(f"{dest_dir / SNAPSHOT_MANIFEST} is missing or unreadable",
                             hint="rerun `hotfit pull`", field="manifest") from None
    total = 0
    if not isinstance(files, list):
        files = None
    for f in files or [None]:
        # a manifest edited (or damaged) on disk must not crash the stage or point outside it
        try:
            rel = safe_relpath(f["path"])
            size = f["size_bytes"]
            if isinstance(size, bool) or not isinstance(size, int):
                raise TypeError(size)
        except (TypeError, KeyError, ValueError):
            raise IntegrityError(f"{dest_dir / SNAPSHOT_MANIFEST}: entry {f!r} is not a file of the snapshot",
                                 hint="rerun `hotfit pull` to fetch and record the snapshot again",
                                 field="manifest") from None
        path = dest_dir / SNAPSHOT_DIRNAME / rel
        if not path.is_file() or path.stat().st_size != size:
            raise IntegrityError(f"{path} is missing or has the wrong size", hint="rerun `hotfit pull`",
                                 field="size_bytes", file=str(path))
        if rehash:
            h = hashlib.sha256() if f.get("lfs_sha256") else hashlib.sha1(b"blob %d\0" % size)
            with open(path, "rb") as fh:
                while chunk := fh.read(8 << 20):
                    h.update(chunk)
            if h.hexdigest() != (f.get("lfs_sha256") or f.get("blob_id")):
                raise IntegrityError(f"{path}: hash differs from the Hub's", hint="rerun `hotfit pull`",
                                     field="sha256", file=str(path))
        total += size
    return total, len(files)


def snapshot_commit(dest_dir: Path) -> str | None:
    """The commit ``snapshot.json`` records for the snapshot in place (None: no readable manifest)."""
    try:
        commit = json.loads((dest_dir / SNAPSHOT_MANIFEST).read_text(encoding="utf-8")).get("commit")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return commit if isinstance(commit, str) else None

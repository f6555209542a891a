"""fetch-weights: the entry's pinned weights (and projector) as complete, hashed partials.

Entry point::

    result = await fetch_weights(entry, settings.model_dir(entry.name), settings=settings,
                                 connections=None, progress=True, wait=False)

- **llama entries** (GGUF): ``entry.artifact`` is fetched by ``download`` (resumable, pinned,
  parallel ranges, sha256 while streaming) into ``<dest>/.partial/``. The stage ends there: its
  :class:`~core.model_files.FetchedFile` records the partial, the sha256 computed while streaming and
  the partial's identity; ``stages.verify`` checks pin, size, sha256 and header, renames the file into
  place and writes the receipt. A transfer whose bytes do not hash to the registry's or the Hub's
  sha256 is corrupt, like a cut connection: the partial is discarded and fetched again, at most
  ``integrity_retries`` times, so what this stage hands on is worth verifying.
- The **projector** (``entry.projector``) goes the same way; when the Hub says it does not exist (or
  is gated) that is not fatal: ``vision`` is False, a warning is logged and recorded (spec: "a missing
  projector costs images").
- **OpenVINO entries** (``artifact.file is None``): the repository snapshot is listed through the Hub
  tree API at the *current* commit of ``artifact.revision`` (default ``main``; spec: OpenVINO downloads
  follow their current repository snapshots) — the commit is recorded — and every file is fetched
  resumably into a hashed partial, checked by size and LFS sha256, or git blob id for small non-LFS
  files (a corrupt one is fetched again); the listing and the partials are recorded in
  :class:`~core.model_files.SnapshotResult`, and verify puts them in ``<dest>/snapshot/`` and writes
  ``<dest>/snapshot.json``. A listed path that would escape the directory (absolute, ``..``) refuses
  the whole snapshot.

Idempotent: a file whose receipt matches the pin is not touched (no network; works offline); a file
in place without one is moved back to the partial slot and re-hashed (``adopt_as_partial``).
A per-target lock (``state.locks.FileLock``) keeps two processes off one partial file; the second
waits (``wait=True``) or gets LockedError naming the holder PID.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager as AsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio

from hotfit.core.entry import Artifact, Entry
from hotfit.core.errors import HubError, IntegrityError, PinMismatch, RegistryError, TransferError
from hotfit.core.log import get_logger
from hotfit.core.model_files import (
    PARTIAL_DIRNAME,
    SNAPSHOT_DIRNAME,
    FetchedFile,
    FetchResult,
    SnapshotFile,
    SnapshotResult,
    check_integrity,
    snapshot_listing_sha256,
)
from hotfit.core.settings import Settings
from hotfit.download import (
    CacheMiss,
    check_disk,
    DownloadOutcome,
    HubSession,
    ProgressReporter,
    TransferOptions,
    adopt_as_partial,
    bytes_to_write,
    check_disk_space,
    check_endpoint,
    discard_partial,
    download_to_partial,
    hub_call_retrying,
    hub_error_from_hf_exception,
    is_commit,
    partial_paths,
    proxy_config,
    resolve_token,
    StaticPins,
    is_not_a_hub,
    redact_url,
    safe_relpath,
    snapshot_path,
    speaks_hub_endpoint,
    take_into_partial,
)
from hotfit.download.hub_errors import speaks_hub
from hotfit.stages.declaration import StageContext, StageDeclaration
from hotfit.state.locks import FileLock
from hotfit.state.receipts import drop_receipt, file_identity, git_blob_sha1, read_receipt, receipt_matches, sha256_file

log = get_logger()

__all__ = ["fetch_weights", "fetch_artifact", "fetch_snapshot", "fetched_still_on_disk", "list_snapshot", "ListedFile",
           "snapshot_file_pins"]

DEFAULT_INTEGRITY_RETRIES = 2  # a corrupt download is fetched again at most this many times


def _reporter_factory(enabled: bool, label: str) -> Any:
    if not enabled:
        return None
    return lambda total, done: ProgressReporter(label, total, done_bytes=done)


def _require_pinned(entry: Entry, artifact: Artifact, role: str) -> tuple[str, str]:
    if not is_commit(artifact.revision):
        raise RegistryError(f"entry {entry.name}: {role} {artifact.repo} is not pinned to a commit "
                            f"({artifact.revision!r})", hint="pin it with `hotfit registry lock`", entry=entry.name)
    if not artifact.file:
        raise RegistryError(f"entry {entry.name}: {role} names no file", hint="name the file in the registry entry",
                            entry=entry.name)
    try:
        safe_relpath(artifact.file)
    except ValueError:
        raise RegistryError(f"entry {entry.name}: {role} file {artifact.file!r} escapes the model directory",
                            hint="use the file's path inside its repository (no '..', not absolute)",
                            entry=entry.name) from None
    assert artifact.revision is not None
    return artifact.revision, artifact.file


def _installed_damaged(entry_name: str, final: Path, dest_dir: Path, file: str, expected: str, actual: str, *,
                       fetch_again: bool) -> None:
    """An installed file no longer hashes to what its receipt vouched for (damaged in place, same
    size): the receipt goes (it vouches for nothing now) and so do the bytes (worthless, and nothing
    may serve them), to be fetched again; offline nothing can fetch them: IntegrityError naming both
    hashes."""
    log.warning("fetch.installed_damaged", entry=entry_name, file=str(final), expected_sha256=expected,
                actual_sha256=actual, fetch_again=fetch_again)
    drop_receipt(dest_dir, file)
    final.unlink()
    if not fetch_again:
        raise IntegrityError(f"{final} was damaged in place: its sha256 was {actual}, its receipt and pin say "
                             f"{expected}; it is removed",
                             hint=f"unset HF_HUB_OFFLINE and rerun `hotfit pull {entry_name}` to fetch it again",
                             field="sha256", file=str(final), expected_sha256=expected, actual_sha256=actual)


async def fetch_artifact(session: HubSession, entry: Entry, artifact: Artifact, dest_dir: Path, *,
                         role: str = "weights", connections: int | None = None, progress: bool = True,
                         wait: bool = False, integrity_retries: int = DEFAULT_INTEGRITY_RETRIES,
                         rehash_installed: bool = False) -> FetchedFile:
    """One pinned file as a complete, hashed partial (or already verified in place). With
    ``rehash_installed`` (pull, ``auto --recheck``) a file in place is re-hashed before its receipt
    is trusted; one damaged in place is fetched again."""
    revision, file = _require_pinned(entry, artifact, role)
    final = dest_dir / file
    partial_dir = dest_dir / PARTIAL_DIRNAME
    partial, sidecar, lock_path = partial_paths(partial_dir, artifact.repo, file)
    async with FileLock(lock_path, wait=wait, what=f"{role} of {entry.name} ({file})").async_held():
        receipt = read_receipt(dest_dir, file)
        if receipt_matches(receipt, artifact, final) and rehash_installed:
            assert receipt is not None and receipt.sha256 is not None
            actual = await anyio.to_thread.run_sync(sha256_file, final)
            if actual != receipt.sha256:
                _installed_damaged(entry.name, final, dest_dir, file, receipt.sha256, actual,
                                   fetch_again=not session.offline)
                receipt = None
        if receipt_matches(receipt, artifact, final):
            assert receipt is not None and receipt.sha256 is not None and receipt.size_bytes is not None
            log.info("fetch.already_present", entry=entry.name, file=file, size_bytes=receipt.size_bytes,
                     rehashed=rehash_installed)
            return FetchedFile(repo=artifact.repo, revision=revision, file=file, path=str(final), partial_path=None,
                               size_bytes=receipt.size_bytes, sha256=receipt.sha256,
                               hub_lfs_sha256=receipt.hub_lfs_sha256, identity=None, bytes_transferred=0,
                               bytes_reread=0, resumed_from_bytes=0, connections=0, attempts=0,
                               already_present=True, verified_against=receipt.verified_against)
        cached = await _from_hf_cache(session, entry, artifact, partial_dir, role=role)
        if cached is not None:
            return cached
        if final.exists():
            # offline nothing can verify it (no Hub sha256): leave it where the operator put it
            adopted = not session.offline and adopt_as_partial(final, partial_dir, repo=artifact.repo, revision=revision, path=file,
                                       size_bytes=artifact.size_bytes, expected_sha256=artifact.sha256)
            log.warning("fetch.unverified_file", file=str(final),
                        detail="present without a matching receipt; "
                               + ("moved aside to be re-hashed and verified" if adopted
                                  else "fetching a verified copy over it"))
        total_transferred = total_reread = 0
        for retry in range(integrity_retries + 1):
            outcome = await download_to_partial(
                session, repo=artifact.repo, revision=revision, path=file, expected_size=artifact.size_bytes,
                expected_sha256=artifact.sha256, partial_dir=partial_dir, connections=connections,
                progress=_reporter_factory(progress, file), git_sha1=False)
            total_transferred += outcome.bytes_transferred
            total_reread += outcome.bytes_reread
            try:
                # Transfer integrity, so a corrupt stream is fetched again now; verify checks it again
                # (pin, size, sha256, header) before anything is put in place.
                check_integrity(file=file, size_bytes=os.path.getsize(outcome.partial_path), sha256=outcome.sha256,
                                expected_size=artifact.size_bytes, registry_sha256=artifact.sha256,
                                hub_sha256=outcome.hub_lfs_sha256)
            except IntegrityError as exc:
                if exc.details.get("field") == "sha256" and "reference" not in exc.details:
                    # Nothing to check against (no registry or Hub LFS sha256): not corruption, so
                    # fetching again cannot help. Keep the complete partial (never put in place):
                    # once the sha256 is pinned, a rerun only re-hashes it.
                    raise
                discard_partial(partial, sidecar)  # bad bytes must never be resumed from
                log.warning("verify.integrity_failed", file=file, field=exc.details.get("field"), retry=retry,
                            of=integrity_retries)
                if retry >= integrity_retries:
                    raise
                continue
            break
        identity = await anyio.to_thread.run_sync(file_identity, outcome.partial_path)
        log.info("fetch.done", entry=entry.name, file=file, size_bytes=outcome.size_bytes,
                 bytes_transferred=total_transferred, bytes_reread=total_reread,
                 resumed_from_bytes=outcome.resumed_from_bytes, connections=outcome.connections,
                 partial=str(outcome.partial_path))
        return FetchedFile(repo=artifact.repo, revision=revision, file=file, path=str(final),
                           partial_path=str(outcome.partial_path), size_bytes=outcome.size_bytes,
                           sha256=outcome.sha256, hub_lfs_sha256=outcome.hub_lfs_sha256, identity=identity,
                           bytes_transferred=total_transferred, bytes_reread=total_reread,
                           resumed_from_bytes=outcome.resumed_from_bytes, connections=outcome.connections,
                           attempts=outcome.attempts, already_present=False, integrity_retries=retry)


async def _from_hf_cache(session: HubSession, entry: Entry, artifact: Artifact, partial_dir: Path, *,
                         role: str) -> FetchedFile | None:
    """The pinned file from the Hugging Face cache (download.hf_cache), as a hashed partial for verify;
    None when the cache lacks it or it fails a check (then it is downloaded; a damaged one is warned
    about). Only with the size and sha256 pinned: the cache is trusted for nothing hotfit cannot check."""
    if session.hf_hub_cache is None or artifact.size_bytes is None or artifact.sha256 is None:
        return None
    assert artifact.revision is not None and artifact.file is not None
    repo, revision, file = artifact.repo, artifact.revision, artifact.file
    partial, sidecar, _lock = partial_paths(partial_dir, repo, file)
    if not snapshot_path(session.hf_hub_cache, repo, revision, file).exists():
        return None
    found = await anyio.to_thread.run_sync(lambda: take_into_partial(
        session.hf_hub_cache, partial=partial, sidecar=sidecar, repo=repo, commit=revision, file=file,
        size_bytes=artifact.size_bytes, sha256=artifact.sha256))
    if isinstance(found, CacheMiss):
        if found.damaged:
            log.warning("fetch.hf_cache_rejected", entry=entry.name, file=file, path=found.source,
                        reason=found.reason, detail=found.detail,
                        action="ignored; downloading" if not session.offline else "ignored")
        return None
    identity = await anyio.to_thread.run_sync(file_identity, partial)
    log.info("fetch.hf_cache_used", entry=entry.name, role=role, file=file, path=found.source, how=found.how,
             size_bytes=found.size_bytes)
    return FetchedFile(repo=repo, revision=revision, file=file, path=str(partial_dir.parent / file),
                       partial_path=str(partial), size_bytes=found.size_bytes, sha256=found.sha256,
                       hub_lfs_sha256=None, identity=identity, bytes_transferred=0, bytes_reread=0,
                       resumed_from_bytes=0, connections=0, attempts=0, already_present=False,
                       hf_cache=found.how)


async def fetch_weights(entry: Entry, dest_dir: Path, *, settings: Settings, connections: int | None = None,
                        progress: bool = True, wait: bool = False,
                        options: TransferOptions | None = None,
                        integrity_retries: int = DEFAULT_INTEGRITY_RETRIES,
                        rehash_installed: bool = False) -> FetchResult:
    """The fetch-weights stage for one registry entry (see the module docstring)."""
    dest_dir = Path(dest_dir)
    artifact = entry.artifact
    if artifact is None:
        raise RegistryError(f"entry {entry.name} has no downloadable artifact",
                            hint="choose an entry with an artifact (hotfit registry list)", entry=entry.name)
    options = options or TransferOptions(connections=connections or settings.download_connections)
    if entry.layout.snapshot or artifact.file is None:
        snap = await fetch_snapshot(entry, dest_dir, settings=settings, connections=connections,
                                    progress=progress, wait=wait, options=options, rehash_installed=rehash_installed)
        return FetchResult(entry=entry.name, backend=entry.backend, weights=None, projector=None, vision=False,
                           snapshot=snap)
    dest_dir.mkdir(parents=True, exist_ok=True)
    warnings: list[str] = []
    async with HubSession(settings, options) as session:
        weights = await fetch_artifact(
            session, entry, artifact, dest_dir, role="weights", connections=connections, progress=progress,
            wait=wait, integrity_retries=integrity_retries, rehash_installed=rehash_installed)
        projector = None
        if entry.projector is not None:
            try:
                projector = await fetch_artifact(
                    session, entry, entry.projector, dest_dir, role="projector", connections=connections,
                    progress=progress, wait=wait, integrity_retries=integrity_retries,
                    rehash_installed=rehash_installed)
            except HubError as exc:  # not found / gated: images lost, tool calls intact
                warnings.append(f"projector unavailable: {exc.what}")
                log.warning("fetch.projector_missing", entry=entry.name, reason=exc.what, vision=False)
    return FetchResult(entry=entry.name, backend=entry.backend, weights=weights, projector=projector,
                       vision=projector is not None, warnings=tuple(warnings))


def fetched_still_on_disk(fetched: FetchResult, *, rehash: bool = False) -> bool:
    """May a recorded fetch-weights result (decoded by the engine, once) be reused? Each file's hashed
    partial is still there as it was hashed, or verify has since put it in place (its receipt vouches
    for that sha256 — and, with ``rehash`` (``auto --recheck``), the file still hashes to it)."""
    if fetched.snapshot is not None:
        snap_dir = Path(fetched.snapshot.directory)
        for sf in fetched.snapshot.listed:
            partial = Path(sf.partial_path) if sf.partial_path else None
            if partial is not None and partial.is_file():
                if file_identity(partial) != sf.identity:
                    return False
            elif not (snap_dir / sf.path).is_file() or (snap_dir / sf.path).stat().st_size != sf.size_bytes:
                return False
            elif rehash and (sf.lfs_sha256 or sf.blob_id):
                placed = snap_dir / sf.path
                actual = sha256_file(placed) if sf.lfs_sha256 else git_blob_sha1(placed)
                if actual != (sf.lfs_sha256 or sf.blob_id):
                    log.warning("fetch.installed_damaged", file=str(placed), expected_sha256=sf.lfs_sha256 or sf.blob_id,
                                actual_sha256=actual, fetch_again=True)
                    return False
        return snap_dir.is_dir() or bool(fetched.snapshot.listed)
    for f in fetched.files():
        partial = Path(f.partial_path) if f.partial_path else None
        if partial is not None and partial.is_file():
            if file_identity(partial) != f.identity:
                return False  # changed since it was hashed: fetch (and hash) it again
            continue
        final = Path(f.path)
        dest_dir = final.parents[len(Path(f.file).parts) - 1]
        receipt = read_receipt(dest_dir, f.file)
        if receipt is None or receipt.sha256 != f.sha256:
            return False
        if not final.is_file() or final.stat().st_size != f.size_bytes:
            return False
        if rehash and (actual := sha256_file(final)) != f.sha256:
            log.warning("fetch.installed_damaged", file=str(final), expected_sha256=f.sha256, actual_sha256=actual,
                        fetch_again=True)
            return False  # fetch-weights runs again: it re-hashes, drops the receipt and fetches the file
    return True


# --------------------------------------------------------------------------- OpenVINO snapshot


@dataclass(frozen=True)
class ListedFile:
    path: str
    size_bytes: int
    blob_id: str | None
    lfs_sha256: str | None


def _list_snapshot_sync(settings: Settings, repo: str, revision: str, token: str | None) -> tuple[str, list[ListedFile]]:
    """Resolve ``revision`` to its current commit and list every file there (huggingface_hub metadata)."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(endpoint=settings.hf_endpoint, token=token or False)
    commit = revision if is_commit(revision) else api.model_info(repo, revision=revision).sha
    if not commit or not is_commit(commit):
        raise HubError(f"{repo}@{revision}: the Hub did not name the commit",
                       hint="check HF_ENDPOINT points at a Hugging Face Hub (or a faithful mirror)",
                       repo=repo, revision=revision)
    files: list[ListedFile] = []
    for item in api.list_repo_tree(repo, revision=commit, recursive=True):
        if isinstance(item, RepoFile):
            files.append(ListedFile(path=item.path, size_bytes=int(item.size), blob_id=item.blob_id,
                                     lfs_sha256=item.lfs.sha256 if item.lfs else None))
    return commit, files


async def list_snapshot(settings: Settings, repo: str, revision: str, options: TransferOptions, *,
                        listing_sha256: str | None = None) -> tuple[str, list[ListedFile]]:
    """The commit ``revision`` names and every file there, from ``HF_ENDPOINT``'s tree API — or the
    listing a static mirror holds at that URL (``hotfit fleet mirror`` writes it). ``listing_sha256``:
    the registry's pin of the file list (core.model_files.snapshot_listing_sha256); a listing that
    does not hash to it is refused before anything is fetched. The token goes with the first request
    only to the Hub itself (or with HOTFIT_MIRROR_TOKEN); elsewhere only once the endpoint has answered
    like a Hub asking for it, as the Hub session sends it (download.hub)."""
    if settings.hf_offline:
        raise HubError(f"HF_HUB_OFFLINE is set and the {repo} snapshot is not on disk",
                       hint="unset HF_HUB_OFFLINE to download", repo=repo)
    check_endpoint(settings.hf_endpoint)
    # huggingface_hub's client reads the proxy variables itself, with the rules download.proxy
    # checks here (a malformed one is exit 2 before a request) and names in errors
    proxy = proxy_config(dict(settings.proxy_env)).for_url(settings.hf_endpoint)
    token = resolve_token()
    first = token if speaks_hub_endpoint(settings) else None
    listing_url = f"{settings.hf_endpoint}/api/models/{repo}/tree/{revision}"
    try:
        try:
            commit, files = await hub_call_retrying(_list_snapshot_sync, settings, repo, revision, first,
                                                    options=options, repo=repo, url=listing_url)
        except Exception as exc:
            if first is not None or not token or not _hub_asks_for_token(exc):
                raise
            commit, files = await hub_call_retrying(_list_snapshot_sync, settings, repo, revision, token,
                                                    options=options, repo=repo, url=listing_url)
    except TransferError:
        raise
    except Exception as exc:
        mapped = hub_error_from_hf_exception(exc, repo=repo, revision=revision, endpoint=settings.hf_endpoint,
                                             url=listing_url, proxy=proxy)
        if mapped is None:
            raise HubError(f"listing {repo}@{revision} failed: {exc}", hint="check HF_ENDPOINT and rerun",
                           repo=repo, revision=revision) from exc
        if is_not_a_hub(mapped) and listing_sha256 is None:
            raise HubError(f"{mapped.what}; a static mirror serves an OpenVINO snapshot only when the registry "
                           "pins its revision and its file list (artifact.sha256)",
                           hint="pin the entry (hotfit registry lock) and fill the mirror again, or use the Hub "
                                "or a mirror that speaks its protocol", **mapped.details) from exc
        raise mapped from exc
    if listing_sha256 is not None:
        listed = snapshot_listing_sha256((f.path, f.size_bytes, f.lfs_sha256, f.blob_id) for f in files)
        if listed != listing_sha256:
            raise PinMismatch(
                f"{repo}@{commit}: {redact_url(settings.hf_endpoint)} lists {len(files)} files whose list hashes "
                f"to {listed}; the registry pins {listing_sha256}",
                hint="the server holds another snapshot than the registry pins (a static mirror: fill it again "
                     "with `hotfit fleet mirror`); the pin stands, nothing was fetched",
                repo=repo, revision=commit, listing_sha256=listed, pinned_sha256=listing_sha256)
    return commit, files


def _hub_asks_for_token(exc: BaseException) -> bool:
    """A Hub's answer (X-Error-Code) refusing a tokenless request: sent again with the token."""
    resp = getattr(exc, "response", None)
    return resp is not None and resp.status_code in (401, 403, 404) and speaks_hub(resp.headers)


def snapshot_file_pins(f: ListedFile, *, listing_pinned: bool) -> StaticPins:
    """What a static mirror is trusted with for one file of a snapshot: the listing's size and LFS
    sha256 or git blob id — only when the registry pins that listing (list_snapshot checked it)."""
    return StaticPins(f.size_bytes, f.lfs_sha256, None if f.lfs_sha256 else f.blob_id,
                      listing_unpinned=not listing_pinned)


def _snapshot_needed_bytes(partial_dir: Path, repo: str, todo: list[ListedFile], *, commit: str | None = None,
                           hf_hub_cache: Path | None = None) -> int:
    """Disk the snapshot still needs: what each file still writes (download.disk.bytes_to_write: its
    size less what its partial already holds — a resume on a nearly full disk must not be refused for
    bytes it has — or 0 when the Hugging Face cache hard-links it)."""
    return sum(bytes_to_write(partial_dir, repo, f.path, f.size_bytes, hf_hub_cache=hf_hub_cache, cached_at=commit)
               for f in todo)


def _snapshot_receipt_ok(dest_dir: Path, rel: str, f: ListedFile, commit: str, *, rehash: bool = False) -> bool:
    final = dest_dir / SNAPSHOT_DIRNAME / rel
    r = read_receipt(dest_dir, f"{SNAPSHOT_DIRNAME}/{rel}")
    vouched = (r is not None and final.is_file() and final.stat().st_size == f.size_bytes
               and r.size_bytes == f.size_bytes
               # unchanged content from an earlier commit is kept: the hash is what identifies it
               and (r.sha256 == f.lfs_sha256 if f.lfs_sha256 else r.git_sha1 == f.blob_id))
    if vouched and rehash:  # pull / auto --recheck: the bytes in place must still hash to the receipt
        expected = f.lfs_sha256 or f.blob_id
        actual = sha256_file(final) if f.lfs_sha256 else git_blob_sha1(final)
        if actual != expected:
            log.warning("fetch.installed_damaged", file=str(final), expected_sha256=expected, actual_sha256=actual,
                        fetch_again=True)  # fetched again below; verify puts the good copy in its place
            return False
    return vouched


async def _snapshot_file_from_hf_cache(settings: Settings, entry: Entry, repo: str, commit: str, f: ListedFile,
                                       partial_dir: Path) -> SnapshotFile | None:
    """One listed file from the Hugging Face cache at the listed commit, checked against the listing's
    LFS sha256 or git blob id (download.hf_cache); None to download it."""
    if settings.hf_hub_cache is None or not snapshot_path(settings.hf_hub_cache, repo, commit, f.path).exists():
        return None
    partial, sidecar, _lock = partial_paths(partial_dir, repo, f.path)
    found = await anyio.to_thread.run_sync(lambda: take_into_partial(
        settings.hf_hub_cache, partial=partial, sidecar=sidecar, repo=repo, commit=commit, file=f.path,
        size_bytes=f.size_bytes, sha256=f.lfs_sha256, git_sha1=None if f.lfs_sha256 else f.blob_id))
    if isinstance(found, CacheMiss):
        if found.damaged:
            log.warning("fetch.hf_cache_rejected", entry=entry.name, file=f.path, path=found.source,
                        reason=found.reason, detail=found.detail, action="ignored; downloading")
        return None
    log.info("fetch.hf_cache_used", entry=entry.name, role="snapshot", file=f.path, path=found.source,
             how=found.how, size_bytes=found.size_bytes)
    return SnapshotFile(path=f.path, size_bytes=f.size_bytes, lfs_sha256=f.lfs_sha256, blob_id=f.blob_id,
                        partial_path=str(partial), sha256=found.sha256, git_sha1=found.git_sha1,
                        identity=await anyio.to_thread.run_sync(file_identity, partial))


async def fetch_snapshot(entry: Entry, dest_dir: Path, *, settings: Settings, connections: int | None = None,
                         progress: bool = True, wait: bool = False,
                         options: TransferOptions | None = None, rehash_installed: bool = False) -> SnapshotResult:
    """Fetch the current snapshot of an OpenVINO repository into ``<dest>/snapshot/`` (see module doc)."""
    artifact = entry.artifact
    assert artifact is not None
    dest_dir = Path(dest_dir)
    revision = artifact.revision or "main"
    snap_dir = dest_dir / SNAPSHOT_DIRNAME
    partial_dir = dest_dir / PARTIAL_DIRNAME
    lock_path = partial_dir / "snapshot.lock"
    async with FileLock(lock_path, wait=wait, what=f"snapshot of {entry.name}").async_held():
        commit, listed = await list_snapshot(settings, artifact.repo, revision,
                                              options or TransferOptions(connections=settings.download_connections),
                                              listing_sha256=artifact.sha256)
        for f in listed:  # refuse the whole listing before writing anything
            try:
                safe_relpath(f.path)
            except ValueError:
                raise IntegrityError(f"{artifact.repo}@{commit}: listed path {f.path!r} would escape {snap_dir}",
                                     hint="refusing this snapshot; report the repository", field="path",
                                     repo=artifact.repo, path=f.path) from None
        if not listed:
            raise HubError(f"{artifact.repo}@{commit} lists no files",
                           hint="check the entry's repository (and HF_ENDPOINT)", repo=artifact.repo)
        todo = [f for f in listed if not _snapshot_receipt_ok(dest_dir, f.path, f, commit, rehash=rehash_installed)]
        partial_dir.mkdir(parents=True, exist_ok=True)
        needed = _snapshot_needed_bytes(partial_dir, artifact.repo, todo, commit=commit,
                                        hf_hub_cache=settings.hf_hub_cache)
        if needed:  # the margin only where something is written (download.disk.check_disk)
            check_disk_space(partial_dir, needed, f"{artifact.repo} snapshot")
        transferred = reread = 0
        pinned_listing = artifact.sha256 is not None
        hashed: dict[str, SnapshotFile] = {}
        async with HubSession(settings, options) as session:
            for f in todo:
                from_cache = await _snapshot_file_from_hf_cache(settings, entry, artifact.repo, commit, f, partial_dir)
                if from_cache is not None:
                    hashed[f.path] = from_cache
                    continue
                outcome: DownloadOutcome | None = None
                for retry in range(DEFAULT_INTEGRITY_RETRIES + 1):
                    outcome = await download_to_partial(
                        session, repo=artifact.repo, revision=commit, path=f.path, expected_size=f.size_bytes,
                        expected_sha256=f.lfs_sha256, partial_dir=partial_dir,
                        connections=connections, progress=_reporter_factory(progress, f.path),
                        git_sha1=f.lfs_sha256 is None, static=snapshot_file_pins(f, listing_pinned=pinned_listing))
                    transferred += outcome.bytes_transferred
                    reread += outcome.bytes_reread
                    try:
                        check_integrity(
                            file=f.path, size_bytes=os.path.getsize(outcome.partial_path), sha256=outcome.sha256,
                            expected_size=f.size_bytes, registry_sha256=None, hub_sha256=f.lfs_sha256,
                            git_sha1=outcome.git_sha1, hub_git_sha1=None if f.lfs_sha256 else f.blob_id)
                    except IntegrityError:
                        _p, side, _l = partial_paths(partial_dir, artifact.repo, f.path)
                        discard_partial(outcome.partial_path, side)
                        if retry >= DEFAULT_INTEGRITY_RETRIES:
                            raise
                        continue
                    break
                assert outcome is not None
                identity = await anyio.to_thread.run_sync(file_identity, outcome.partial_path)
                hashed[f.path] = SnapshotFile(
                    path=f.path, size_bytes=f.size_bytes, lfs_sha256=f.lfs_sha256, blob_id=f.blob_id,
                    partial_path=str(outcome.partial_path), sha256=outcome.sha256, git_sha1=outcome.git_sha1,
                    identity=identity)
    files = tuple(hashed.get(f.path) or SnapshotFile(path=f.path, size_bytes=f.size_bytes, lfs_sha256=f.lfs_sha256,
                                                    blob_id=f.blob_id) for f in listed)
    total = sum(f.size_bytes for f in listed)
    log.info("fetch.snapshot_done", entry=entry.name, repo=artifact.repo, commit=commit, files=len(listed),
             size_bytes=total, bytes_transferred=transferred, files_already_present=len(listed) - len(todo))
    return SnapshotResult(repo=artifact.repo, revision_requested=revision, commit=commit, directory=str(snap_dir),
                          files=len(listed), size_bytes=total, bytes_transferred=transferred, bytes_reread=reread,
                          files_already_present=len(listed) - len(todo), listed=files)


# --------------------------------------------------------------------------- the stage

T = TypeVar("T")


@dataclass(frozen=True)
class FetchJob:
    """How the fetch stages (fetch-weights, fetch-template, verify) run: for the plan's entry
    (``auto``) or one named entry (``pull``)."""

    entry: Entry | None = None  # None: the plan's entry
    wait: bool = False  # queue behind another process holding the model directory's lock
    connections: int | None = None  # parallel byte ranges (None: fetch_weights' default)
    progress: bool = True
    # auto takes the model directory's lock per stage; pull holds it around all three itself
    lock_each_stage: bool = True
    # pull and `auto --recheck`: re-hash a file already in place before trusting its receipt (a
    # byte flipped in place keeps the size; only its hash tells)
    rehash_installed: bool = False

    def entry_of(self, ctx: StageContext) -> Entry:
        return self.entry if self.entry is not None else ctx.require_plan().entry

    def model_lock(self, ctx: StageContext) -> AsyncContextManager[Any]:
        dest = ctx.settings.model_dir(self.entry_of(ctx).name)
        # the lock `hotfit pull` takes, so a pull of the same entry never writes beside us
        return FileLock(dest / ".partial" / "pull.lock", wait=self.wait, what=f"model directory {dest}").async_held()

    async def locked(self, ctx: StageContext, work: Callable[[], Awaitable[T]]) -> T:
        if not self.lock_each_stage:
            return await work()
        async with self.model_lock(ctx):
            return await work()

    def pins(self, ctx: StageContext) -> dict[str, Any]:
        """What the downloaded bytes depend on: the pinned artifacts, not the window or budget."""
        entry = self.entry_of(ctx)
        return {
            "entry": entry.name,
            "artifact": dataclasses.asdict(entry.artifact) if entry.artifact else None,
            "projector": dataclasses.asdict(entry.projector) if entry.projector else None,
            "models_dir": str(ctx.settings.models_dir),
        }


async def fetch_weights_work(ctx: StageContext) -> FetchResult:
    job = ctx.job(FetchJob)
    entry = job.entry_of(ctx)
    dest = ctx.settings.model_dir(entry.name)
    # auto and pull alike: free disk for what will be written, before a byte is (contenox `auto`)
    await anyio.to_thread.run_sync(check_disk, entry, dest, ctx.settings.hf_hub_cache)
    return await job.locked(ctx, lambda: fetch_weights(entry, dest, settings=ctx.settings, connections=job.connections,
                                                       progress=job.progress, wait=job.wait,
                                                       rehash_installed=job.rehash_installed))


def _inputs(ctx: StageContext) -> dict[str, Any]:
    return ctx.job(FetchJob).pins(ctx)


def _file_fingerprint(f: FetchedFile | None) -> Any:
    return None if f is None else {"path": f.path, "size_bytes": f.size_bytes, "sha256": f.sha256}


def fetch_fingerprint(result: FetchResult) -> Any:
    """What downstream hashes: which bytes, not how they came (bytes transferred, resumes)."""
    snap = result.snapshot
    return {"weights": _file_fingerprint(result.weights), "projector": _file_fingerprint(result.projector),
            "snapshot": None if snap is None else {"commit": snap.commit, "directory": snap.directory,
                                                   "size_bytes": snap.size_bytes}}


def fetch_figures(result: FetchResult) -> dict[str, Any]:
    w = result.weights
    if w is None:
        return {"vision": result.vision}
    return {"file": w.file, "size_bytes": w.size_bytes, "bytes_transferred": w.bytes_transferred,
            "resumed_from_bytes": w.resumed_from_bytes, "already_present": w.already_present,
            "hf_cache": w.hf_cache, "sha256": w.sha256, "vision": result.vision}


DECLARATION = StageDeclaration(
    "fetch-weights", fetch_weights_work, inputs=_inputs, decode=FetchResult.decode,
    still_valid=fetched_still_on_disk, fingerprint=fetch_fingerprint, figures=fetch_figures, version=1,
    result_type=FetchResult, job=FetchJob())


def for_job(job: FetchJob) -> StageDeclaration[FetchResult]:
    """fetch-weights for ``job``; its reuse check re-hashes files in place when the job does."""
    return dataclasses.replace(DECLARATION.with_job(job),
                               still_valid=functools.partial(fetched_still_on_disk, rehash=job.rehash_installed))

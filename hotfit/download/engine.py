"""The block scheduler: one pinned Hub file into a complete, hashed partial (never renamed here).

- **Parallel.** A file ≥ ``min_parallel_bytes`` is cut into blocks handed out *in file order* to
  ``connections`` workers, each block one resumable ``Range`` request (``download.stream``).
- **Resumable.** Bytes go to ``<dir>/.partial/<name>.part`` at absolute offsets; the sidecar
  (``download.sidecar``) is rewritten atomically every ``checkpoint_interval_s``, claiming only bytes
  written before an ``fdatasync`` that completed; each connection re-sends at most what it received
  since the last checkpoint (< one block). Should a disk lie anyway, the sha256 check catches it.
- **Fresh links.** A HEAD before the run and before every retry that follows an attempt without
  progress (``download.retry``) re-checks the pin (real CDN links are signed and expire); a cut
  stream that was delivering is resumed at once on the same link, its range checked as always.
- **Range-ignoring servers** (200 to a ranged GET) restart the file as one stream from byte 0.
- **Disk.** Free space is checked before anything is allocated (``download.disk``; what the partial
  already holds counts as held); ENOSPC/EFBIG mid-write stops every connection, checkpoints the
  sidecar and raises DiskSpaceError with the partial kept.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

import anyio

from hotfit.core.diskspace import write_failure
from hotfit.core.errors import (DiskSpaceError, DiskWriteError, HubError, IntegrityError, PinMismatch, TransferError,
                                TransientTransferError)
from hotfit.core.lazy_import import lazy_module
from hotfit.core.log import get_logger
from hotfit.download.disk import bytes_held, check_disk_space, preallocate, release_unclaimed
from hotfit.download.hashing import OrderedHasher
from hotfit.download.hub import HubSession, RemoteFile, StaticPins
from hotfit.download.hub_errors import Retryable
from hotfit.download.options import MAX_BLOCKS, TransferOptions, is_commit, partial_paths
from hotfit.download.progress import ProgressReporter
from hotfit.download.retry import StopPolicy, gave_up, head_retrying, log_retry, retrying
from hotfit.download.sidecar import Block, Sidecar, encode_sidecar, read_sidecar, write_sidecar
from hotfit.download.stream import RangeIgnored, stream_block
from hotfit.state.files import checked_write_path, fsync_dir

if TYPE_CHECKING:  # the type checker reads the real module; at run time it loads on first use
    import httpx
else:
    httpx = lazy_module("httpx")  # third-party, imported on first use (core.lazy_import says why)

log = get_logger()


@dataclass(frozen=True)
class DownloadOutcome:
    """A complete, hashed partial file, not yet renamed into place."""

    partial_path: Path
    repo: str
    revision: str
    file: str
    size_bytes: int
    sha256: str
    git_sha1: str | None
    hub_lfs_sha256: str | None
    etag: str | None
    bytes_transferred: int  # body bytes received by this run
    bytes_reread: int  # bytes read back from disk for hashing (resume prefix + spills)
    resumed_from_bytes: int  # bytes already on disk when this run started
    connections: int
    ranges_supported: bool
    attempts: int  # HTTP attempts, retries included

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["partial_path"] = str(self.partial_path)
        return out


def plan_blocks(size: int, connections: int, options: TransferOptions, ranges: bool) -> list[Block]:
    if not ranges or connections <= 1 or size < options.min_parallel_bytes:
        return [Block(0, size)]
    step = max(options.block_size_for(size, connections), -(-size // MAX_BLOCKS))
    return [Block(s, min(size, s + step)) for s in range(0, size, step)]


def discard_partial(partial: Path, sidecar: Path) -> None:
    for p in (sidecar, partial):
        checked_write_path(p)  # a directory there is a clear error, not IsADirectoryError
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def adopt_as_partial(final: Path, partial_dir: Path, *, repo: str, revision: str, path: str,
                     size_bytes: int | None, expected_sha256: str | None) -> bool:
    """Move a file that sits in its final path without a receipt (a kill between the rename and the
    receipt write, or a file seeded by hand) into the partial slot with a sidecar claiming every
    byte: the next :func:`download_to_partial` then re-hashes it once instead of fetching it again,
    and verification decides (bad bytes are discarded and fetched). The final path is left empty,
    so it never holds unverified bytes. False, nothing moved, when its size is not the pinned one or
    a partial download is already in progress."""
    try:
        if size_bytes is None or size_bytes <= 0 or final.stat().st_size != size_bytes:
            return False
    except OSError:
        return False
    partial, sidecar, _lock = partial_paths(partial_dir, repo, path)
    checked_write_path(final)
    if partial.exists():  # a download in progress: its bytes are not traded for an unknown file
        return False
    checked_write_path(partial_dir, kind="directory")
    partial_dir.mkdir(parents=True, exist_ok=True)
    discard_partial(partial, sidecar)
    side = Sidecar(url="", repo=repo, revision=revision, file=path, size_bytes=size_bytes,
                   expected_sha256=expected_sha256, etag=None, ranges_supported=True)
    # Sidecar first: a kill before the move leaves the file in place, to be adopted again.
    write_sidecar(sidecar, encode_sidecar(side, [Block(0, size_bytes, size_bytes)]), durable=True)
    os.replace(final, partial)
    fsync_dir(final.parent)
    return True


async def download_to_partial(session: HubSession, **kw: Any) -> DownloadOutcome:
    """Bring ``<repo>@<revision>/<path>`` into a complete, hashed partial file (see the module doc).

    Keyword arguments: ``repo, revision, path, expected_size, expected_sha256, partial_dir,
    connections=None, progress=None, git_sha1=False, max_size_bytes=None, static=None``
    (``static``: what a static mirror is trusted with, hub.StaticPins); ``progress(total, done)``
    builds a reporter; a file the HEAD says is larger than ``max_size_bytes`` is refused unfetched.
    The caller holds the per-target lock and decides what the hashes mean (verify); nothing is
    renamed here. Raises PinMismatch, HubError, DiskSpaceError, or TransferError once retries are
    exhausted (the partial and its sidecar stay for the next run).
    """
    try:
        return await _download_to_partial(session, **kw)
    except (Retryable, httpx.TransportError) as exc:
        raise gave_up(kw["repo"], kw["path"], exc, _claimed(kw["partial_dir"], kw["repo"], kw["path"])) from exc


def _claimed(partial_dir: Path, repo: str, path: str) -> int:
    side = read_sidecar(partial_paths(partial_dir, repo, path)[1])
    return side.done_bytes if side else 0


async def _download_to_partial(
    session: HubSession,
    *,
    repo: str,
    revision: str,
    path: str,
    expected_size: int | None,
    expected_sha256: str | None,
    partial_dir: Path,
    connections: int | None = None,
    progress: Callable[[int, int], ProgressReporter] | None = None,
    git_sha1: bool = False,
    max_size_bytes: int | None = None,
    static: StaticPins | None = None,
) -> DownloadOutcome:
    if not is_commit(revision):
        raise PinMismatch(f"{repo}/{path}: revision {revision!r} is not a 40-hex commit",
                          hint="pin the entry to a commit (hotfit registry lock)", repo=repo, file=path)
    options = session.options
    conns = max(1, connections or options.connections)
    partial, sidecar_path, _lock = partial_paths(partial_dir, repo, path)
    targets: tuple[tuple[Path, Literal["file", "directory"]], ...] = (
        (partial_dir, "directory"), (partial, "file"), (sidecar_path, "file"))
    for p, kind in targets:
        checked_write_path(p, kind=kind)
    partial_dir.mkdir(parents=True, exist_ok=True)
    # One deadline for the whole file: retries of every block and HEAD share it.
    counters: dict[str, Any] = {"attempts": 0, "transferred": 0, "deadline": time.monotonic() + options.max_total_retry_s}

    remote = await head_retrying(session, repo, revision, path, expected_size=expected_size,
                                 expected_sha256=expected_sha256, pinned=True,
                                 deadline=counters["deadline"], counters=counters,
                                 done_bytes=lambda: _claimed(partial_dir, repo, path), static=static)
    size = remote.size_bytes if remote.size_bytes is not None else expected_size
    if size is None:
        raise HubError(f"{repo}/{path}: the Hub did not report a size and the registry has none",
                       hint="pin the entry's size_bytes", repo=repo, file=path)
    if max_size_bytes is not None and size > max_size_bytes:  # before a byte is fetched
        raise IntegrityError(f"{repo}/{path} is too large: {size} bytes, more than the {max_size_bytes} such a "
                             "file may have",
                             hint="the entry names the wrong file; fix it after review", field="size_bytes",
                             repo=repo, file=path, size_bytes=size, max_size_bytes=max_size_bytes)
    if expected_sha256 and remote.lfs_sha256 and remote.lfs_sha256 != expected_sha256:
        raise PinMismatch(
            f"{repo}/{path}: the Hub's LFS sha256 {remote.lfs_sha256} differs from the registry's {expected_sha256}",
            hint="the registry pins a different file than this commit holds; fix the entry after review",
            repo=repo, file=path, hub_sha256=remote.lfs_sha256, registry_sha256=expected_sha256)

    # Before anything is planned or allocated: a size the disk cannot hold ends here.
    check_disk_space(partial_dir, max(0, size - bytes_held(sidecar_path, partial)), f"{repo}/{path}")
    wanted = Sidecar(url=remote.resolve_url, repo=repo, revision=revision, file=path, size_bytes=size,
                     expected_sha256=expected_sha256, etag=remote.etag, ranges_supported=True)
    side = read_sidecar(sidecar_path) if partial.exists() else None
    if side is not None and not side.matches(wanted):
        log.info("download.partial_discarded", file=path, reason="sidecar is for another target or pin")
        side = None
    if side is None:
        discard_partial(partial, sidecar_path)
        side = wanted
        blocks = plan_blocks(size, conns, options, ranges=True)
    elif not side.ranges_supported:  # this server cannot resume: every run starts at byte 0
        blocks = [Block(0, size)]
    else:
        blocks = [Block(s, e, d) for s, e, d in side.blocks]
        if os.path.getsize(partial) < max((b.start + b.done for b in blocks if b.done), default=0):
            log.warning("download.partial_short", file=path)  # truncated behind our back: start over
            blocks = plan_blocks(size, conns, options, ranges=side.ranges_supported)
    resumed = sum(b.done for b in blocks)
    if resumed:
        log.info("download.resume", file=path, done_bytes=resumed, size_bytes=size, blocks=len(blocks))

    fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    preallocate(fd, size)
    restarts = 0
    try:
        while True:
            reporter = progress(size, sum(b.done for b in blocks)) if progress else None
            hasher = OrderedHasher(fd, size, buffer_bytes=options.hash_buffer_bytes, git_sha1=git_sha1,
                                   hashing=options.hash_while_streaming)
            for b in blocks:  # bytes from an earlier run: read back once when the frontier gets there
                hasher.mark_on_disk(b.start, b.start + b.done)
            try:
                await _run_blocks(session, remote, side, blocks, fd, partial, sidecar_path, hasher,
                                  reporter, conns, counters, expected_size, static)
            except RangeIgnored:
                hasher.abort()
                restarts += 1
                if restarts > options.max_attempts_without_progress:
                    raise TransientTransferError(
                        f"{repo}/{path}: the server ignores Range and the stream keeps breaking",
                        hint="rerun later or use another HF_ENDPOINT mirror", repo=repo, file=path) from None
                log.warning("download.range_ignored", file=path,
                            detail="server answered 200 to a ranged GET; restarting as one stream from byte 0")
                side.ranges_supported = False
                blocks = [Block(0, size)]
                write_sidecar(sidecar_path, encode_sidecar(side, blocks))
                continue
            except BaseException:
                hasher.abort()
                raise
            if reporter:
                reporter.close()
            sha256, sha1 = await anyio.to_thread.run_sync(hasher.finish)
            break
        os.fsync(fd)
        if os.fstat(fd).st_size != size:  # a wrong-size server cannot leave a longer file behind
            os.ftruncate(fd, size)
    except BaseException:
        # A failed or interrupted download keeps what its sidecar claims and gives back the rest of
        # its reservation; only a kill -9 leaves it whole, and the rerun counts it once (bytes_held).
        released = release_unclaimed(fd, blocks)
        if released:
            log.info("download.reservation_released", file=path, released_bytes=released,
                     claimed_bytes=sum(b.done for b in blocks))
        raise
    finally:
        os.close(fd)
    return DownloadOutcome(
        partial_path=partial, repo=repo, revision=revision, file=path, size_bytes=size, sha256=sha256,
        git_sha1=sha1, hub_lfs_sha256=remote.lfs_sha256, etag=remote.etag,
        bytes_transferred=counters["transferred"], bytes_reread=hasher.reread_bytes,
        resumed_from_bytes=resumed, connections=conns if len(blocks) > 1 else 1,
        ranges_supported=side.ranges_supported, attempts=counters["attempts"])


async def _run_blocks(session: HubSession, remote: RemoteFile, side: Sidecar, blocks: list[Block], fd: int,
                      partial: Path, sidecar_path: Path, hasher: OrderedHasher,
                      reporter: ProgressReporter | None, conns: int, counters: dict[str, Any],
                      expected_size: int | None, static: StaticPins | None = None) -> None:
    """Run the workers over the pending blocks, checkpointing the sidecar; the last checkpoint is
    written even on failure or cancellation so a rerun resumes."""
    pending = [b for b in blocks if not b.complete]
    cursor = iter(pending)
    state = {"url": remote.download_url}
    lock = anyio.Lock()
    whole = len(blocks) == 1

    def sync_partial() -> None:
        try:
            os.fdatasync(fd)
        except OSError as exc:  # a full, read-only or failing disk names the partial (core.diskspace)
            if (mapped := write_failure(exc, partial, needed_bytes=None, what="the partial download")) is None:
                raise
            raise mapped from None

    def checkpoint() -> None:
        claimed = encode_sidecar(side, blocks)
        sync_partial()
        write_sidecar(sidecar_path, claimed)

    async def fresh_url() -> str:
        """Re-HEAD before a resume (CDN links expire); re-checks the pin and size each time."""
        async with lock:
            again = await session.head_pinned(side.repo, side.revision, side.file, expected_size, side.expected_sha256,
                                              static)
            state["url"] = again.download_url
            return again.download_url

    async def fetch_block(block: Block) -> None:
        first = True
        attempts = retrying(session.options, progress_fn=lambda: block.done, deadline=counters["deadline"],
                            before_sleep=log_retry(side.repo, side.file, lambda: state["url"]))
        stop = attempts.stop
        assert isinstance(stop, StopPolicy)  # retrying() sets it; its count of attempts without progress is read below
        async for attempt in attempts:
            with attempt:
                counters["attempts"] += 1
                # Right after an attempt that made progress the link and its URL were working: resume at
                # once (a cut costs one GET). Otherwise re-HEAD first: the signed link may have expired.
                url = state["url"] if first or stop.without_progress == 0 else await fresh_url()
                first = False
                await stream_block(session, side, block, url, whole=whole, partial=partial, hasher=hasher,
                                   reporter=reporter, counters=counters)

    async def worker() -> None:
        for block in cursor:
            await fetch_block(block)

    async def checkpointer() -> None:
        # The sidecar only claims bytes that were pwrite-n before an fdatasync that completed, so it
        # is true after a power loss too; syncing as we go also leaves little for the final fsync.
        while True:
            await anyio.sleep(session.options.checkpoint_interval_s)
            claimed = encode_sidecar(side, blocks)
            await anyio.to_thread.run_sync(sync_partial)
            write_sidecar(sidecar_path, claimed)

    checkpoint()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(checkpointer)
            async with anyio.create_task_group() as workers:
                for _ in range(min(conns, len(pending)) or 1):
                    workers.start_soon(worker)
            tg.cancel_scope.cancel()
    except BaseException as exc:
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(OSError, DiskSpaceError, DiskWriteError):  # the error being raised says more
                checkpoint()
        raise _unwrap(exc) from None
    checkpoint()


def _unwrap(exc: BaseException) -> BaseException:
    """The first meaningful error out of nested task-group exception groups."""
    while isinstance(exc, BaseExceptionGroup):
        preferred = [e for e in exc.exceptions if not isinstance(e, anyio.get_cancelled_exc_class())]
        exc = (preferred or list(exc.exceptions))[0]
    return exc

"""One ranged GET into the partial file: the write path of the block scheduler.

Each block is one ``Range`` request on a pooled connection; the answer is checked against the pin
(206 with the asked range of a file of the pinned size, or 200 with the pinned length for a whole-file
stream) before a byte is written. Bytes land at absolute offsets (network-sized chunks gathered up to
``chunk_bytes``, one ``pwritev`` each, no copy); whatever is gathered when the stream breaks is still
written, so a cut loses no received byte. The event loop only receives: the write-behind thread of
``download.hashing`` writes, counts and hashes. A 200 to a ranged GET is :class:`RangeIgnored`: the
scheduler restarts the file as one stream from byte 0.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import anyio

from core.errors import PinMismatch, TransferError
from download.disk import DISK_FULL_ERRNOS, disk_error
from download.hashing import WRITE_QUEUE_BYTES, OrderedHasher
from download.hub import HubSession
from download.hub_errors import Retryable, hub_error_from_response
from download.progress import ProgressReporter
from download.sidecar import Block, Sidecar

_CONTENT_RANGE_RE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class RangeIgnored(Exception):
    """The server answered 200 (whole body) to a ranged GET."""


def parse_content_range(value: str | None) -> tuple[int, int, int | None] | None:
    m = _CONTENT_RANGE_RE.match((value or "").strip())
    if not m:
        return None
    total = None if m.group(3) == "*" else int(m.group(3))
    return int(m.group(1)), int(m.group(2)), total


def _check_answer(resp: Any, session: HubSession, side: Sidecar, block: Block, offset: int, whole: bool) -> None:
    """Raise unless ``resp`` carries exactly the bytes asked for of the pinned file."""
    if resp.status_code == 206:
        cr = parse_content_range(resp.headers.get("content-range"))
        if cr is None or cr[0] != offset or cr[1] >= block.end or (cr[2] is not None and cr[2] != side.size_bytes):
            raise PinMismatch(
                f"{side.file}: server answered range {resp.headers.get('content-range')!r} "
                f"to bytes={offset}-{block.end - 1} of a {side.size_bytes}-byte file",
                hint="the server's file differs from the pinned one; nothing was written",
                repo=side.repo, file=side.file)
    elif resp.status_code == 200:
        if offset != 0 or not whole:
            raise RangeIgnored()
        length = resp.headers.get("content-length", "")
        if length.isdigit() and int(length) != side.size_bytes:
            raise PinMismatch(
                f"{side.file}: server sends {length} bytes, the pin says {side.size_bytes}",
                hint="the served file is not the pinned one; fix the registry entry after review",
                repo=side.repo, file=side.file, served_size_bytes=int(length),
                expected_size_bytes=side.size_bytes)
    elif resp.status_code == 416:
        raise PinMismatch(
            f"{side.file}: server refused bytes={offset}- ({resp.headers.get('content-range')})",
            hint="the served file is shorter than the pin says; fix the registry entry after review",
            repo=side.repo, file=side.file)
    elif resp.status_code in (401, 403, 410) and not session.is_own_origin(str(resp.url)):
        # A signed CDN link expired (real ones do, hours into a pull): the retry re-HEADs the
        # Hub for a fresh one, and the Hub itself answers gating/not-found properly.
        raise Retryable(f"{side.file}: CDN answered HTTP {resp.status_code} (link expired?)")
    else:
        from_endpoint = session.is_own_origin(str(resp.url))
        raise hub_error_from_response(resp, repo=side.repo, revision=side.revision, path=side.file,
                                      endpoint=session.endpoint if from_endpoint else None)
    encoding = resp.headers.get("content-encoding", "identity").lower()
    if encoding not in ("identity", ""):
        raise TransferError(f"{side.file}: server compressed the body ({encoding}); byte offsets unusable",
                            hint="use an endpoint that serves raw bytes", file=side.file)


class _Writer:
    """Gathers received chunks and hands them to the write-behind thread at their absolute offset."""

    def __init__(self, partial: Path, block: Block, pos: int, hasher: OrderedHasher,
                 reporter: ProgressReporter | None, counters: dict[str, Any]) -> None:
        self.partial, self.block, self.pos = partial, block, pos
        self.hasher, self.reporter, self.counters = hasher, reporter, counters
        self.parts: list[bytes] = []
        self.gathered = 0

    def add(self, chunk: bytes) -> None:
        self.parts.append(chunk)
        self.gathered += len(chunk)

    async def flush(self) -> None:
        if self.parts:
            todo, n = self.parts, self.gathered
            self.parts, self.gathered = [], 0
            self.hasher.write(self.pos, todo, n, self.block)
            self.pos += n
            self.counters["transferred"] += n
            if self.reporter:
                self.reporter.advance(n)
        self.raise_write_error()
        if self.hasher.write_queued_bytes > WRITE_QUEUE_BYTES:  # the disk is slower than the network
            await anyio.to_thread.run_sync(self.hasher.wait_written, WRITE_QUEUE_BYTES // 2)

    async def drain(self) -> None:
        """Wait until every byte handed over is written (``block.done`` is then exact)."""
        await anyio.to_thread.run_sync(self.hasher.wait_written, 0)
        self.raise_write_error()

    def raise_write_error(self) -> None:
        if self.hasher.thread_error is not None:
            raise self.hasher.thread_error
        if self.hasher.write_error is not None:
            exc, at = self.hasher.write_error
            if exc.errno in DISK_FULL_ERRNOS:
                raise disk_error(exc, self.partial, at) from exc
            raise exc


async def stream_block(session: HubSession, side: Sidecar, block: Block, url: str, *, whole: bool,
                       partial: Path, hasher: OrderedHasher, reporter: ProgressReporter | None,
                       counters: dict[str, Any]) -> None:
    """GET what ``block`` still lacks from ``url`` and write it in place; Retryable when the stream
    ended short (the retry resumes at the new ``block.done``)."""
    offset = block.start + block.done
    extra = {} if (whole and block.done == 0) else {"range": f"bytes={offset}-{block.end - 1}"}
    chunk_bytes = session.options.chunk_bytes
    async with session.client.stream("GET", url, headers=session.headers_for(url, extra),
                                     follow_redirects=True) as resp:
        _check_answer(resp, session, side, block, offset, whole)
        writer = _Writer(partial, block, offset, hasher, reporter, counters)
        try:
            async for chunk in resp.aiter_raw():
                room = block.end - writer.pos - writer.gathered
                if room <= 0:
                    raise PinMismatch(f"{side.file}: server sent more than {side.size_bytes} bytes",
                                      hint="the served file is not the pinned one", repo=side.repo,
                                      file=side.file)
                if len(chunk) > room:
                    chunk = chunk[:room]
                writer.add(chunk)
                if writer.gathered >= chunk_bytes:
                    await writer.flush()
        finally:
            # Even when the stream broke: what was received is written, and a retry resumes at the
            # exact ``block.done``. Shielded: a cancelled download still leaves its bytes counted.
            with anyio.CancelScope(shield=True):
                await writer.flush()
                await writer.drain()
    if not block.complete:
        raise Retryable(f"{side.file}: connection closed at byte {writer.pos} of block ending {block.end}")

"""The download engine shared by fetch-weights, fetch-template and the OpenVINO snapshot.

Ours, on ``httpx``: ``huggingface_hub`` ≥ 1.18 no longer resumes across processes and never hashes
(``../shared/reference/hf-protocol.md`` §1.5, anchors.md §5), so it serves only for the token store
and metadata calls. What this module guarantees for one pinned Hub file:

- **Pinned.** URLs name the 40-hex commit; a HEAD (fresh before every run and every retry — real CDN
  links are signed and expire) must answer ``X-Repo-Commit`` == the pin and the registry's size, else
  :class:`PinMismatch` before a byte is written (issue 4 §1).
- **Resumable.** Bytes go to ``<dir>/.partial/<name>.part`` at absolute offsets; a JSON sidecar beside it
  (``.json``: URL, commit, size, expected sha256, per-block ``done`` bytes) is rewritten atomically
  every ``checkpoint_interval_s``, claiming only bytes written before an ``fdatasync`` that completed —
  so it is true after ``kill -9`` and after a power loss; each connection re-sends at most what it
  received since the last checkpoint (< one block). Should a disk lie anyway, the sha256 check catches
  it (the file is then discarded and fetched again).
- **Parallel.** A file ≥ ``min_parallel_bytes`` is cut into blocks handed out *in file order* to
  ``connections`` workers, each block one ``Range`` request on a pooled connection, each resumable.
- **Hashed while streaming** (:class:`OrderedHasher`): sha256 must see bytes in order, ranges arrive
  out of order. A hashing thread consumes the contiguous prefix: chunks at the frontier are hashed
  as they arrive; chunks ahead of it wait in a bounded memory buffer (``hash_buffer_bytes``) and are
  hashed once the frontier reaches them; what does not fit is *spilled* — already on disk, read back
  once when the frontier arrives (hot in the page cache: written moments before). On resume the
  bytes already on disk are read back once. Every byte read back is counted in ``bytes_reread``;
  no second pass over a completed file ever happens.
- **Range-ignoring servers** (200 to a ranged GET) are detected; the transfer restarts as one stream
  from byte 0 writing at absolute offsets, so nothing is appended in the wrong place.
- **Retries** (tenacity): exponential backoff with jitter, ``Retry-After`` honoured on 429/503 (capped),
  the attempt counter reset whenever bytes arrived, and a bounded time spent failing (new bytes restart it).
  Every wait is announced as a ``download.retry`` event (attempt, cause, wait_s, the URL without
  credentials or signed query), so an unreachable mirror is never minutes of silence.
- **Disk**: free space is checked before starting (``statvfs``; blocks the partial already holds
  count as held); ENOSPC/EFBIG mid-write stops every connection, checkpoints the sidecar and raises
  :class:`DiskSpaceError` — the partial is kept. On Linux the partial's blocks are reserved up front
  (``fallocate`` KEEP_SIZE) and each written chunk's writeback is started at once
  (``sync_file_range``), so a checkpoint's ``fdatasync`` finds little left and never stalls the stream.

Entry points: :class:`HubSession` (HEAD/GET with pinning, errors, token), :func:`download_to_partial`,
:func:`finalize_file` (fsync + atomic rename + fsync dir), :class:`ProgressReporter`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import queue
import re
import shutil
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import quote, urljoin, urlsplit, urlunsplit

import anyio
import httpx
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    wait_exponential_jitter,
)

from core.errors import (
    DiskSpaceError,
    HubError,
    IntegrityError,
    PinMismatch,
    TransferError,
    UsageError,
)
from core.log import get_logger
from core.settings import Settings
from state.files import finalize_file, fsync_dir, write_text_atomic  # noqa: F401  (re-exported)

__all__ = [
    "TransferOptions",
    "HubSession",
    "RemoteFile",
    "DownloadOutcome",
    "OrderedHasher",
    "ProgressReporter",
    "download_to_partial",
    "head_retrying",
    "finalize_file",
    "discard_partial",
    "adopt_as_partial",
    "partial_paths",
    "resolve_token",
    "is_commit",
    "safe_relpath",
    "check_endpoint",
    "redact_url",
    "log_retry",
    "NOT_A_HUB",
    "not_a_hub_error",
    "hf_exception_not_a_hub",
]

log = get_logger()

MiB = 1024 * 1024

# httpcore reads at most 64 KiB per recv(); at local/LAN speeds the per-read overhead of the HTTP/1.1
# parser then caps one Python stream well below curl. 256 KiB measured ~35 % faster (scripts/
# bench-download). It only raises the *maximum* bytes taken per read — semantics are unchanged — but
# it is a class attribute, so it applies to every httpx client in this process.
_HTTPCORE_READ_BYTES = 256 * 1024
try:
    import httpcore._async.http11 as _h11

    if getattr(_h11.AsyncHTTP11Connection, "READ_NUM_BYTES", 0) < _HTTPCORE_READ_BYTES:
        _h11.AsyncHTTP11Connection.READ_NUM_BYTES = _HTTPCORE_READ_BYTES
except (ImportError, AttributeError):  # pragma: no cover - a future httpcore: keep its default
    pass
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_CONTENT_RANGE_RE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
SIDECAR_SCHEMA = 1
# Keep this much free beyond what the file needs: a filesystem at 100 % misbehaves for everyone.
DISK_MARGIN_BYTES = 64 * MiB


def is_commit(revision: str | None) -> bool:
    return bool(revision) and bool(_COMMIT_RE.match(revision or ""))


@dataclass(frozen=True)
class TransferOptions:
    """Knobs of the engine; defaults suit 1–20 GB files over a WAN link."""

    connections: int = 4
    block_bytes: int | None = None  # None: size / (connections × 4), clamped to [1, 64] MiB
    min_parallel_bytes: int = 2 * MiB  # below this one stream beats the per-request overhead
    max_attempts_without_progress: int = 6
    max_total_retry_s: float = 900.0  # one file gives up after this much time spent failing
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    retry_after_cap_s: float = 120.0  # a Retry-After beyond this is treated as "give up"
    checkpoint_interval_s: float = 0.25  # what a kill -9 can cost per connection: this long of bytes
    hash_buffer_bytes: int = 64 * MiB  # out-of-order bytes held for in-stream hashing
    connect_timeout_s: float = 15.0
    read_timeout_s: float = 60.0  # a stalled stream is retried after this
    chunk_bytes: int = 1 * MiB
    # False only for scripts/bench-download's "download alone" baseline: the outcome then has no
    # sha256 and nothing downstream can verify it.
    hash_while_streaming: bool = True

    def block_size_for(self, size_bytes: int, connections: int) -> int:
        if self.block_bytes:
            return self.block_bytes
        return max(1 * MiB, min(64 * MiB, size_bytes // max(1, connections * 4) or 1))


# --------------------------------------------------------------------------- pure helpers


def safe_relpath(path: str) -> str:
    """A repository path that stays inside its directory, or ``ValueError`` (absolute, ``..``, NUL…)."""
    if not path or "\x00" in path or "\\" in path or path.startswith("/") or len(path) > 4096:
        raise ValueError(f"unsafe path {path!r}")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"unsafe path {path!r}")
    return path


def _partial_stem(repo: str, path: str) -> str:
    # Unique per (repo, path), readable, one path component.
    digest = hashlib.sha1(f"{repo}\0{path}".encode()).hexdigest()[:10]
    base = re.sub(r"[^A-Za-z0-9._-]", "_", path.rsplit("/", 1)[-1])[:120]
    return f"{base}.{digest}"


def partial_paths(partial_dir: Path, repo: str, path: str) -> tuple[Path, Path, Path]:
    """(partial data file, sidecar JSON, lock file) for one target."""
    stem = _partial_stem(repo, path)
    return partial_dir / f"{stem}.part", partial_dir / f"{stem}.json", partial_dir / f"{stem}.lock"


def parse_content_range(value: str | None) -> tuple[int, int, int | None] | None:
    m = _CONTENT_RANGE_RE.match((value or "").strip())
    if not m:
        return None
    total = None if m.group(3) == "*" else int(m.group(3))
    return int(m.group(1)), int(m.group(2)), total


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or HTTP date)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        from email.utils import parsedate_to_datetime

        when = parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


def resolve_token() -> str | None:
    """``HF_TOKEN`` or the huggingface_hub token store (never logged)."""
    try:
        from huggingface_hub import get_token

        return get_token()
    except Exception:  # a broken token store must not break anonymous downloads
        return os.environ.get("HF_TOKEN") or None


# --------------------------------------------------------------------------- errors (internal)


class _Retryable(Exception):
    """A failure worth another attempt; ``retry_after_s`` from the server when it said so."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class _RangeIgnored(Exception):
    """The server answered 200 (whole body) to a ranged GET."""


NOT_A_HUB = "HF_ENDPOINT does not answer like a Hugging Face Hub"


def not_a_hub_error(endpoint: str, url: str, answered: str) -> HubError:
    """The endpoint is some other web server (a mistyped HF_ENDPOINT, a proxy's landing page, a plain
    file server): its answer says nothing about the registry, so the registry is not blamed."""
    return HubError(
        f"{NOT_A_HUB}: {redact_url(url)} {answered}",
        hint=f"HF_ENDPOINT is {redact_url(endpoint)}; point it at the Hub (https://huggingface.co, or unset it) "
             "or at a mirror that speaks the Hub's protocol (X-Repo-Commit on resolve answers, X-Error-Code "
             "on errors), then rerun",
        endpoint=redact_url(endpoint), url=redact_url(url), hub_code=None)


def _speaks_hub(resp: httpx.Response) -> bool:
    """The real Hub puts X-Error-Code on every 404 and X-Repo-Commit on every resolve answer
    (hf-protocol.md §3): a 404 carrying neither did not come from a Hub."""
    return bool(resp.headers.get("x-error-code") or resp.headers.get("x-repo-commit"))


def _answer_text(status: int, content_type: str | None) -> str:
    kind = (content_type or "").split(";")[0].strip()
    return f"answered HTTP {status}" + (f" ({kind})" if kind else "")


def hf_exception_not_a_hub(exc: BaseException, endpoint: str, url: str) -> HubError | None:
    """For a ``huggingface_hub`` API call (model_info, list_repo_tree): the not-a-Hub error when the
    failure shows the endpoint is no Hub — a 404 without X-Error-Code, or a body that is not JSON."""
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(exc, HfHubHTTPError):
        resp = getattr(exc, "response", None)
        if resp is not None and resp.status_code == 404 and not (
                resp.headers.get("x-error-code") or resp.headers.get("x-repo-commit")):
            return not_a_hub_error(endpoint, str(resp.url), _answer_text(404, resp.headers.get("content-type"))
                                   + " without the Hub's X-Error-Code")
        return None
    if isinstance(exc, ValueError):  # json.JSONDecodeError: an HTML page where the API answers JSON
        return not_a_hub_error(endpoint, url, "answered with a body that is not the Hub API's JSON")
    return None


def hub_error_from_response(resp: httpx.Response, *, repo: str, revision: str, path: str | None,
                            endpoint: str | None = None) -> Exception:
    """Map an error response to a typed error (hf-protocol.md §3.1), or a retryable one.

    ``endpoint``: the response came from HF_ENDPOINT itself (not a CDN), so an answer without the
    Hub's headers means the endpoint is not a Hub."""
    status = resp.status_code
    code = resp.headers.get("x-error-code", "")
    message = resp.headers.get("x-error-message", "")
    target = f"{repo}@{revision[:12]}" + (f" {path}" if path else "")
    if endpoint is not None and status == 404 and not _speaks_hub(resp):
        return not_a_hub_error(endpoint, str(resp.request.url),
                               _answer_text(status, resp.headers.get("content-type")) + " without the Hub's "
                               "X-Error-Code")
    if status in _RETRYABLE_STATUS:
        return _Retryable(f"HTTP {status} for {target}" + (f": {message}" if message else ""),
                          parse_retry_after(resp.headers.get("retry-after")))
    details = {"repo": repo, "revision": revision, "file": path, "status": status, "hub_code": code or None}
    if code == "GatedRepo" or (status in (401, 403) and "gated" in message.lower()):
        return HubError(
            f"{repo} is gated: access to {path or 'it'} requires accepting its licence",
            hint=f"accept the licence at https://huggingface.co/{repo} with your account, then set HF_TOKEN "
                 "(or run `hf auth login`) on this machine and rerun",
            **details)
    if code == "RepoNotFound" or (status == 401 and not code):
        return HubError(f"repository {repo} not found (or private)",
                        hint="check the registry entry's repo; for a private repo set HF_TOKEN", **details)
    if code == "RevisionNotFound":
        return HubError(f"revision {revision} not found in {repo}",
                        hint="the pinned commit no longer exists; re-pin the entry (hotfit registry lock)",
                        **details)
    if code == "EntryNotFound" or status == 404:
        return HubError(f"{path or 'file'} not found in {repo} at {revision[:12]}",
                        hint="the file was renamed or removed at that revision; fix the registry entry",
                        **details)
    return HubError(f"Hub answered HTTP {status} for {target}" + (f": {message}" if message else ""),
                    hint="check HF_ENDPOINT and the network, then rerun", **details)


# --------------------------------------------------------------------------- Hub session


@dataclass(frozen=True)
class RemoteFile:
    """What a HEAD on the pinned resolve URL said."""

    resolve_url: str
    download_url: str  # CDN Location when the Hub redirects off-origin, else the resolve URL
    commit: str
    etag: str | None  # sha256 for LFS files, git blob sha1 otherwise
    size_bytes: int | None
    lfs_sha256: str | None  # from X-Linked-Etag when it is a sha256
    accept_ranges: bool


def check_endpoint(endpoint: str) -> str:
    """``HF_ENDPOINT`` as a base URL, or a UsageError (exit 2) at once — not minutes of retries
    ending in a transfer error. A path after the host (a mirror under a prefix) is fine."""
    parts = urlsplit(endpoint)
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        raise UsageError(f"HF_ENDPOINT={endpoint!r} is not an http(s) URL",
                         hint="set HF_ENDPOINT to the Hub or mirror base URL, e.g. https://huggingface.co "
                              "(or unset it)", variable="HF_ENDPOINT", value=endpoint)
    return endpoint.rstrip("/")


class HubSession:
    """An ``httpx.AsyncClient`` bound to one endpoint and token. Use ``async with``."""

    def __init__(self, settings: Settings, options: TransferOptions | None = None,
                 token: str | None | bool = None) -> None:
        # Offline, nothing is requested: a stale HF_ENDPOINT must not break a rerun from disk.
        self.endpoint = settings.hf_endpoint.rstrip("/") if settings.hf_offline else check_endpoint(settings.hf_endpoint)
        self.offline = settings.hf_offline
        self.options = options or TransferOptions(connections=settings.download_connections)
        self._token = resolve_token() if token is None else (token or None)
        self._origin = _origin(self.endpoint)
        limits = httpx.Limits(max_connections=max(8, self.options.connections * 2),
                              max_keepalive_connections=max(8, self.options.connections * 2))
        timeout = httpx.Timeout(self.options.read_timeout_s, connect=self.options.connect_timeout_s)
        self.client = httpx.AsyncClient(limits=limits, timeout=timeout, follow_redirects=False,
                                        headers={"user-agent": "hotfit/0.1"}, trust_env=False)

    async def __aenter__(self) -> "HubSession":
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.client.aclose()

    def resolve_url(self, repo: str, revision: str, path: str) -> str:
        return f"{self.endpoint}/{repo}/resolve/{quote(revision, safe='')}/{quote(path)}"

    def headers_for(self, url: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        """Authorization only to the endpoint's origin (never to a CDN)."""
        headers = {"accept-encoding": "identity"}
        if self._token and _origin(url) == self._origin:
            headers["authorization"] = f"Bearer {self._token}"
        if extra:
            headers.update(extra)
        return headers

    def _check_online(self, what: str) -> None:
        if self.offline:
            raise HubError(f"HF_HUB_OFFLINE is set and {what} is not on disk",
                           hint="unset HF_HUB_OFFLINE (or set it to 0) to download, or copy the files in")

    async def head(self, repo: str, revision: str, path: str) -> RemoteFile:
        """HEAD the resolve URL, following same-origin redirects by hand (hf-protocol.md §6)."""
        self._check_online(f"{repo}/{path}")
        url = resolve = self.resolve_url(repo, revision, path)
        commit = etag = linked_etag = None
        size: int | None = None
        accept_ranges = False
        for _hop in range(10):
            try:
                resp = await self.client.head(url, headers=self.headers_for(url))
            except httpx.TransportError as exc:
                raise _Retryable(f"HEAD {repo}/{path}: {exc.__class__.__name__}: {exc}") from exc
            commit = resp.headers.get("x-repo-commit") or commit
            linked_etag = resp.headers.get("x-linked-etag") or linked_etag
            etag = resp.headers.get("etag") or etag
            if resp.headers.get("x-linked-size", "").isdigit():
                size = int(resp.headers["x-linked-size"])
            if resp.headers.get("accept-ranges", "").lower() == "bytes":
                accept_ranges = True
            if resp.is_redirect:
                target = urljoin(url, resp.headers.get("location", ""))
                if _origin(target) == self._origin:
                    url = target
                    continue
                url = target  # off-origin: a CDN; its signed URL is where the bytes come from
                break
            if resp.status_code >= 400:
                raise hub_error_from_response(resp, repo=repo, revision=revision, path=path,
                                              endpoint=self.endpoint)
            if size is None and resp.headers.get("content-length", "").isdigit():
                size = int(resp.headers["content-length"])
            break
        else:
            raise HubError(f"too many redirects resolving {repo}/{path}",
                           hint="check HF_ENDPOINT points at a Hugging Face Hub (or a faithful mirror)",
                           repo=repo, file=path)
        if not commit:  # every resolve answer of a Hub names the commit (hf-protocol.md §1)
            raise not_a_hub_error(self.endpoint, url, _answer_text(resp.status_code, resp.headers.get("content-type"))
                                  + f" for {repo}/{path} without X-Repo-Commit")
        tag = _normalize_etag(linked_etag or etag)
        lfs = _normalize_etag(linked_etag)
        return RemoteFile(resolve_url=resolve, download_url=url, commit=commit, etag=tag, size_bytes=size,
                          lfs_sha256=lfs if lfs and _SHA256_RE.match(lfs) else None,
                          accept_ranges=accept_ranges)

    async def head_pinned(self, repo: str, revision: str, path: str, expected_size: int | None) -> RemoteFile:
        """HEAD and fail closed unless the commit is the pin and the size the registry's (issue 4 §1)."""
        remote = await self.head(repo, revision, path)
        if remote.commit != revision:
            raise PinMismatch(
                f"{repo}/{path}: the Hub served commit {remote.commit} but the registry pins {revision}",
                hint="the pinned revision is not what the server resolves; re-pin the entry after review "
                     "(hotfit registry lock) — a moved branch is never accepted silently",
                repo=repo, file=path, pinned=revision, served=remote.commit)
        if expected_size is not None and remote.size_bytes is not None and remote.size_bytes != expected_size:
            raise PinMismatch(
                f"{repo}/{path}: the Hub reports {remote.size_bytes} bytes, the registry pins {expected_size}",
                hint="the registry's size is wrong for this commit; fix the entry after review",
                repo=repo, file=path, expected_size_bytes=expected_size, served_size_bytes=remote.size_bytes)
        return remote


def redact_url(url: str) -> str:
    """``url`` as it may be logged: no ``user:password@`` and no query (signed CDN links carry their
    credentials there)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal keeps its brackets
        host = f"[{host}]"
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme.lower(), parts.netloc.lower()


def _normalize_etag(value: str | None) -> str | None:
    if not value:
        return None
    value = value.strip()
    if value.startswith("W/"):
        value = value[2:]
    return value.strip('"') or None


# --------------------------------------------------------------------------- ordered hashing


class OrderedHasher:
    """sha256 (and optionally git blob sha1) of a file whose bytes arrive out of order.

    ``feed(offset, data)`` is called from the event loop *after* ``data`` was written at ``offset``;
    it only enqueues. A daemon thread keeps the frontier: data at the frontier is hashed, data ahead
    of it is buffered (bounded by ``buffer_bytes``) or, past the bound, remembered as an on-disk
    interval and read back with ``pread`` when the frontier reaches it (counted in ``reread_bytes``).
    ``mark_on_disk(start, end)`` declares bytes written by an earlier run (resume).
    """

    _STOP = object()

    def __init__(self, fd: int, size_bytes: int, *, buffer_bytes: int, git_sha1: bool = False) -> None:
        self._fd = fd
        self.size_bytes = size_bytes
        self._buffer_limit = buffer_bytes
        self._sha256 = hashlib.sha256()
        self._sha1 = hashlib.sha1(b"blob %d\0" % size_bytes) if git_sha1 else None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued_bytes = 0  # data bytes sitting in the queue (memory held)
        self.frontier = 0
        self.reread_bytes = 0
        self._pending: dict[int, bytes | list[bytes]] = {}
        self._pending_bytes = 0
        self._on_disk: dict[int, int] = {}  # start -> end of intervals to read back
        self._error: BaseException | None = None
        self._abort = False
        self._thread = threading.Thread(target=self._run, name="hotfit-hash", daemon=True)
        self._thread.start()

    def feed(self, offset: int, data: bytes | list[bytes]) -> None:
        n = len(data) if isinstance(data, bytes) else sum(map(len, data))
        with self._lock:
            over = self._queued_bytes + n > self._buffer_limit
            if not over:
                self._queued_bytes += n
        if over:  # bound memory: the bytes are on disk already, read them back later
            self._queue.put((offset, offset + n, None))
        else:
            self._queue.put((offset, offset + n, data))

    def mark_on_disk(self, start: int, end: int) -> None:
        if end > start:
            self._queue.put((start, end, None))

    def _hash(self, data: bytes | list[bytes]) -> None:
        for part in [data] if isinstance(data, bytes) else data:
            self._sha256.update(part)
            if self._sha1 is not None:
                self._sha1.update(part)

    @staticmethod
    def _size(data: bytes | list[bytes]) -> int:
        return len(data) if isinstance(data, bytes) else sum(map(len, data))

    def _read_back(self, start: int, end: int) -> None:
        pos = start
        while pos < end:
            chunk = os.pread(self._fd, min(8 * MiB, end - pos), pos)
            if not chunk:
                raise OSError(errno.EIO, f"short read at byte {pos} while hashing")
            self._hash(chunk)
            pos += len(chunk)
        self.reread_bytes += end - start

    def _drain(self) -> None:
        while True:
            data = self._pending.pop(self.frontier, None)
            if data is not None:
                n = self._size(data)
                self._pending_bytes -= n
                self._hash(data)
                self.frontier += n
                continue
            end = self._on_disk.pop(self.frontier, None)
            if end is not None:
                self._read_back(self.frontier, end)
                self.frontier = end
                continue
            return

    def _run(self) -> None:
        try:
            while True:
                item = self._queue.get()
                if item is self._STOP or self._abort:
                    return
                start, end, data = item
                if data is not None:
                    with self._lock:
                        self._queued_bytes -= end - start
                if end <= self.frontier:
                    continue  # already hashed (cannot happen with a correct caller; harmless)
                if start < self.frontier:  # overlap: keep only the unhashed tail
                    if data is not None:
                        data = (data if isinstance(data, bytes) else b"".join(data))[self.frontier - start:]
                    start = self.frontier
                if start == self.frontier:
                    if data is not None:
                        self._hash(data)
                    else:
                        self._read_back(start, end)
                    self.frontier = end
                    self._drain()
                elif data is not None and self._pending_bytes + (end - start) <= self._buffer_limit:
                    self._pending[start] = data
                    self._pending_bytes += end - start
                else:
                    self._on_disk[start] = end
        except BaseException as exc:  # surfaced by finish()
            self._error = exc

    def abort(self) -> None:
        self._abort = True
        self._queue.put(self._STOP)

    def finish(self) -> tuple[str, str | None]:
        """Block until every byte is hashed; (sha256 hex, git sha1 hex or None)."""
        self._queue.put(self._STOP)
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self.frontier != self.size_bytes:
            raise TransferError(f"internal: hashed {self.frontier} of {self.size_bytes} bytes",
                                hint="rerun; the partial file resumes")
        return self._sha256.hexdigest(), (self._sha1.hexdigest() if self._sha1 else None)


class _NoHasher(OrderedHasher):
    """Benchmark baseline only (``TransferOptions.hash_while_streaming=False``)."""

    def __init__(self) -> None:  # noqa: D107 - no thread, no state
        self.reread_bytes = 0

    def feed(self, offset: int, data: bytes | list[bytes]) -> None:
        pass

    def mark_on_disk(self, start: int, end: int) -> None:
        pass

    def abort(self) -> None:
        pass

    def finish(self) -> tuple[str, str | None]:
        return "", None


# --------------------------------------------------------------------------- progress


class ProgressReporter:
    """One file's progress: a bar on a TTY, else throttled ``download.progress`` events (issue 4 §6).

    Events go out at most once per ``min_interval_s`` and only after ≥ 1 % more of the file, plus
    one at the end — never per chunk.
    """

    def __init__(self, label: str, total_bytes: int, *, done_bytes: int = 0, tty: bool | None = None,
                 stream: Any = None, min_interval_s: float = 1.0) -> None:
        self.label = label
        self.total_bytes = max(1, total_bytes)
        self.done_bytes = done_bytes
        self._start_done = done_bytes
        self._stream = stream or sys.stderr
        self.tty = (self._stream.isatty() and os.environ.get("TERM") != "dumb") if tty is None else tty
        self._interval = 0.1 if self.tty else min_interval_s
        self._t0 = time.monotonic()
        self._last_t = 0.0
        self._last_done = done_bytes
        self.events = 0

    def advance(self, n: int) -> None:
        self.done_bytes += n
        now = time.monotonic()
        if now - self._last_t < self._interval:
            return
        if not self.tty and (self.done_bytes - self._last_done) * 100 < self.total_bytes:
            return
        self._emit(now)

    def _rate(self, now: float) -> float:
        return (self.done_bytes - self._start_done) / max(1e-6, now - self._t0)

    def _emit(self, now: float, final: bool = False) -> None:
        self._last_t, self._last_done = now, self.done_bytes
        self.events += 1
        rate = self._rate(now)
        left = self.total_bytes - self.done_bytes
        eta = left / rate if rate > 0 else None
        if self.tty:
            frac = min(1.0, self.done_bytes / self.total_bytes)
            bar = "#" * int(frac * 30)
            eta_text = f"{eta:5.0f}s" if eta is not None else "    ?"
            self._stream.write(f"\r{self.label[:32]:32} [{bar:30}] {frac * 100:5.1f}% "
                               f"{_human(self.done_bytes)}/{_human(self.total_bytes)} "
                               f"{_human(rate)}/s ETA {eta_text}" + ("\n" if final else ""))
            self._stream.flush()
        else:
            log.info("download.progress", file=self.label, done_bytes=self.done_bytes,
                     total_bytes=self.total_bytes, percent=round(100 * self.done_bytes / self.total_bytes, 1),
                     rate_bytes_per_s=int(rate), eta_s=None if eta is None else round(eta, 1))

    def close(self) -> None:
        self._emit(time.monotonic(), final=True)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f}{unit}" if unit != "B" else f"{int(n)}B"
        n /= 1024
    return f"{n:.1f}GiB"


# --------------------------------------------------------------------------- download


@dataclass
class _Block:
    start: int
    end: int  # exclusive
    done: int = 0

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def complete(self) -> bool:
        return self.done >= self.length


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


@dataclass
class _Sidecar:
    url: str
    repo: str
    revision: str
    file: str
    size_bytes: int
    expected_sha256: str | None
    etag: str | None
    ranges_supported: bool
    blocks: list[list[int]] = field(default_factory=list)  # [start, end, done]

    def matches(self, other: "_Sidecar") -> bool:
        # Not the URL: a mirror (another HF_ENDPOINT) serves the same pinned bytes, and the sha256
        # check catches one that does not. An expected sha256 recorded on one side only (pinned
        # since) is no conflict: the commit fixes the bytes, and the check after the download
        # compares them with the sha256 known now.
        shas_agree = (self.expected_sha256 is None or other.expected_sha256 is None
                      or self.expected_sha256 == other.expected_sha256)
        return shas_agree and (self.repo, self.revision, self.file, self.size_bytes) == (
            other.repo, other.revision, other.file, other.size_bytes)


def _read_sidecar(path: Path) -> _Sidecar | None:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if raw.get("schema") != SIDECAR_SCHEMA:
            return None
        if len(raw["blocks"]) > MAX_BLOCKS:
            return None
        blocks = [[int(a), int(b), int(c)] for a, b, c in raw["blocks"]]
        side = _Sidecar(url=raw["url"], repo=raw["repo"], revision=raw["revision"], file=raw["file"],
                        size_bytes=int(raw["size_bytes"]), expected_sha256=raw.get("expected_sha256"),
                        etag=raw.get("etag"), ranges_supported=bool(raw.get("ranges_supported", True)),
                        blocks=blocks)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):  # damaged: not trusted
        return None
    # A sidecar must tile [0, size) exactly with sane counters, else it is not trusted.
    pos = 0
    for start, end, done in side.blocks:
        if start != pos or end <= start or not 0 <= done <= end - start:
            return None
        pos = end
    return side if pos == side.size_bytes and side.size_bytes > 0 else None


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    # Not fsynced: the sidecar only ever claims bytes already fdatasync'd, so losing its newest
    # version to a power cut costs redone bytes, never a wrong claim.
    write_text_atomic(path, json.dumps(data), durable=False)


def _sidecar_json(side: _Sidecar, blocks: list[_Block]) -> dict[str, Any]:
    return {"schema": SIDECAR_SCHEMA, "url": side.url, "repo": side.repo, "revision": side.revision,
            "file": side.file, "size_bytes": side.size_bytes, "expected_sha256": side.expected_sha256,
            "etag": side.etag, "ranges_supported": side.ranges_supported,
            "blocks": [[b.start, b.end, b.done] for b in blocks],
            "done_bytes": sum(b.done for b in blocks)}


def _done_on_disk(sidecar_path: Path, partial: Path) -> int:
    """Bytes the partial already holds on disk: its sidecar's claims, or its allocated blocks when
    more (``_preallocate`` reserves the whole file up front; discarded or reused, that space is
    this download's, so counting it as needed again would refuse a resume on a nearly full disk)."""
    side = _read_sidecar(sidecar_path) if partial.exists() else None
    claimed = sum(b[2] for b in side.blocks) if side else 0
    try:
        allocated = os.stat(partial).st_blocks * 512
    except (OSError, AttributeError):  # no partial yet, or no st_blocks on this platform
        allocated = 0
    return max(claimed, allocated)


MAX_BLOCKS = 1 << 16  # bounds the sidecar and the plan whatever the size and block setting


def _plan_blocks(size: int, connections: int, options: TransferOptions, ranges: bool) -> list[_Block]:
    if not ranges or connections <= 1 or size < options.min_parallel_bytes:
        return [_Block(0, size)]
    step = max(options.block_size_for(size, connections), -(-size // MAX_BLOCKS))
    return [_Block(s, min(size, s + step)) for s in range(0, size, step)]


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
    if partial.exists():  # a download in progress: its bytes are not traded for an unknown file
        return False
    partial_dir.mkdir(parents=True, exist_ok=True)
    discard_partial(partial, sidecar)
    side = _Sidecar(url="", repo=repo, revision=revision, file=path, size_bytes=size_bytes,
                    expected_sha256=expected_sha256, etag=None, ranges_supported=True)
    # Sidecar first: a kill before the move leaves the file in place, to be adopted again.
    write_text_atomic(sidecar, json.dumps(_sidecar_json(side, [_Block(0, size_bytes, size_bytes)])))
    os.replace(final, partial)
    fsync_dir(final.parent)
    return True


def discard_partial(partial: Path, sidecar: Path) -> None:
    for p in (sidecar, partial):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def check_disk_space(directory: Path, needed_bytes: int, what: str) -> None:
    """Fail before starting when ``needed_bytes`` (+ margin) exceed free space (issue 4 §1)."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if needed_bytes + DISK_MARGIN_BYTES > free:
        raise DiskSpaceError(
            f"not enough disk space in {directory} for {what}: need {needed_bytes} bytes "
            f"(+{DISK_MARGIN_BYTES} margin), {free} free",
            hint="free space on that filesystem or point --home / HOTFIT_HOME at a larger one, then rerun",
            directory=str(directory), needed_bytes=needed_bytes, free_bytes=free)


class _StopPolicy:
    """Stop after N consecutive attempts without new bytes, or once ``max_total_retry_s`` has passed
    without any: the deadline bounds time spent failing, so new bytes push it out (a cut hours into
    a long download is retried like one in its first minute)."""

    def __init__(self, options: TransferOptions, progress_fn: Callable[[], int], deadline: float) -> None:
        self._max = options.max_attempts_without_progress
        self._window_s = options.max_total_retry_s
        # a retry loop that starts late (a block handed out an hour in) still gets its own window
        self._deadline = max(deadline, time.monotonic() + self._window_s)
        self._cap = options.retry_after_cap_s
        self._progress_fn = progress_fn
        self._last = progress_fn()
        self._fails = 0

    def __call__(self, state: RetryCallState) -> bool:
        now_done = self._progress_fn()
        if now_done > self._last:
            self._fails, self._last = 1, now_done
            self._deadline = max(self._deadline, time.monotonic() + self._window_s)
        else:
            self._fails += 1
        exc = state.outcome.exception() if state.outcome else None
        retry_after = getattr(exc, "retry_after_s", None)
        if retry_after is not None and retry_after > self._cap:
            return True
        return self._fails >= self._max or time.monotonic() >= self._deadline


def _wait_policy(options: TransferOptions) -> Callable[[RetryCallState], float]:
    backoff = wait_exponential_jitter(multiplier=options.backoff_initial_s, max=options.backoff_max_s,
                                      jitter=options.backoff_initial_s)

    def wait(state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        retry_after = getattr(exc, "retry_after_s", None)
        if retry_after is not None:
            return min(retry_after, options.retry_after_cap_s)
        return backoff(state)

    return wait


def _retry_cause(exc: BaseException | None) -> str:
    if exc is None:
        return "unknown"
    if isinstance(exc, _Retryable):
        return str(exc)  # already says what failed ("HTTP 503 for …", "HEAD …: ConnectError: …")
    return f"{type(exc).__name__}: {exc}"


def log_retry(repo: str, path: str | None, url_fn: Callable[[], str]) -> Callable[[RetryCallState], None]:
    """A tenacity ``before_sleep`` hook: one ``download.retry`` event per wait, so retries are seen as
    they happen (``url_fn`` gives the URL the failed attempt used; it is logged redacted)."""

    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        wait_s = state.next_action.sleep if state.next_action is not None else 0.0
        log.warning("download.retry", repo=repo, file=path, attempt=state.attempt_number,
                    cause=_retry_cause(exc), wait_s=round(wait_s, 3), url=redact_url(url_fn()))

    return before_sleep


def _retrying(options: TransferOptions, progress_fn: Callable[[], int], deadline: float,
              before_sleep: Callable[[RetryCallState], None]) -> AsyncRetrying:
    return AsyncRetrying(
        retry=retry_if_exception_type((_Retryable, httpx.TransportError)),
        stop=_StopPolicy(options, progress_fn, deadline),
        wait=_wait_policy(options),
        before_sleep=before_sleep,
        reraise=True,
    )


def _disk_error(exc: OSError, partial: Path, offset: int) -> DiskSpaceError:
    reason = "file size limit reached" if exc.errno == errno.EFBIG else "disk full"
    return DiskSpaceError(
        f"{reason} writing {partial} at byte {offset} ({os.strerror(exc.errno or 0)})",
        hint="free disk space (or raise the file-size limit), then rerun the same command: "
             "the partial file is kept and the download resumes where it stopped",
        partial=str(partial), offset_bytes=offset, errno=exc.errno)


async def download_to_partial(session: HubSession, **kw: Any) -> DownloadOutcome:
    """Bring ``<repo>@<revision>/<path>`` into a complete, hashed partial file (see the module doc).

    Keyword arguments: ``repo, revision, path, expected_size, expected_sha256, partial_dir,
    connections=None, progress=None, git_sha1=False, max_size_bytes=None``; ``progress(total, done)``
    builds a reporter; a file the HEAD says is larger than ``max_size_bytes`` is refused unfetched.
    The caller holds the per-target lock and decides what the hashes mean (verify); nothing is
    renamed here. Raises PinMismatch, HubError, DiskSpaceError, or TransferError once retries are
    exhausted (the partial and its sidecar stay for the next run).
    """
    try:
        return await _download_to_partial(session, **kw)
    except (_Retryable, httpx.TransportError) as exc:
        _p, sidecar, _l = partial_paths(kw["partial_dir"], kw["repo"], kw["path"])
        side = _read_sidecar(sidecar)
        done = sum(b[2] for b in side.blocks) if side else 0
        raise _gave_up(kw["repo"], kw["path"], exc, done) from exc


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
) -> DownloadOutcome:
    if not is_commit(revision):
        raise PinMismatch(f"{repo}/{path}: revision {revision!r} is not a 40-hex commit",
                          hint="pin the entry to a commit (hotfit registry lock)", repo=repo, file=path)
    options = session.options
    conns = max(1, connections or options.connections)
    partial_dir.mkdir(parents=True, exist_ok=True)
    partial, sidecar_path, _lock = partial_paths(partial_dir, repo, path)
    # One deadline for the whole file: retries of every block and HEAD share it.
    counters = {"attempts": 0, "transferred": 0, "deadline": time.monotonic() + options.max_total_retry_s}

    remote = await _head_with_retry(session, repo, revision, path, expected_size, counters)
    size = remote.size_bytes if remote.size_bytes is not None else expected_size
    if size is None:
        raise HubError(f"{repo}/{path}: the Hub did not report a size and the registry has none",
                       hint="pin the entry's size_bytes", repo=repo, file=path)
    if max_size_bytes is not None and size > max_size_bytes:  # before a byte is fetched
        raise IntegrityError(f"{repo}/{path} is too large: {size} bytes, more than the {max_size_bytes} such a file may have",
                             hint="the entry names the wrong file; fix it after review", field="size_bytes",
                             repo=repo, file=path, size_bytes=size, max_size_bytes=max_size_bytes)
    if expected_sha256 and remote.lfs_sha256 and remote.lfs_sha256 != expected_sha256:
        raise PinMismatch(
            f"{repo}/{path}: the Hub's LFS sha256 {remote.lfs_sha256} differs from the registry's {expected_sha256}",
            hint="the registry pins a different file than this commit holds; fix the entry after review",
            repo=repo, file=path, hub_sha256=remote.lfs_sha256, registry_sha256=expected_sha256)

    # Before anything is planned or allocated: a size the disk cannot hold ends here.
    check_disk_space(partial_dir, max(0, size - _done_on_disk(sidecar_path, partial)), f"{repo}/{path}")
    wanted = _Sidecar(url=remote.resolve_url, repo=repo, revision=revision, file=path, size_bytes=size,
                      expected_sha256=expected_sha256, etag=remote.etag, ranges_supported=True)
    side = _read_sidecar(sidecar_path) if partial.exists() else None
    if side is not None and not side.matches(wanted):
        log.info("download.partial_discarded", file=path, reason="sidecar is for another target or pin")
        side = None
    if side is None:
        discard_partial(partial, sidecar_path)
        side = wanted
        blocks = _plan_blocks(size, conns, options, ranges=True)
    elif not side.ranges_supported:  # this server cannot resume: every run starts at byte 0
        blocks = [_Block(0, size)]
    else:
        blocks = [_Block(s, e, d) for s, e, d in side.blocks]
        if os.path.getsize(partial) < max((b.start + b.done for b in blocks if b.done), default=0):
            log.warning("download.partial_short", file=path)  # truncated behind our back: start over
            blocks = _plan_blocks(size, conns, options, ranges=side.ranges_supported)
    resumed = sum(b.done for b in blocks)
    if resumed:
        log.info("download.resume", file=path, done_bytes=resumed, size_bytes=size, blocks=len(blocks))

    fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    _preallocate(fd, size)
    restarts = 0
    try:
        while True:
            reporter = progress(size, sum(b.done for b in blocks)) if progress else None
            hasher: OrderedHasher = (
                OrderedHasher(fd, size, buffer_bytes=options.hash_buffer_bytes, git_sha1=git_sha1)
                if options.hash_while_streaming else _NoHasher())
            for b in blocks:  # bytes from an earlier run: read back once when the frontier gets there
                hasher.mark_on_disk(b.start, b.start + b.done)
            try:
                await _run_blocks(session, remote, side, blocks, fd, partial, sidecar_path, hasher,
                                  reporter, conns, counters, expected_size)
            except _RangeIgnored:
                hasher.abort()
                restarts += 1
                if restarts > options.max_attempts_without_progress:
                    raise TransferError(
                        f"{repo}/{path}: the server ignores Range and the stream keeps breaking",
                        hint="rerun later or use another HF_ENDPOINT mirror", repo=repo, file=path) from None
                log.warning("download.range_ignored", file=path,
                            detail="server answered 200 to a ranged GET; restarting as one stream from byte 0")
                side.ranges_supported = False
                blocks = [_Block(0, size)]
                _write_json_atomic(sidecar_path, _sidecar_json(side, blocks))
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
    finally:
        os.close(fd)
    return DownloadOutcome(
        partial_path=partial, repo=repo, revision=revision, file=path, size_bytes=size, sha256=sha256,
        git_sha1=sha1, hub_lfs_sha256=remote.lfs_sha256, etag=remote.etag,
        bytes_transferred=counters["transferred"], bytes_reread=hasher.reread_bytes,
        resumed_from_bytes=resumed, connections=conns if len(blocks) > 1 else 1,
        ranges_supported=side.ranges_supported, attempts=counters["attempts"])


_FALLOC_FL_KEEP_SIZE = 1
_SYNC_FILE_RANGE_WRITE = 2
_libc_fns: dict[str, Any] | None = None


def _libc_fn(name: str) -> Any:
    """A Linux libc call for the disk hints below, or None (another OS, an old libc)."""
    global _libc_fns
    if _libc_fns is None:
        _libc_fns = {}
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                libc = ctypes.CDLL(None, use_errno=True)
                for fn_name, symbols, argtypes in (
                        ("fallocate", ("fallocate64", "fallocate"), (ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                                                                     ctypes.c_int64)),
                        ("sync_file_range", ("sync_file_range",), (ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                                                    ctypes.c_uint))):
                    fn = next((getattr(libc, s) for s in symbols if hasattr(libc, s)), None)
                    if fn is not None:
                        fn.argtypes, fn.restype = argtypes, ctypes.c_int
                        _libc_fns[fn_name] = fn
            except OSError:  # pragma: no cover - no loadable libc
                pass
    return _libc_fns.get(name)


def _preallocate(fd: int, size_bytes: int) -> None:
    """Reserve the file's blocks before the first byte lands (Linux ``fallocate``, KEEP_SIZE: the
    file's size still grows only as bytes are written, so resume and truncation checks are
    unchanged). On ext4 a pwritev into reserved blocks skips delayed allocation: it costs half as
    much and no longer stalls behind a checkpoint's fdatasync (scripts/bench-download: 1 GiB in
    0.30 s → 0.13 s of pwritev, single stream ~10 % faster). Best effort: where the filesystem has no
    fallocate, or too little room, nothing changes (ENOSPC then comes from a write, as before)."""
    fallocate = _libc_fn("fallocate")
    if fallocate is not None and size_bytes > 0 and fallocate(fd, _FALLOC_FL_KEEP_SIZE, 0, size_bytes) != 0:
        import ctypes

        log.debug("download.preallocate_skipped", errno=ctypes.get_errno())


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``[offset, offset+length)`` to disk now (``sync_file_range``
    WRITE: asynchronous, no durability promise). Only a hint: checkpoints still claim bytes only
    after an ``fdatasync`` completed; that sync then finds (almost) nothing left to write, so neither
    it nor the final sync holds the stream up (bench: checkpoint fdatasync ~80 ms → ~0, one stream
    ~6 % faster)."""
    sync_file_range = _libc_fn("sync_file_range")
    if sync_file_range is not None:
        sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


async def head_retrying(session: HubSession, repo: str, revision: str, path: str) -> RemoteFile:
    """``session.head`` with the engine's retry policy; never leaks an internal retryable error."""
    counters: dict[str, Any] = {"attempts": 0,
                                "deadline": time.monotonic() + session.options.max_total_retry_s}
    try:
        url = session.resolve_url(repo, revision, path)
        async for attempt in _retrying(session.options, lambda: 0, counters["deadline"],
                                       log_retry(repo, path, lambda: url)):
            with attempt:
                return await session.head(repo, revision, path)
    except (_Retryable, httpx.TransportError) as exc:
        raise _gave_up(repo, path, exc, 0) from exc
    raise AssertionError("unreachable")  # pragma: no cover


def _gave_up(repo: str, path: str, exc: BaseException, done_bytes: int) -> TransferError:
    return TransferError(
        f"{repo}/{path}: gave up after repeated failures: {exc}",
        hint="check the network / HF_ENDPOINT and rerun the same command"
             + (f"; the {done_bytes} bytes already on disk are kept and resumed" if done_bytes else ""),
        repo=repo, file=path, done_bytes=done_bytes)


async def _head_with_retry(session: HubSession, repo: str, revision: str, path: str,
                           expected_size: int | None, counters: dict[str, Any]) -> RemoteFile:
    url = session.resolve_url(repo, revision, path)
    async for attempt in _retrying(session.options, lambda: 0, counters["deadline"],
                                   log_retry(repo, path, lambda: url)):
        with attempt:
            counters["attempts"] += 1
            return await session.head_pinned(repo, revision, path, expected_size)
    raise AssertionError("unreachable")  # pragma: no cover


async def _run_blocks(session: HubSession, remote: RemoteFile, side: _Sidecar, blocks: list[_Block], fd: int,
                      partial: Path, sidecar_path: Path, hasher: OrderedHasher,
                      reporter: ProgressReporter | None, conns: int, counters: dict[str, Any],
                      expected_size: int | None) -> None:
    """Run the workers over the pending blocks, checkpointing the sidecar; the last checkpoint is
    written even on failure or cancellation so a rerun resumes."""
    pending = [b for b in blocks if not b.complete]
    cursor = iter(pending)
    state = {"url": remote.download_url}
    lock = anyio.Lock()

    def checkpoint() -> None:
        claimed = _sidecar_json(side, blocks)
        os.fdatasync(fd)
        _write_json_atomic(sidecar_path, claimed)

    async def fresh_url() -> str:
        """Re-HEAD before a resume (CDN links expire); re-checks the pin and size each time."""
        async with lock:
            again = await session.head_pinned(side.repo, side.revision, side.file, expected_size)
            state["url"] = again.download_url
            return again.download_url

    async def worker() -> None:
        for block in cursor:
            await _fetch_block(block)

    async def _fetch_block(block: _Block) -> None:
        first = True
        async for attempt in _retrying(session.options, lambda: block.done, counters["deadline"],
                                       log_retry(side.repo, side.file, lambda: state["url"])):
            with attempt:
                counters["attempts"] += 1
                url = state["url"] if first else await fresh_url()
                first = False
                await _stream_block(block, url)

    async def _stream_block(block: _Block, url: str) -> None:
        offset = block.start + block.done
        whole = len(blocks) == 1
        extra = {} if (whole and block.done == 0) else {"range": f"bytes={offset}-{block.end - 1}"}
        async with session.client.stream("GET", url, headers=session.headers_for(url, extra),
                                         follow_redirects=True) as resp:
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
                    raise _RangeIgnored()
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
            elif resp.status_code in (401, 403, 410) and _origin(str(resp.url)) != _origin(session.endpoint):
                # A signed CDN link expired (real ones do, hours into a pull): the retry re-HEADs the
                # Hub for a fresh one, and the Hub itself answers gating/not-found properly.
                raise _Retryable(f"{side.file}: CDN answered HTTP {resp.status_code} (link expired?)")
            else:
                from_endpoint = _origin(str(resp.url)) == _origin(session.endpoint)
                raise hub_error_from_response(resp, repo=side.repo, revision=side.revision, path=side.file,
                                              endpoint=session.endpoint if from_endpoint else None)
            encoding = resp.headers.get("content-encoding", "identity").lower()
            if encoding not in ("identity", ""):
                raise TransferError(f"{side.file}: server compressed the body ({encoding}); byte offsets unusable",
                                    hint="use an endpoint that serves raw bytes", file=side.file)
            # Network-sized chunks are gathered up to chunk_bytes and written with one pwritev (no
            # copy); whatever is gathered when the stream breaks is still written, so a cut loses no
            # received byte.
            parts: list[bytes] = []
            gathered = 0
            pos = offset

            def flush() -> None:
                nonlocal pos, parts, gathered
                if not parts:
                    return
                todo, n_todo = parts, gathered
                parts, gathered = [], 0
                n = 0
                try:
                    n = os.pwritev(fd, todo, pos)
                    if n < n_todo:  # short write (file-size limit, disk nearly full): finish byte-wise
                        rest = b"".join(todo)
                        while n < n_todo:
                            n += os.pwrite(fd, memoryview(rest)[n:], pos + n)
                except OSError as exc:
                    if n:  # what did land is kept and counted
                        _account(b"".join(todo)[:n])
                    if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                        raise _disk_error(exc, partial, pos) from exc
                    raise
                _start_writeback(fd, pos, n_todo)
                _account(todo)

            def _account(data: bytes | list[bytes]) -> None:
                nonlocal pos
                n = len(data) if isinstance(data, bytes) else sum(map(len, data))
                hasher.feed(pos, data)
                pos += n
                block.done += n
                counters["transferred"] += n
                if reporter:
                    reporter.advance(n)

            try:
                async for chunk in resp.aiter_raw():
                    room = block.end - pos - gathered
                    if room <= 0:
                        raise PinMismatch(f"{side.file}: server sent more than {side.size_bytes} bytes",
                                          hint="the served file is not the pinned one", repo=side.repo,
                                          file=side.file)
                    if len(chunk) > room:
                        chunk = chunk[:room]
                    parts.append(chunk)
                    gathered += len(chunk)
                    if gathered >= session.options.chunk_bytes:
                        flush()
            finally:
                flush()
        if not block.complete:
            raise _Retryable(f"{side.file}: connection closed at byte {pos} of block ending {block.end}")

    async def checkpointer() -> None:
        # The sidecar only claims bytes that were pwrite-n before an fdatasync that completed, so it
        # is true after a power loss too; syncing as we go also leaves little for the final fsync.
        while True:
            await anyio.sleep(session.options.checkpoint_interval_s)
            claimed = _sidecar_json(side, blocks)
            await anyio.to_thread.run_sync(os.fdatasync, fd)
            _write_json_atomic(sidecar_path, claimed)

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
            with contextlib.suppress(OSError):
                checkpoint()
        raise _unwrap(exc) from None
    checkpoint()


def _unwrap(exc: BaseException) -> BaseException:
    """The first meaningful error out of nested task-group exception groups."""
    while isinstance(exc, BaseExceptionGroup):
        preferred = [e for e in exc.exceptions if not isinstance(e, anyio.get_cancelled_exc_class())]
        exc = (preferred or list(exc.exceptions))[0]
    return exc




def remove_tree_quietly(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)

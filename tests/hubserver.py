"""A local Hugging Face Hub on 127.0.0.1 for tests and benchmarks.

It speaks the part of the Hub protocol hotfit and ``huggingface_hub`` use (as
huggingface_hub's file_download.py and hf_api.py call it), so the real client code runs unchanged against it through
``HF_ENDPOINT`` or ``endpoint=``:

- ``HEAD/GET /{repo_id}/resolve/{revision}/{path}``: ``X-Repo-Commit``, ``ETag`` (git blob sha1, or the
  sha256 for LFS files), ``X-Linked-Etag``/``X-Linked-Size`` for LFS files, ``Accept-Ranges``, ``Range``
  → 206 + ``Content-Range``, unsatisfiable → 416 + ``Content-Range: bytes */N``. LFS files answer 302 to
  a second host name (the "CDN": the same listener reached as ``localhost``), with the ``X-Linked-*``
  headers on the 302 itself, as the real Hub does. Optionally small files answer 307 to a relative
  ``/api/resolve-cache/models/...`` URL, as the real Hub does today.
- ``GET /api/models/{repo_id}[/revision/{rev}][?blobs=true]`` (``model_info``) and
  ``GET /api/models/{repo_id}/tree/{rev}[/{path}]?recursive=...`` (``list_repo_tree``, paginated by
  ``Link: rel="next"``).
- Errors carry ``X-Error-Code`` (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo), an
  ``X-Error-Message`` and a JSON body ``{"error": ...}``.
- No Xet header, ``Link rel="xet-auth"`` or ``xetHash`` is ever sent.

State lives on disk under ``root`` so that a second process (``python -m tests.hubserver --root DIR``)
serves the same repos, and a branch moved by the test process is seen at once::

    root/objects/<sha256>                    file contents (hard link to a caller's big file when possible)
    root/repos/<repo_id>/repo.json           {"gated_token": ..., "created_at": ...}
    root/repos/<repo_id>/refs.json           {"main": "<40-hex commit>", ...}
    root/repos/<repo_id>/commits/<id>.json   {"id", "parent", "message", "created_at", "files": {...}}

Faults (``LocalHub.inject``) and counters (``requests``, ``bytes_sent``) live in the serving process.

No pytest here: ``scripts/provision-demo`` runs this server after a set-up without test dependencies.
The pytest fixture ``local_hub`` (a started hub in the test's tmp_path) lives in ``tests/conftest.py``::

    from tests.hubserver import LocalHub

    def test_x(local_hub: LocalHub) -> None:
        commit = local_hub.create_repo("org/m", {"config.json": "{}", "m.gguf": Path(big)}, lfs=["m.gguf"])
        local_hub.inject(file="m.gguf", where="cdn", close_after_bytes=1 << 20)  # next CDN GET is cut
        ...  # point the client at local_hub.endpoint (or HF_ENDPOINT=local_hub.endpoint)
        assert len(local_hub.requests_for(file="m.gguf", method="GET", where="cdn")) <= 2
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fnmatch
import hashlib
import io
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

# The real Hub stores files above ~10 MB in LFS (its pre-receive hook); tests can force any file LFS.
DEFAULT_LFS_THRESHOLD_BYTES = 10 * 1000 * 1000
# Read and send file bodies in bounded chunks: a multi-GiB file never sits in memory.
_CHUNK_BYTES = 1024 * 1024
# Pacing granularity for throughput caps: no single sleep longer than this, so stop() stays quick.
_MAX_SLEEP_S = 0.05
_HASH_CHUNK_BYTES = 4 * 1024 * 1024
_HEX = frozenset("0123456789abcdef")

FileSource = bytes | str | Path


# --------------------------------------------------------------------------- pure core


def git_blob_sha1(data: bytes) -> str:
    """Git's blob id: sha1 over ``b"blob <len>\\0"`` + content (what the Hub reports as ETag/blobId/oid)."""
    h = hashlib.sha1(b"blob %d\0" % len(data))
    h.update(data)
    return h.hexdigest()


def lfs_pointer(sha256: str, size_bytes: int) -> bytes:
    """The git-lfs pointer file the Hub keeps in git for an LFS file (its blob id is the entry's oid)."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size_bytes}\n".encode()


def is_commit_id(revision: str) -> bool:
    return len(revision) == 40 and set(revision) <= _HEX


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One file of one commit. For LFS files ``blob_id`` is the pointer's git blob id, as on the Hub."""

    path: str
    size_bytes: int
    sha256: str
    blob_id: str
    lfs: bool

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.blob_id

    @property
    def pointer_size_bytes(self) -> int:
        return len(lfs_pointer(self.sha256, self.size_bytes))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Commit:
    id: str
    parent: str | None
    message: str
    created_at: str
    files: Mapping[str, FileEntry]

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> Commit:
        files = {p: FileEntry(**e) for p, e in data["files"].items()}
        return Commit(data["id"], data["parent"], data["message"], data["created_at"], files)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"files": {p: e.to_json() for p, e in sorted(self.files.items())}}


def parse_range(header: str | None, size_bytes: int) -> tuple[int, int] | None | str:
    """Parse a single ``bytes=`` range against a resource of ``size_bytes``.

    Returns ``(start, end_inclusive)``, ``None`` to answer 200 with the whole body (no header, a
    malformed or multi-range header: RFC 9110 lets a server ignore those), or ``"unsatisfiable"`` (416).
    """
    if not header:
        return None
    unit, _, spec = header.strip().partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, dash, last = spec.strip().partition("-")
    if not dash:
        return None
    try:
        if first == "":  # suffix range: the last N bytes
            suffix = int(last)
            if suffix <= 0 or size_bytes == 0:
                return "unsatisfiable"
            return max(0, size_bytes - suffix), size_bytes - 1
        start = int(first)
        end = int(last) if last else None
    except ValueError:
        return None
    if start < 0 or (end is not None and end < start):
        return None
    if end is None:
        end = size_bytes - 1
    if start >= size_bytes:
        return "unsatisfiable"
    return start, min(end, size_bytes - 1)


def _directory_oid(path: str, children: Iterable[str]) -> str:
    # A stable 40-hex id for a folder; clients only need it to be present.
    return hashlib.sha1("\n".join([path, *sorted(children)]).encode()).hexdigest()


def _header_safe(text: str) -> str:
    # Header values go out as latin-1; keep them ASCII and free of quotes and line breaks.
    return text.encode("ascii", "backslashreplace").decode().replace('"', "'").replace("\r", " ").replace("\n", " ")


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")


# --------------------------------------------------------------------------- on-disk store


class HubStore:
    """Repos, commits and branches on disk; usable without a server (e.g. to seed a subprocess hub)."""

    def __init__(self, root: str | os.PathLike[str], *, lfs_threshold_bytes: int = DEFAULT_LFS_THRESHOLD_BYTES):
        self.root = Path(root)
        self.lfs_threshold_bytes = lfs_threshold_bytes
        (self.root / "objects").mkdir(parents=True, exist_ok=True)
        (self.root / "repos").mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._commit_cache: dict[tuple[str, str], Commit] = {}

    # ---- paths

    def _repo_dir(self, repo_id: str) -> Path:
        if not repo_id or repo_id.startswith("/") or ".." in repo_id.split("/") or repo_id.count("/") > 1:
            raise ValueError(f"bad repo id {repo_id!r}: expected 'name' or 'org/name'")
        return self.root / "repos" / repo_id

    def object_path(self, sha256: str) -> Path:
        return self.root / "objects" / sha256

    # ---- reads (used by the server on every request; refs are re-read so other processes' moves show)

    def repo_exists(self, repo_id: str) -> bool:
        try:
            return (self._repo_dir(repo_id) / "refs.json").is_file()
        except ValueError:
            return False

    def repo_config(self, repo_id: str) -> dict[str, Any]:
        return json.loads((self._repo_dir(repo_id) / "repo.json").read_text())

    def refs(self, repo_id: str) -> dict[str, str]:
        return json.loads((self._repo_dir(repo_id) / "refs.json").read_text())

    def head(self, repo_id: str, branch: str = "main") -> str:
        return self.refs(repo_id)[branch]

    def get_commit(self, repo_id: str, commit_id: str) -> Commit | None:
        key = (repo_id, commit_id)
        cached = self._commit_cache.get(key)
        if cached is not None:
            return cached
        path = self._repo_dir(repo_id) / "commits" / f"{commit_id}.json"
        if not path.is_file():
            return None
        commit = Commit.from_json(json.loads(path.read_text()))
        self._commit_cache[key] = commit  # commits are immutable
        return commit

    def resolve_revision(self, repo_id: str, revision: str) -> Commit | None:
        """A branch name or a full 40-hex commit id → the commit, or None."""
        branch_head = self.refs(repo_id).get(revision)
        if branch_head is not None:
            return self.get_commit(repo_id, branch_head)
        if is_commit_id(revision):
            return self.get_commit(repo_id, revision)
        return None

    # ---- writes

    def _write_json(self, path: Path, data: Any) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)  # atomic: a reader in another process sees old or new, never half

    def _store_object(self, source: FileSource, force_lfs: bool | None) -> tuple[str, int, str, bool]:
        """Put one file into objects/; returns (sha256, size, blob_id, lfs)."""
        if isinstance(source, str):
            source = source.encode()
        if isinstance(source, bytes):
            size = len(source)
            lfs = force_lfs if force_lfs is not None else size > self.lfs_threshold_bytes
            sha256 = hashlib.sha256(source).hexdigest()
            blob_id = git_blob_sha1(lfs_pointer(sha256, size)) if lfs else git_blob_sha1(source)
            dst = self.object_path(sha256)
            if not dst.exists():
                tmp = dst.with_name(f".{sha256}.{os.getpid()}.{threading.get_ident()}.tmp")
                tmp.write_bytes(source)
                os.replace(tmp, dst)
            return sha256, size, blob_id, lfs
        if isinstance(source, os.PathLike):
            path = Path(source).resolve()
            size = path.stat().st_size
            lfs = force_lfs if force_lfs is not None else size > self.lfs_threshold_bytes
            h256 = hashlib.sha256()
            h1 = None if lfs else hashlib.sha1(b"blob %d\0" % size)
            with path.open("rb") as f:
                while chunk := f.read(_HASH_CHUNK_BYTES):
                    h256.update(chunk)
                    if h1 is not None:
                        h1.update(chunk)
            sha256 = h256.hexdigest()
            blob_id = git_blob_sha1(lfs_pointer(sha256, size)) if lfs else h1.hexdigest()
            dst = self.object_path(sha256)
            if not dst.exists():
                # Reference, never copy: a hard link when on the same filesystem, else a symlink.
                try:
                    os.link(path, dst)
                except OSError:
                    os.symlink(path, dst)
            return sha256, size, blob_id, lfs
        raise TypeError(f"file content must be bytes, str (UTF-8 text) or pathlib.Path, not {type(source)!r}")

    def create_repo(
        self,
        repo_id: str,
        files: Mapping[str, FileSource] | None = None,
        *,
        lfs: bool | Iterable[str] | None = None,
        gated_token: str | None = None,
        message: str = "initial commit",
    ) -> str:
        """Create ``repo_id`` with one commit on ``main`` holding ``files``; returns the commit id.

        ``files`` maps repo paths to ``bytes``, ``str`` (UTF-8 text) or a ``pathlib.Path`` to a file on
        disk (hard-linked, never read into memory). ``lfs``: None → files above the threshold are LFS;
        True/False → all/none; an iterable of paths → those are LFS, the rest by threshold.
        ``gated_token``: the repo is gated and only ``Authorization: Bearer <gated_token>`` may resolve files.
        """
        repo_dir = self._repo_dir(repo_id)
        with self._lock:
            if (repo_dir / "refs.json").exists():
                raise FileExistsError(f"repo {repo_id} exists")
            self._write_json(repo_dir / "repo.json", {"gated_token": gated_token, "created_at": time.time()})
            self._write_json(repo_dir / "refs.json", {})
            return self._commit(repo_id, files or {}, parent=None, branch="main", lfs=lfs, message=message)

    def commit(
        self,
        repo_id: str,
        files: Mapping[str, FileSource | None],
        *,
        branch: str = "main",
        parent: str | None = None,
        lfs: bool | Iterable[str] | None = None,
        message: str = "update",
        move_branch: bool = True,
    ) -> str:
        """A new commit on top of ``parent`` (default: ``branch``'s head, or ``main``'s for a new branch)
        adding/replacing ``files``
        (a ``None`` value deletes the path); moves ``branch`` to it unless ``move_branch=False``.
        The old commit stays resolvable by its id. Returns the new commit id."""
        with self._lock:
            if parent is None:
                refs = self.refs(repo_id)
                parent = refs.get(branch, refs.get("main"))
            return self._commit(
                repo_id, files, parent=parent, branch=branch if move_branch else None, lfs=lfs, message=message
            )

    def _commit(
        self,
        repo_id: str,
        changes: Mapping[str, FileSource | None],
        *,
        parent: str | None,
        branch: str | None,
        lfs: bool | Iterable[str] | None,
        message: str,
    ) -> str:
        base = self.get_commit(repo_id, parent) if parent else None
        if parent and base is None:
            raise KeyError(f"{repo_id}: no commit {parent}")
        lfs_paths = frozenset(lfs) if lfs is not None and not isinstance(lfs, bool) else frozenset()
        files = dict(base.files) if base else {}
        for path, source in changes.items():
            path = path.strip("/")
            if not path or ".." in path.split("/"):
                raise ValueError(f"bad file path {path!r}")
            if source is None:
                files.pop(path, None)
                continue
            force = lfs if isinstance(lfs, bool) else (True if path in lfs_paths else None)
            sha256, size, blob_id, is_lfs = self._store_object(source, force)
            files[path] = FileEntry(path, size, sha256, blob_id, is_lfs)
        now = time.time()
        body = json.dumps(
            {"parent": parent, "files": sorted((p, e.blob_id) for p, e in files.items()), "msg": message},
        )
        # Unique even for identical trees (as git's author date makes it): a real-looking 40-hex id.
        commit_id = hashlib.sha1(f"{body}\0{time.time_ns()}\0{os.getpid()}\0{id(files)}".encode()).hexdigest()
        commit = Commit(commit_id, parent, message, _iso(now), files)
        self._write_json(self._repo_dir(repo_id) / "commits" / f"{commit_id}.json", commit.to_json())
        if branch is not None:
            self.set_ref(repo_id, branch, commit_id)
        return commit_id

    def set_ref(self, repo_id: str, branch: str, commit_id: str) -> None:
        """Point ``branch`` (created if absent) at an existing commit, e.g. move ``main`` back or forth."""
        with self._lock:
            if self.get_commit(repo_id, commit_id) is None:
                raise KeyError(f"{repo_id}: no commit {commit_id}")
            refs = self.refs(repo_id)
            refs[branch] = commit_id
            self._write_json(self._repo_dir(repo_id) / "refs.json", refs)

    def set_gated(self, repo_id: str, token: str | None) -> None:
        """Gate ``repo_id`` behind ``token`` (None: ungate)."""
        with self._lock:
            cfg = self.repo_config(repo_id)
            cfg["gated_token"] = token
            self._write_json(self._repo_dir(repo_id) / "repo.json", cfg)

    def file_entry(self, repo_id: str, path: str, revision: str = "main") -> FileEntry:
        commit = self.resolve_revision(repo_id, revision)
        if commit is None:
            raise KeyError(f"{repo_id}: no revision {revision}")
        return commit.files[path]


# --------------------------------------------------------------------------- faults and counters


@dataclasses.dataclass
class _EffectFields:
    """What a fault does to a response: set by a ``Fault``, merged per request into ``_Effects``."""

    status: int | None = None
    retry_after: int | float | str | None = None
    close_after_bytes: int | None = None
    throughput_bps: int | None = None
    ignore_range: bool = False
    advertise_size: int | None = None
    corrupt: bool = False
    redirect_to_cdn: bool = False
    hold_until: threading.Event | None = None


@dataclasses.dataclass(kw_only=True)
class Fault(_EffectFields):
    """One injected misbehaviour. Selectors (all must match; None matches anything):

    - ``file``: fnmatch glob on the repo file path (``"*.gguf"``); only file requests match it.
    - ``url``: fnmatch glob on the URL path (``"/api/models/*"``).
    - ``repo_id``, ``method`` (``"GET"``/``"HEAD"``), ``where`` (``"hub"`` or ``"cdn"``; resolve-cache
      counts as hub).
    - ``times``: how many matching requests it applies to (then it is spent); None = always.

    Effects (combine freely):

    - ``status`` (+ ``retry_after``): answer that status instead (e.g. 429, 500, 503), JSON error body.
    - ``close_after_bytes``: send the headers for the full body, then close the connection after N body
      bytes (GET only). With ``times=None`` every answer is cut: a link cut every N bytes (each resumed
      range is cut N bytes further on), or with N = 1 a server that sends one byte per connection.
    - ``throughput_bps``: pace this response's body to at most N bytes/s (GET only). Responses on one
      keep-alive connection are sequential, so this caps each connection.
    - ``ignore_range``: answer 200 with the whole body whatever ``Range`` says (file requests).
    - ``advertise_size``: the size claimed in ``Content-Length``/``X-Linked-Size``/``Content-Range``
      total; the real bytes are sent (cut at the claimed length, or the connection closed early when
      the real file is shorter) (file requests).
    - ``corrupt``: flip the first body byte of the response (file GETs); size and headers stay right.
    - ``redirect_to_cdn``: answer a hub resolve with 302 to the CDN host even for a non-LFS file.
    - ``hold_until``: a ``threading.Event`` the request waits on before it is answered (at most 120 s),
      so a test holds a client mid-request for as long as it needs, with no sleep.

    A fault that has no effect applicable to a request (e.g. ``close_after_bytes`` on a HEAD) does not
    match it and is not spent by it. ``hits`` counts the requests it was applied to.
    """

    file: str | None = None
    url: str | None = None
    repo_id: str | None = None
    method: str | None = None
    where: str | None = None
    times: int | None = 1
    hits: int = 0

    def __post_init__(self) -> None:
        if self.where not in (None, "hub", "cdn"):
            raise ValueError(f"where must be 'hub', 'cdn' or None, not {self.where!r}")
        if self.method is not None:
            self.method = self.method.upper()

    @property
    def spent(self) -> bool:
        return self.times is not None and self.hits >= self.times

    def _applies(self, req: _RequestInfo) -> bool:
        if self.spent:
            return False
        if self.method is not None and self.method.upper() != req.method:
            return False
        if self.where is not None and self.where != req.where:
            return False
        if self.repo_id is not None and self.repo_id != req.repo_id:
            return False
        if self.url is not None and not fnmatch.fnmatchcase(req.url_path, self.url):
            return False
        if self.file is not None and (req.file is None or not fnmatch.fnmatchcase(req.file, self.file)):
            return False
        is_get = req.method == "GET"
        is_file = req.file is not None and req.kind != "api-tree"
        has_body = req.direct if is_file else True
        effects = [
            self.status is not None,
            is_get and has_body and (self.close_after_bytes is not None or self.throughput_bps is not None),
            is_file and req.direct and self.ignore_range,
            is_file and self.advertise_size is not None,
            is_file and req.direct and is_get and self.corrupt,
            req.kind == "resolve" and req.direct and self.redirect_to_cdn,
            self.hold_until is not None,
        ]
        return any(effects)


@dataclasses.dataclass
class RequestRecord:
    """One answered request. The log is in the order responses were (about to be) completed, so a
    redirect's record always precedes the request that followed it."""

    method: str
    url_path: str  # raw path, query excluded
    query: str
    where: str  # "hub" or "cdn"
    repo_id: str | None
    file: str | None  # repo file path for resolve/resolve-cache/cdn requests
    revision: str | None
    range: str | None  # the Range header as sent
    status: int
    body_bytes: int  # body bytes actually written
    authorization: bool  # whether an Authorization header came
    faults: int  # how many faults were applied
    client_port: int  # the client's source port: equal ports = one keep-alive connection


@dataclasses.dataclass
class _RequestInfo:
    method: str
    url_path: str
    where: str
    kind: str  # resolve | resolve-cache | cdn | api | other
    repo_id: str | None = None
    file: str | None = None
    revision: str | None = None
    tree_path: str = ""
    direct: bool = False  # a file request answered with the file's bytes (not a redirect)


@dataclasses.dataclass
class _Effects(_EffectFields):
    count: int = 0  # how many faults were applied


# --------------------------------------------------------------------------- HTTP


class _HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # many parallel range connections must not wait on SYN retransmits
    hub: LocalHub


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; every response carries Content-Length
    server: _Server
    server_version = "hotfit-localhub/1"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # the request log is `LocalHub.requests`

    def setup(self) -> None:
        super().setup()
        self.server.hub._track(self.connection, add=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.hub._track(self.connection, add=False)

    def do_GET(self) -> None:
        self._serve("GET")

    def do_HEAD(self) -> None:
        self._serve("HEAD")

    def _not_allowed(self) -> None:
        self._serve(self.command)

    do_POST = do_PUT = do_DELETE = _not_allowed

    # ---- plumbing

    def _serve(self, method: str) -> None:
        hub = self.server.hub
        split = urlsplit(self.path)
        self._method = method
        self._split = split
        self._body_bytes = 0
        self._status = 0
        self._effects = _Effects()
        self._rec: RequestRecord | None = None
        self._req = _RequestInfo(method, split.path, "hub", "other")
        try:
            self._req = hub._route(method, split.path)
            self._effects = hub._take_effects(self._req)
            if self._effects.hold_until is not None:
                self._effects.hold_until.wait(timeout=120)
            if self._effects.status is not None:
                raise _HubError(self._effects.status, None, f"injected {self._effects.status}")
            if method not in ("GET", "HEAD"):
                raise _HubError(405, None, f"{method} not supported by the local hub")
            self._dispatch(self._req, split.query)
        except _HubError as e:
            self._send_error(e)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            self._record()
            assert self._rec is not None
            self._rec.body_bytes = self._body_bytes  # the truth, if a write broke after recording

    def _record(self) -> None:
        """Log this request. Called just before the client can see the end of the response, so a test
        that asserts on ``hub.requests`` right after its call returns always finds it."""
        if self._rec is not None:
            return
        req = self._req
        self._rec = RequestRecord(
            method=self._method,
            url_path=self._split.path,
            query=self._split.query,
            where=req.where,
            repo_id=req.repo_id,
            file=req.file,
            revision=req.revision,
            range=self.headers.get("Range"),
            status=self._status,
            body_bytes=self._body_bytes,
            authorization=self.headers.get("Authorization") is not None,
            faults=self._effects.count,
            client_port=self.client_address[1],
        )
        self.server.hub._record(self._rec)

    def _start(self, status: int, headers: Mapping[str, str], *, body_follows: bool) -> None:
        self._status = status
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        if not body_follows:
            self._record()
        self.end_headers()

    def _send_bytes(self, status: int, headers: dict[str, str], body: bytes) -> None:
        headers = {**headers, "Content-Length": str(len(body))}
        body_follows = self._method != "HEAD" and bool(body)
        self._start(status, headers, body_follows=body_follows)
        if body_follows:
            self._write_body(io.BytesIO(body).read, len(body), len(body))

    def _send_json(self, data: Any, headers: Mapping[str, str] | None = None) -> None:
        body = json.dumps(data).encode()
        self._send_bytes(200, {"Content-Type": "application/json; charset=utf-8", **(headers or {})}, body)

    def _send_error(self, e: _HubError) -> None:
        headers = {"Content-Type": "application/json; charset=utf-8", "X-Error-Message": _header_safe(e.message)}
        if e.code:
            headers["X-Error-Code"] = e.code
        if e.commit:
            headers["X-Repo-Commit"] = e.commit
        if self._effects.retry_after is not None:
            headers["Retry-After"] = str(self._effects.retry_after)
        self._send_bytes(e.status, headers, json.dumps({"error": e.message}).encode())

    def _write_body(self, read: Any, n_available: int, n_declared: int, file: BinaryIO | None = None,
                    offset: int = 0) -> None:
        """Write up to ``n_available`` body bytes, applying cut/pace/corrupt; drop the connection if
        fewer than ``n_declared`` (the Content-Length) went out, so the client sees a short body."""
        eff = self._effects
        hub = self.server.hub
        limit = n_available
        if eff.close_after_bytes is not None:
            limit = min(limit, eff.close_after_bytes)
        try:
            if file is not None and eff.throughput_bps is None and not eff.corrupt:
                # Fast path: the kernel copies file → socket (benchmarks measure the client, not us).
                # All but the last byte, then log, then the last byte (see `_record`).
                while self._body_bytes < limit - 1:
                    sent = self.connection.sendfile(file, offset + self._body_bytes, limit - 1 - self._body_bytes)
                    if sent == 0:
                        break
                    self._body_bytes += sent
                file.seek(offset + self._body_bytes)
                read = file.read
            chunk = _CHUNK_BYTES
            if eff.throughput_bps:
                chunk = max(1, min(chunk, int(eff.throughput_bps * _MAX_SLEEP_S)))
            t0, sent0 = time.monotonic(), self._body_bytes
            while self._body_bytes < limit and not hub._stopping.is_set():
                data = read(min(chunk, limit - self._body_bytes))
                if not data:
                    break
                if eff.corrupt and self._body_bytes == 0:
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                if self._body_bytes + len(data) >= limit:
                    self._body_bytes += len(data)
                    self._record()
                    self._body_bytes -= len(data)
                self.wfile.write(data)
                self._body_bytes += len(data)
                if eff.throughput_bps:
                    ahead_s = (self._body_bytes - sent0) / eff.throughput_bps - (time.monotonic() - t0)
                    if ahead_s > 0:
                        hub._stopping.wait(min(ahead_s, _MAX_SLEEP_S * 4))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            return
        if self._body_bytes < n_declared:
            # The body is shorter than promised: the only honest thing left is to drop the connection.
            self._record()
            self.close_connection = True
            try:
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # ---- endpoints

    def _dispatch(self, req: _RequestInfo, query: str) -> None:
        hub = self.server.hub
        params = parse_qs(query)
        if req.kind == "api-info":
            self._model_info(req, params)
        elif req.kind == "api-tree":
            self._tree(req, params)
        elif req.kind in ("resolve", "resolve-cache", "cdn"):
            self._file(req, params)
        elif req.kind == "unknown-repo":
            raise hub._repo_not_found(req, self.headers)
        else:
            raise _HubError(404, None, f"no such endpoint on the local hub: {req.url_path}")

    def _resolve(self, req: _RequestInfo) -> Commit:
        hub = self.server.hub
        assert req.repo_id is not None and req.revision is not None
        commit = hub.store.resolve_revision(req.repo_id, req.revision)
        if commit is None:
            raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {req.revision}")
        return commit

    def _model_info(self, req: _RequestInfo, params: Mapping[str, list[str]]) -> None:
        hub = self.server.hub
        assert req.repo_id is not None
        commit = self._resolve(req)
        cfg = hub.store.repo_config(req.repo_id)
        blobs = params.get("blobs", ["false"])[-1].lower() == "true"
        siblings = []
        for path, e in sorted(commit.files.items()):
            sib: dict[str, Any] = {"rfilename": path}
            if blobs:
                sib["size"] = e.size_bytes
                sib["blobId"] = e.blob_id
                if e.lfs:
                    sib["lfs"] = {"sha256": e.sha256, "size": e.size_bytes, "pointerSize": e.pointer_size_bytes}
            siblings.append(sib)
        created = _iso(cfg.get("created_at", 0.0))
        self._send_json(
            {
                "_id": hashlib.sha1(req.repo_id.encode()).hexdigest()[:24],
                "id": req.repo_id,
                "modelId": req.repo_id,
                "author": req.repo_id.split("/")[0] if "/" in req.repo_id else None,
                "sha": commit.id,
                "lastModified": commit.created_at,
                "createdAt": created,
                "private": False,
                "gated": "manual" if cfg.get("gated_token") else False,
                "disabled": False,
                "downloads": 0,
                "likes": 0,
                "tags": ["gguf"] if any(p.endswith(".gguf") for p in commit.files) else [],
                "siblings": siblings,
                "usedStorage": sum(e.size_bytes for e in commit.files.values()),
            }
        )

    def _tree(self, req: _RequestInfo, params: Mapping[str, list[str]]) -> None:
        hub = self.server.hub
        commit = self._resolve(req)
        base = req.tree_path.strip("/")
        recursive = params.get("recursive", ["false"])[-1].lower() == "true"
        prefix = f"{base}/" if base else ""
        under = {p: e for p, e in commit.files.items() if p.startswith(prefix)}
        if base and not under:
            raise _HubError(404, "EntryNotFound", f"{base} does not exist on {req.revision}", commit.id)
        dirs: dict[str, list[str]] = {}
        files: list[FileEntry] = []
        for p, e in under.items():
            rel_parts = p[len(prefix):].split("/")
            for depth in range(1, len(rel_parts)):
                d = prefix + "/".join(rel_parts[:depth])
                dirs.setdefault(d, []).append(p)
            if recursive or len(rel_parts) == 1:
                files.append(e)
        if not recursive:
            dirs = {d: c for d, c in dirs.items() if "/" not in d[len(prefix):]}
        entries: list[dict[str, Any]] = [
            {"type": "directory", "path": d, "oid": _directory_oid(d, c)} for d, c in dirs.items()
        ]
        for e in files:
            item: dict[str, Any] = {"type": "file", "path": e.path, "oid": e.blob_id, "size": e.size_bytes}
            if e.lfs:
                item["lfs"] = {"oid": e.sha256, "size": e.size_bytes, "pointerSize": e.pointer_size_bytes}
            entries.append(item)
        entries.sort(key=lambda it: it["path"])
        try:
            cursor = int(params.get("cursor", ["0"])[-1])
        except ValueError:
            raise _HubError(400, None, "bad cursor") from None
        page = hub.tree_page_size
        headers: dict[str, str] = {}
        if cursor + page < len(entries):
            q = {k: v[-1] for k, v in params.items()}
            q["cursor"] = str(cursor + page)
            host = self.headers.get("Host") or f"{hub.host}:{hub.port}"
            headers["Link"] = f'<http://{host}{req.url_path}?{urlencode(q)}>; rel="next"'
        self._send_json(entries[cursor : cursor + page], headers)

    def _file(self, req: _RequestInfo, params: Mapping[str, list[str]]) -> None:
        hub = self.server.hub
        assert req.repo_id is not None and req.file is not None
        if req.kind != "cdn":
            hub._check_gate(req, self.headers)
        commit = self._resolve(req)
        entry = commit.files.get(req.file)
        if entry is None:
            raise _HubError(404, "EntryNotFound", f"{req.file} does not exist on {req.revision}", commit.id)
        eff = self._effects
        size = eff.advertise_size if eff.advertise_size is not None else entry.size_bytes
        etag = f'"{entry.etag}"'
        headers: dict[str, str] = {}
        if req.kind != "cdn":
            headers["X-Repo-Commit"] = commit.id
        if entry.lfs and req.kind != "cdn":
            headers["X-Linked-Etag"] = etag
            headers["X-Linked-Size"] = str(size)
        if req.kind == "resolve" and (eff.redirect_to_cdn or (entry.lfs and hub.redirect_lfs)):
            # As the real Hub: 302 to a signed CDN URL on another origin, metadata on the 302 itself.
            headers["X-Linked-Etag"] = etag
            headers["X-Linked-Size"] = str(size)
            headers["ETag"] = etag
            headers["Location"] = hub.cdn_url(req.repo_id, commit.id, req.file)
            self._send_bytes(302, headers, b"")
            return
        if req.kind == "resolve" and not entry.lfs and hub.redirect_small:
            # The real Hub's same-origin 307 for small files (the final 200 carries the metadata).
            headers["Location"] = (
                f"/api/resolve-cache/models/{req.repo_id}/{commit.id}/{quote(req.file)}?"
                + urlencode({"etag": etag})
            )
            self._send_bytes(307, headers, b"")
            return
        name = req.file.rsplit("/", 1)[-1]
        headers.update(
            {
                "ETag": etag,
                "Accept-Ranges": "bytes",
                "Content-Type": "application/octet-stream",
                "Content-Disposition": f"inline; filename*=UTF-8''{quote(name)}; filename=\"{_header_safe(name)}\";",
                "Cache-Control": "public, max-age=31536000, immutable" if req.kind == "cdn" else "private",
            }
        )
        rng = None if eff.ignore_range else parse_range(self.headers.get("Range"), size)
        if rng == "unsatisfiable":
            headers["Content-Range"] = f"bytes */{size}"
            self._send_bytes(416, headers, b"")
            return
        if rng is None:
            status, start, length = 200, 0, size
        else:
            assert isinstance(rng, tuple)
            start, end = rng
            status, length = 206, end - start + 1
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        headers["Content-Length"] = str(length)
        self._start(status, headers, body_follows=self._method != "HEAD" and length > 0)
        if self._method == "HEAD" or length == 0:
            return
        obj = hub.store.object_path(entry.sha256)
        with obj.open("rb") as f:
            f.seek(start)
            available = max(0, min(length, entry.size_bytes - start))
            self._write_body(f.read, available, length, file=f, offset=start)


# --------------------------------------------------------------------------- the server object


class LocalHub:
    """A running local Hub: ``with LocalHub(root) as hub: ...`` or ``hub.start()`` / ``hub.stop()``.

    - ``root``: directory for the on-disk store (created); None → a temporary directory removed on stop.
    - ``host``/``port``: the listener (port 0 → a free port). ``endpoint`` is ``http://host:port``.
    - ``cdn_host``: the second host name the CDN redirects use (same listener); ``cdn_endpoint``.
    - ``lfs_threshold_bytes``: files above it are LFS unless a commit says otherwise.
    - ``redirect_lfs``: LFS resolves answer 302 to the CDN (default, like the real Hub); False → 200.
    - ``redirect_small``: small-file resolves answer 307 to ``/api/resolve-cache/...`` (real Hub today).
    - ``tree_page_size``: tree listing page length (``Link: rel="next"`` beyond it).
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        cdn_host: str = "localhost",
        lfs_threshold_bytes: int = DEFAULT_LFS_THRESHOLD_BYTES,
        redirect_lfs: bool = True,
        redirect_small: bool = False,
        tree_page_size: int = 1000,
    ):
        if host == cdn_host:
            raise ValueError("cdn_host must differ from host: clients tell the CDN apart by host name")
        self._tmpdir = None if root is not None else tempfile.mkdtemp(prefix="localhub-")
        store_root = root if root is not None else self._tmpdir
        assert store_root is not None
        self.store = HubStore(store_root, lfs_threshold_bytes=lfs_threshold_bytes)
        self.host = host
        self.cdn_host = cdn_host
        self.redirect_lfs = redirect_lfs
        self.redirect_small = redirect_small
        self.tree_page_size = tree_page_size
        self._requested_port = port
        self.port = 0
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._requests: list[RequestRecord] = []
        self._connections: set[socket.socket] = set()

    # ---- lifecycle

    def start(self) -> LocalHub:
        server = _Server((self.host, self._requested_port), _Handler)
        server.hub = self
        self._server = server
        self.port = server.server_address[1]
        self._stopping.clear()
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"localhub:{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            conns = list(self._connections)
        for conn in conns:  # wake handler threads parked on idle keep-alive connections
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> LocalHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serve_forever(self) -> None:
        """Block until SIGINT/SIGTERM (for ``python -m tests.hubserver``)."""
        done = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: done.set())
        done.wait()

    # ---- addresses

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def cdn_endpoint(self) -> str:
        return f"http://{self.cdn_host}:{self.port}"

    def url(self, repo_id: str, path: str, revision: str = "main") -> str:
        """The resolve URL, encoded the way ``huggingface_hub.hf_hub_url`` does it."""
        return f"{self.endpoint}/{repo_id}/resolve/{quote(revision, safe='')}/{quote(path)}"

    def cdn_url(self, repo_id: str, commit_id: str, path: str) -> str:
        expires = int(time.time()) + 3600  # looks like a signed URL; never checked
        return f"{self.cdn_endpoint}/cdn/{quote(repo_id, safe='')}/{commit_id}/{quote(path)}?Expires={expires}"

    def env(self) -> dict[str, str]:
        """Environment for a subprocess client (huggingface_hub reads these once, at import)."""
        return {
            "HF_ENDPOINT": self.endpoint,
            "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        }

    # ---- repo API (delegates to the store)

    def create_repo(self, repo_id: str, files: Mapping[str, FileSource] | None = None, **kw: Any) -> str:
        return self.store.create_repo(repo_id, files, **kw)

    def commit(self, repo_id: str, files: Mapping[str, FileSource | None], **kw: Any) -> str:
        return self.store.commit(repo_id, files, **kw)

    def set_ref(self, repo_id: str, branch: str, commit_id: str) -> None:
        self.store.set_ref(repo_id, branch, commit_id)

    def set_gated(self, repo_id: str, token: str | None) -> None:
        self.store.set_gated(repo_id, token)

    def head(self, repo_id: str, branch: str = "main") -> str:
        return self.store.head(repo_id, branch)

    def file_entry(self, repo_id: str, path: str, revision: str = "main") -> FileEntry:
        return self.store.file_entry(repo_id, path, revision)

    # ---- faults

    def inject(self, **kw: Any) -> Fault:
        """Add a ``Fault(**kw)`` (see its docstring); returns it so tests can read ``hits``/``spent``."""
        fault = Fault(**kw)
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def _take_effects(self, req: _RequestInfo) -> _Effects:
        eff = _Effects()
        with self._lock:
            for f in self._faults:
                if not f._applies(req):
                    continue
                f.hits += 1
                eff.count += 1
                if f.status is not None and eff.status is None:
                    eff.status, eff.retry_after = f.status, f.retry_after
                for name in ("close_after_bytes", "throughput_bps", "advertise_size"):
                    if getattr(f, name) is not None and getattr(eff, name) is None:
                        setattr(eff, name, getattr(f, name))
                eff.ignore_range |= f.ignore_range
                eff.corrupt |= f.corrupt
                eff.redirect_to_cdn |= f.redirect_to_cdn
                eff.hold_until = eff.hold_until or f.hold_until
        return eff

    # ---- counters

    @property
    def requests(self) -> list[RequestRecord]:
        """A snapshot of the request log."""
        with self._lock:
            return list(self._requests)

    def requests_for(self, *, file: str | None = None, method: str | None = None,
                     where: str | None = None) -> list[RequestRecord]:
        return [
            r for r in self.requests
            if (file is None or r.file == file) and (method is None or r.method == method)
            and (where is None or r.where == where)
        ]

    def bytes_sent(self, file: str | None = None) -> int:
        """Body bytes written for ``file`` (a repo path; None → all requests), hub and CDN together."""
        return sum(r.body_bytes for r in self.requests if file is None or r.file == file)

    def reset_counters(self) -> None:
        with self._lock:
            self._requests.clear()

    def _record(self, rec: RequestRecord) -> None:
        with self._lock:
            self._requests.append(rec)

    def _track(self, conn: socket.socket, *, add: bool) -> None:
        with self._lock:
            (self._connections.add if add else self._connections.discard)(conn)

    # ---- routing and auth

    def _split_repo(self, segments: list[str], marker: str) -> tuple[str, list[str]] | None:
        """``org/name/<marker>/...`` or ``name/<marker>/...`` → (repo_id, segments after marker),
        preferring a split that names an existing repo."""
        candidates = []
        for n in (2, 1):
            if len(segments) > n and segments[n] == marker:
                candidates.append(("/".join(segments[:n]), segments[n + 1 :]))
        for repo_id, rest in candidates:
            if self.store.repo_exists(repo_id):
                return repo_id, rest
        return candidates[0] if candidates else None

    def _route(self, method: str, raw_path: str) -> _RequestInfo:
        segs = raw_path.lstrip("/").split("/")
        req = _RequestInfo(method, raw_path, "hub", "other")
        if segs[0] == "cdn" and len(segs) >= 4:
            req.where, req.kind, req.direct = "cdn", "cdn", True
            req.repo_id, req.revision = unquote(segs[1]), segs[2]
            req.file = unquote("/".join(segs[3:]))
            return req
        if segs[:3] == ["api", "resolve-cache", "models"]:
            rest = segs[3:]
            # {repo (1-2 segments)}/{commit}/{path...}: the commit is the first 40-hex segment.
            for n in (2, 1):
                if len(rest) > n + 1 and is_commit_id(rest[n]):
                    req.kind, req.repo_id, req.revision = "resolve-cache", "/".join(rest[:n]), rest[n]
                    req.direct = True
                    req.file = unquote("/".join(rest[n + 1:]))
                    if self.store.repo_exists(req.repo_id):
                        break
            return self._check_repo(req)
        if segs[:2] == ["api", "models"]:
            rest = segs[2:]
            for marker, kind in (("revision", "api-info"), ("tree", "api-tree")):
                split = self._split_repo(rest, marker)
                if split and split[1]:
                    req.kind, req.repo_id = kind, unquote(split[0])
                    req.revision = unquote(split[1][0])
                    if kind == "api-tree":
                        req.tree_path = unquote("/".join(split[1][1:]))  # sent as `sub%2Fdir`
                    return self._check_repo(req)
            if 1 <= len(rest) <= 2 and all(rest):
                req.kind, req.repo_id, req.revision = "api-info", "/".join(rest), "main"
                return self._check_repo(req)
            return req
        split = self._split_repo(segs, "resolve")
        if split and len(split[1]) >= 2:
            req.kind, req.repo_id = "resolve", split[0]
            req.revision = unquote(split[1][0])
            req.file = unquote("/".join(split[1][1:]))
            self._check_repo(req)
            if req.kind == "resolve":
                req.direct = not self._redirects(req)
            return req
        return req

    def _redirects(self, req: _RequestInfo) -> bool:
        """Whether a hub resolve of this file answers with a redirect (by policy, before faults)."""
        assert req.repo_id is not None and req.revision is not None and req.file is not None
        try:
            commit = self.store.resolve_revision(req.repo_id, req.revision)
        except (OSError, ValueError):
            return False
        entry = commit.files.get(req.file) if commit else None
        if entry is None:
            return False
        return (entry.lfs and self.redirect_lfs) or (not entry.lfs and self.redirect_small)

    def _check_repo(self, req: _RequestInfo) -> _RequestInfo:
        if req.repo_id is not None and not self.store.repo_exists(req.repo_id):
            req.kind = "unknown-repo"
        return req

    def _repo_not_found(self, req: _RequestInfo, headers: Any) -> _HubError:
        # The real Hub answers 401 to anonymous callers (it will not say whether a private repo exists).
        status = 404 if headers.get("Authorization") else 401
        return _HubError(status, "RepoNotFound", f"Repository not found: {req.repo_id}")

    def _check_gate(self, req: _RequestInfo, headers: Any) -> None:
        assert req.repo_id is not None
        token = self.store.repo_config(req.repo_id).get("gated_token")
        if not token:
            return
        auth = headers.get("Authorization") or ""
        if auth == f"Bearer {token}":
            return
        # Anonymous → 401; authenticated but not granted → 403; both with GatedRepo, as the Hub does.
        status = 403 if auth else 401
        raise _HubError(status, "GatedRepo", f"Access to model {req.repo_id} is restricted and you are not in the "
                        "authorized list. Visit the model page to ask for access.")


# --------------------------------------------------------------------------- CLI


# --------------------------------------------------------------------------- a plain HTTP server


@contextlib.contextmanager
def serve_handler(handler: type[BaseHTTPRequestHandler], **server_attrs: Any) -> Iterator[str]:
    """Serve ``handler`` on 127.0.0.1:<free port> in a daemon thread and yield the base URL; shut down on
    exit. ``server_attrs`` are set on the server, for the handler to read as ``self.server.<name>``. For
    the stand-ins that are no Hub (a proxy's page, a stale mirror, a scripted chat endpoint)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    for name, value in server_attrs.items():
        setattr(server, name, value)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def free_port_closed() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.hubserver", description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True, help="store directory (repos created by HubStore/LocalHub)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 → a free port")
    ap.add_argument("--cdn-host", default="localhost")
    ap.add_argument("--no-redirect-lfs", action="store_true", help="serve LFS files directly (no 302)")
    ap.add_argument("--redirect-small", action="store_true", help="307 small files to /api/resolve-cache")
    args = ap.parse_args(argv)
    with LocalHub(args.root, host=args.host, port=args.port, cdn_host=args.cdn_host,
                  redirect_lfs=not args.no_redirect_lfs, redirect_small=args.redirect_small) as hub:
        print(json.dumps({"endpoint": hub.endpoint, "cdn_endpoint": hub.cdn_endpoint, "root": str(hub.store.root)}),
              flush=True)
        hub.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The Hub session: one ``httpx.AsyncClient`` bound to one endpoint and token, the pinned HEAD.

Ours, on ``httpx``: ``huggingface_hub`` ≥ 1.18 no longer resumes across processes and never hashes
(huggingface_hub's file_download.py), so it serves only for the token store
and metadata calls. URLs name the 40-hex commit; a HEAD must answer ``X-Repo-Commit`` == the pin and
the registry's size, else :class:`PinMismatch` before a byte is written. The token goes
only to the endpoint's own origin, never to a CDN — and only once the endpoint has shown itself a
Hub (X-Repo-Commit or X-Error-Code on an answer), or is the Hub itself, or HOTFIT_MIRROR_TOKEN asks.

A **static mirror** (any file server holding ``{repo}/resolve/{commit}/{file}``, filled by
``hotfit fleet mirror``) answers without X-Repo-Commit. Its answer is taken only for a file the
registry pins by revision, size and sha256 (:class:`StaticPins`): the commit is the pinned one (it is
in the URL), the size is checked here, the sha256 by verify — nothing the server says is trusted.
Anything else is refused with the reason (docs/fleet.md, "Serving the mirror").
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import quote, urljoin, urlsplit

from hotfit.core.errors import HubError, PinMismatch
from hotfit.core.log import get_logger
from hotfit.core.lazy_import import lazy_module
from hotfit.core.settings import DEFAULT_HF_ENDPOINT, Settings, endpoint_url
from hotfit.download.hub_errors import (Retryable, answer_text, certificate_error, certificate_failure,
                                        hub_error_from_response, not_a_hub_error, redact_url, speaks_hub)
from hotfit.download.options import TransferOptions
from hotfit.download.proxy import Proxy, ProxyConfig, is_proxy_auth_failure, proxy_config, proxy_refused
from hotfit.download.tls import tls_context
from hotfit.download.wire import ConnectionPool

if TYPE_CHECKING:  # the type checker reads the real module; at run time it loads on first use
    import httpx
else:
    httpx = lazy_module("httpx")  # third-party, imported on first use (core.lazy_import says why)

# httpcore reads at most 64 KiB per recv(); at local/LAN speeds the per-read overhead of the HTTP/1.1
# parser then caps one Python stream well below curl. 256 KiB measured ~35 % faster than 64 KiB, 1 MiB
# another ~9 % (single stream, 3 interleaved rounds: 565 → 620 MB/s, client CPU 1.73 → 1.61 s per GiB;
# 4 MiB was no better). It only raises the *maximum* bytes taken per read — semantics are unchanged —
# but it is a class attribute, so it applies to every httpx client in this process. Set when the
# first Hub session opens (httpcore, like httpx, is not imported by a command that fetches nothing).
_HTTPCORE_READ_BYTES = 1024 * 1024


def _raise_httpcore_read_size() -> None:
    """Idempotent; the import is sys.modules' after the first session."""
    try:
        import httpcore._async.http11 as _h11  # third-party: first use only (core.lazy_import says why)

        if getattr(_h11.AsyncHTTP11Connection, "READ_NUM_BYTES", 0) < _HTTPCORE_READ_BYTES:
            _h11.AsyncHTTP11Connection.READ_NUM_BYTES = _HTTPCORE_READ_BYTES
    except (ImportError, AttributeError):  # pragma: no cover - a future httpcore: keep its default
        pass

log = get_logger()

USER_AGENT = "hotfit/0.1"
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def resolve_token() -> str | None:
    """``HF_TOKEN`` or the huggingface_hub token store (never logged)."""
    try:
        from huggingface_hub import get_token

        return get_token()
    except Exception:  # a broken token store must not break anonymous downloads
        return os.environ.get("HF_TOKEN") or None


def check_endpoint(endpoint: str) -> str:
    """``HF_ENDPOINT`` as a base URL, or a UsageError (exit 2) at once — not minutes of retries
    ending in a transfer error (the one rule, :func:`core.settings.endpoint_url`)."""
    return endpoint_url(endpoint)


def speaks_hub_endpoint(settings: Settings) -> bool:
    """Whether the token may go to ``HF_ENDPOINT`` before it has answered: the Hub itself, or the
    operator asked with HOTFIT_MIRROR_TOKEN (docs/fleet.md, "Serving the mirror")."""
    return origin(settings.hf_endpoint) == origin(DEFAULT_HF_ENDPOINT) or settings.mirror_token


def origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme.lower(), parts.netloc.lower()


def _normalize_etag(value: str | None) -> str | None:
    if not value:
        return None
    value = value.strip()
    if value.startswith("W/"):
        value = value[2:]
    return value.strip('"') or None


@dataclass(frozen=True)
class StaticPins:
    """What the registry pins of the file a HEAD is for: a static mirror's answer is taken for it
    only when both are known (the revision is the URL's)."""

    size_bytes: int | None
    sha256: str | None
    # a file of an OpenVINO snapshot kept in git: its git blob id from the snapshot's listing, which
    # the registry pins by its sha256 (core.model_files.snapshot_listing_sha256)
    git_sha1: str | None = None
    listing_unpinned: bool = False  # a snapshot file whose listing the registry does not pin

    @property
    def unpinned(self) -> str | None:
        """Why a static mirror cannot serve the file (None: it can)."""
        if self.listing_unpinned:
            return "the snapshot's file list (artifact.sha256)"
        missing = [what for what, v in (("size", self.size_bytes), ("sha256", self.sha256 or self.git_sha1))
                   if v is None]
        return None if not missing else " and ".join(missing)


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


class HubSession:
    """An ``httpx.AsyncClient`` bound to one endpoint and token. Use ``async with``."""

    def __init__(self, settings: Settings, options: TransferOptions | None = None,
                 token: str | None | bool = None) -> None:
        # Offline, nothing is requested: a stale HF_ENDPOINT must not break a rerun from disk.
        self.endpoint = (settings.hf_endpoint.rstrip("/") if settings.hf_offline
                         else check_endpoint(settings.hf_endpoint))
        self.offline = settings.hf_offline
        self.hf_hub_cache = settings.hf_hub_cache  # read by fetch-weights before it downloads (download.hf_cache)
        # Proxies (download.proxy): checked here, before any request; offline none is needed.
        self.proxies = ProxyConfig() if settings.hf_offline else proxy_config(dict(settings.proxy_env))
        self.options = options or TransferOptions(connections=settings.download_connections)
        self._token = resolve_token() if token is None else (token or None)
        self._origin = origin(self.endpoint)
        # The token goes to the endpoint once it has answered like a Hub (or is the Hub, or the
        # operator asked with HOTFIT_MIRROR_TOKEN): never to a static mirror by default.
        self._speaks_hub = speaks_hub_endpoint(settings)
        self.static_mirror = False  # set when the endpoint answered a resolve without X-Repo-Commit
        limits = httpx.Limits(max_connections=max(8, self.options.connections * 2),
                              max_keepalive_connections=max(8, self.options.connections * 2))
        timeout = httpx.Timeout(self.options.read_timeout_s, connect=self.options.connect_timeout_s)
        _raise_httpcore_read_size()
        # This client only ever asks the endpoint's origin (HEADs follow same-origin redirects only),
        # so the endpoint's proxy is its proxy; trust_env stays off so nothing else of the
        # environment (.netrc, certificate variables) changes what it sends.
        proxy = self.proxies.for_url(self.endpoint)
        # One TLS context for the HEADs and the byte-range engine, trusting what huggingface_hub's
        # requests trust (download.tls): SSL_CERT_FILE / SSL_CERT_DIR, else the system store.
        tls = tls_context()
        self.client = httpx.AsyncClient(limits=limits, timeout=timeout, follow_redirects=False,
                                        headers={"user-agent": USER_AGENT}, trust_env=False, verify=tls,
                                        proxy=proxy.httpx_url if proxy else None)
        # Ranged GETs of file bodies (download.wire): blocking sockets read in worker threads.
        self.wire = ConnectionPool(connect_timeout_s=self.options.connect_timeout_s,
                                   read_timeout_s=self.options.read_timeout_s, user_agent=USER_AGENT,
                                   proxy_for=self.proxies.for_url, ssl_context=tls)

    async def __aenter__(self) -> "HubSession":
        return self

    async def __aexit__(self, *_exc: object) -> None:
        self.wire.close()
        await self.client.aclose()

    def resolve_url(self, repo: str, revision: str, path: str) -> str:
        return f"{self.endpoint}/{repo}/resolve/{quote(revision, safe='')}/{quote(path)}"

    def proxy_for(self, url: str) -> Proxy | None:
        return self.proxies.for_url(url)

    def is_own_origin(self, url: str) -> bool:
        return origin(url) == self._origin

    def headers_for(self, url: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        """Authorization only to the endpoint's origin (never to a CDN)."""
        headers = {"accept-encoding": "identity"}
        if self._token and self._speaks_hub and origin(url) == self._origin:
            headers["authorization"] = f"Bearer {self._token}"
        if extra:
            headers.update(extra)
        return headers

    def _check_online(self, what: str) -> None:
        if self.offline:
            raise HubError(f"HF_HUB_OFFLINE is set and {what} is not on disk",
                           hint="unset HF_HUB_OFFLINE (or set it to 0) to download, or copy the files in")

    async def head(self, repo: str, revision: str, path: str, static: StaticPins | None = None) -> RemoteFile:
        """HEAD the resolve URL, following same-origin redirects by hand (hf-protocol.md §6).
        ``static``: the registry's pins of the file, with which a static mirror's answer is taken."""
        self._check_online(f"{repo}/{path}")
        url = resolve = self.resolve_url(repo, revision, path)
        commit = etag = linked_etag = None
        size: int | None = None
        accept_ranges = False
        for _hop in range(10):
            proxy = self.proxy_for(url)
            try:
                sent_token = "authorization" in self.headers_for(url)
                resp = await self.client.head(url, headers=self.headers_for(url))
                if not self._speaks_hub and self.is_own_origin(url) and speaks_hub(resp.headers):
                    self._speaks_hub = True  # a Hub: the token may go there from now on
                    if self._token and not sent_token and resp.status_code in (401, 403, 404):
                        resp = await self.client.head(url, headers=self.headers_for(url))  # it asks for the token
            except httpx.TransportError as exc:
                if proxy is not None and is_proxy_auth_failure(exc):
                    raise proxy_refused(proxy, f"HEAD {repo}/{path}") from exc
                if (failure := certificate_failure(exc)) is not None:  # permanent: never retried
                    raise certificate_error(failure, url, proxy=proxy) from None
                via = f" (through proxy {proxy.named})" if proxy else ""
                raise Retryable(f"HEAD {repo}/{path}: {exc.__class__.__name__}: {exc}{via}", proxy=proxy) from exc
            if resp.status_code == 407 and proxy is not None:
                raise proxy_refused(proxy, f"HEAD {repo}/{path}")
            commit = resp.headers.get("x-repo-commit") or commit
            linked_etag = resp.headers.get("x-linked-etag") or linked_etag
            etag = resp.headers.get("etag") or etag
            if resp.headers.get("x-linked-size", "").isdigit():
                size = int(resp.headers["x-linked-size"])
            if resp.headers.get("accept-ranges", "").lower() == "bytes":
                accept_ranges = True
            if resp.is_redirect:
                target = urljoin(url, resp.headers.get("location", ""))
                if origin(target) == self._origin:
                    url = target
                    continue
                url = target  # off-origin: a CDN; its signed URL is where the bytes come from
                break
            if (resp.status_code == 404 and static is not None and not self._speaks_hub
                    and not speaks_hub(resp.headers) and self.is_own_origin(url)):
                err = not_a_hub_error(self.endpoint, url, answer_text(404, resp.headers.get("content-type"))
                                      + " without the Hub's X-Error-Code")
                raise HubError(f"{err.what} (a static mirror that does not hold {repo}/resolve/{revision}/{path}, "
                               "or no Hub)",
                               hint="fill the mirror with `hotfit fleet mirror DIR --plan PLAN.json` (or the entry "
                                    "names), or point HF_ENDPOINT at the Hub, then rerun", **err.details)
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
            return self._static_answer(repo, revision, path, url, resp, size, accept_ranges, static)
        tag = _normalize_etag(linked_etag or etag)
        lfs = _normalize_etag(linked_etag)
        return RemoteFile(resolve_url=resolve, download_url=url, commit=commit, etag=tag, size_bytes=size,
                          lfs_sha256=lfs if lfs and _SHA256_RE.match(lfs) else None,
                          accept_ranges=accept_ranges)

    def _static_answer(self, repo: str, revision: str, path: str, url: str, resp: httpx.Response,
                       size: int | None, accept_ranges: bool, static: StaticPins | None) -> RemoteFile:
        """An answer without X-Repo-Commit: a static mirror's, taken only for a file pinned by
        revision, size and sha256 on the endpoint's own origin; else the not-a-Hub error, with why."""
        answered = answer_text(resp.status_code, resp.headers.get("content-type")) + f" for {repo}/{path} without X-Repo-Commit"
        err = not_a_hub_error(self.endpoint, url, answered)
        if resp.status_code >= 300 or not self.is_own_origin(url) or (
                (resp.headers.get("content-type") or "").split(";")[0].strip() == "text/html"):
            raise err  # a web page or a redirect elsewhere: no static mirror's file either
        unpinned = "its revision" if static is None else static.unpinned
        if unpinned:
            raise HubError(f"{err.what}; a static mirror is trusted only for files the registry pins by revision, "
                           f"size and sha256, and it does not pin {unpinned} of {repo}/{path}",
                           hint="pin the entry (hotfit registry lock), or use the Hub or a mirror that speaks its "
                                "protocol", **err.details)
        if not self.static_mirror:
            self.static_mirror = True
            log.info("download.static_mirror", endpoint=redact_url(self.endpoint), token_sent=self._speaks_hub
                     and self._token is not None)
        return RemoteFile(resolve_url=self.resolve_url(repo, revision, path), download_url=url, commit=revision,
                          etag=None, size_bytes=size, lfs_sha256=None, accept_ranges=accept_ranges)

    async def head_pinned(self, repo: str, revision: str, path: str, expected_size: int | None,
                          expected_sha256: str | None = None, static: StaticPins | None = None) -> RemoteFile:
        """HEAD and fail closed unless the commit is the pin and the size the registry's.
        ``static``: what a static mirror is trusted with (default: the size and sha256 given)."""
        remote = await self.head(repo, revision, path, static or StaticPins(expected_size, expected_sha256))
        if remote.commit != revision:
            raise PinMismatch(
                f"{repo}/{path}: the Hub served commit {remote.commit} but the registry pins {revision}",
                hint="the pinned revision is not what the server resolves; re-pin the entry after review "
                     "(hotfit registry lock) — a moved branch is never accepted silently",
                repo=repo, file=path, pinned=revision, served=remote.commit)
        if expected_size is not None and remote.size_bytes is not None and remote.size_bytes != expected_size:
            if self.static_mirror:  # nothing it says is trusted: its file is the wrong one, the pin stands
                raise HubError(f"{repo}/{path}: the static mirror {redact_url(self.endpoint)} serves "
                               f"{remote.size_bytes} bytes where {expected_size} are pinned",
                               hint="the mirror holds another file under this name; fill it again with "
                                    "`hotfit fleet mirror`, then rerun", repo=repo, file=path,
                               served_size_bytes=remote.size_bytes, expected_size_bytes=expected_size)
            raise PinMismatch(
                f"{repo}/{path}: the Hub reports {remote.size_bytes} bytes, the registry pins {expected_size}",
                hint="the registry's size is wrong for this commit; fix the entry after review",
                repo=repo, file=path, expected_size_bytes=expected_size, served_size_bytes=remote.size_bytes)
        return remote

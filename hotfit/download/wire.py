"""One GET on a blocking socket in a worker thread: the body read straight into reused buffers.

Why: on one stream the event loop was the bound (scripts/bench-download: ~1.5 s of loop
CPU per GiB in httpx/httpcore/h11 — each body byte copied by the asyncio transport, by h11's
receive buffer and again into a ``Data`` event — against curl's 1.3 s for everything). Here a
``Content-Length`` body goes ``recv_into`` → a pooled 1 MiB buffer → ``pwrite`` + sha256 in the
write-behind thread, with no copy in Python; ``http.client`` only parses the status line and headers
(chunked or close-delimited bodies are read by it too, with its own copies: they do not occur for
ranged Hub/CDN answers). HEADs and Hub metadata calls stay on httpx.

Proxies (``download.proxy``, the same decision the HEADs' httpx client makes): an ``http://`` target
is asked of the proxy in absolute form, an ``https://`` one through a ``CONNECT`` tunnel
(``http.client``'s ``set_tunnel``), with ``Proxy-Authorization`` when the proxy URL has credentials;
a failure to reach the proxy names it.

Kept from the httpx path: redirects followed (at most 20, like httpx), the Authorization header only
to the endpoint's origin on every hop (``HubSession.headers_for``), the connect and read timeouts,
keep-alive connections reused between blocks, the same TLS context (``HubSession``'s:
``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` when set, else the system store, as huggingface_hub reads them:
``download.tls``),
and transport failures as :class:`Retryable` named like httpx's (``ConnectError``, ``ReadTimeout``,
``ReadError``, ``RemoteProtocolError``) for the ``download.retry`` events.
"""

from __future__ import annotations

import http.client
import queue
import socket
import ssl
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable
from urllib.parse import urljoin, urlsplit

from hotfit.core.errors import HubError
from hotfit.core.lazy_import import lazy_module
from hotfit.download.hub_errors import Retryable, certificate_error, certificate_failure
from hotfit.download.proxy import Proxy, is_proxy_auth_failure, proxy_refused
from hotfit.download.tls import tls_context

if TYPE_CHECKING:  # the type checker reads the real module; at run time it loads on first use
    import httpx
else:
    httpx = lazy_module("httpx")  # third-party, imported on first use (core.lazy_import says why)

MAX_REDIRECTS = 20  # httpx's default
_REDIRECTS = (301, 302, 303, 307, 308)
_Key = tuple[str, str, int]


def _key(url: str) -> _Key:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or (443 if scheme == "https" else 80)


def _target(url: str) -> str:
    parts = urlsplit(url)
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def transport_error(what: str, exc: BaseException, *, connecting: bool = False,
                    proxy: Proxy | None = None, url: str | None = None) -> Exception:
    """A socket or protocol failure as a Retryable whose text names it the way httpx did (and the
    proxy the connection went through); a failed certificate verification as the CertificateError
    that is never retried."""
    if url is not None and (failure := certificate_failure(exc)) is not None:
        return certificate_error(failure, url, proxy=proxy)
    if connecting:
        name = "ConnectTimeout" if isinstance(exc, TimeoutError) else "ConnectError"
    elif isinstance(exc, TimeoutError):
        name = "ReadTimeout"
    elif isinstance(exc, http.client.HTTPException):
        name = "RemoteProtocolError"
    else:
        name = "ReadError"
    via = f" (through proxy {proxy.named})" if proxy else ""
    return Retryable(f"{what}: {name}: {exc.__class__.__name__}: {exc}{via}", proxy=proxy)


class ConnectionPool:
    """Idle keep-alive ``http.client`` connections per (scheme, host, port); thread-safe. ``proxy_for``
    routes a URL (the route depends on the origin only, so the key stays the origin)."""

    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float, user_agent: str,
                 proxy_for: Callable[[str], Proxy | None] = lambda _url: None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.connect_timeout_s, self.read_timeout_s, self.user_agent = connect_timeout_s, read_timeout_s, user_agent
        self.proxy_for = proxy_for
        self._idle: dict[_Key, list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self._ssl = ssl_context
        self._closed = False

    def take(self, url: str, *, reuse: bool = True) -> tuple[http.client.HTTPConnection, bool]:
        """(a connection to ``url``'s origin — an idle one when ``reuse`` and there is one, whether it
        was reused)."""
        key = _key(url)
        with self._lock:
            idle = self._idle.get(key)
            if idle and reuse:
                return idle.pop(), True
        scheme, host, port = key
        proxy = self.proxy_for(url)
        if scheme == "https":
            if self._ssl is None:
                self._ssl = tls_context()
            if proxy is None:
                return http.client.HTTPSConnection(host, port, timeout=self.connect_timeout_s, context=self._ssl), False
            # TCP to the proxy, CONNECT host:port, then TLS with the target's name (end to end)
            conn = http.client.HTTPSConnection(proxy.host, proxy.port, timeout=self.connect_timeout_s,
                                               context=self._ssl)
            conn.set_tunnel(host, port, headers=self._proxy_headers(proxy))
            return conn, False
        if scheme != "http":
            raise HubError(f"cannot download from {scheme!r} URL", hint="HF_ENDPOINT and the CDN must be http(s)")
        if proxy is not None:  # the request goes to the proxy in absolute form (request_line)
            return http.client.HTTPConnection(proxy.host, proxy.port, timeout=self.connect_timeout_s), False
        return http.client.HTTPConnection(host, port, timeout=self.connect_timeout_s), False

    @staticmethod
    def _proxy_headers(proxy: Proxy) -> dict[str, str]:
        return {"proxy-authorization": proxy.authorization} if proxy.authorization else {}

    def request_line(self, url: str) -> tuple[str, dict[str, str]]:
        """(request target, extra headers) for a GET of ``url``: absolute form and the proxy's
        credentials for an ``http://`` target through a proxy, else origin form (a tunnel's CONNECT
        carried the credentials)."""
        proxy = self.proxy_for(url)
        if proxy is not None and urlsplit(url).scheme.lower() == "http":
            parts = urlsplit(url)
            return f"http://{parts.netloc.rpartition('@')[2]}{_target(url)}", self._proxy_headers(proxy)
        return _target(url), {}

    def give_back(self, url: str, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed:
                self._idle.setdefault(_key(url), []).append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for c in conns:
            c.close()


@dataclass
class Opened:
    """A GET whose status line and headers are in; ``answer`` is what the checks read."""

    conn: http.client.HTTPConnection
    resp: http.client.HTTPResponse
    url: str
    answer: httpx.Response  # status, headers, url — no body (the checks read headers only)
    sock: socket.socket | None


def _connect(conn: http.client.HTTPConnection, pool: ConnectionPool, url: str, what: str) -> None:
    try:
        conn.connect()
    except OSError as exc:  # refused, timed out, or the proxy refused the CONNECT ("Tunnel connection failed")
        conn.close()
        proxy = pool.proxy_for(url)
        if proxy is not None and is_proxy_auth_failure(exc):
            raise proxy_refused(proxy, what) from exc
        raise transport_error(what, exc, connecting=True, proxy=proxy, url=url) from exc
    if conn.sock is not None:
        conn.sock.settimeout(pool.read_timeout_s)  # the connect timeout was for connecting only


def _send(pool: ConnectionPool, url: str, headers: dict[str, str], what: str,
          on_socket: Callable[[socket.socket | None], None]) -> tuple[http.client.HTTPConnection,
                                                                       http.client.HTTPResponse]:
    for fresh in (False, True):
        conn, reused = pool.take(url, reuse=not fresh)
        if conn.sock is None:
            _connect(conn, pool, url, what)
        on_socket(conn.sock)
        target, proxy_headers = pool.request_line(url)
        try:
            conn.request("GET", target, headers={"user-agent": pool.user_agent, **headers, **proxy_headers})
            return conn, conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            # A kept-alive connection the server has since closed: one try on a new connection, as
            # httpcore does (another idle one may be just as stale: a proxy that closes after each answer).
            if reused and isinstance(exc, (http.client.RemoteDisconnected, ConnectionError)):
                continue
            raise transport_error(what, exc, proxy=pool.proxy_for(url)) from exc
    raise AssertionError("unreachable")  # pragma: no cover


def open_get(pool: ConnectionPool, url: str, headers_for: Callable[[str], dict[str, str]], what: str,
             on_socket: Callable[[socket.socket | None], None] = lambda _s: None) -> Opened:
    """GET ``url`` (blocking), following redirects; headers are recomputed per hop by ``headers_for``
    so a credential never follows a redirect to another origin. ``on_socket`` is told each socket
    used (for cancellation)."""
    for _hop in range(MAX_REDIRECTS + 1):
        conn, resp = _send(pool, url, headers_for(url), what, on_socket)
        location = resp.getheader("location")
        if resp.status in _REDIRECTS and location:
            try:
                resp.read(64 * 1024)  # a redirect's body is a line of text; drain it to reuse the connection
            except (OSError, http.client.HTTPException):
                conn.close()
            finish(pool, url, conn, resp)
            url = urljoin(url, location)
            continue
        answer = httpx.Response(resp.status, headers=resp.getheaders(), request=httpx.Request("GET", url))
        return Opened(conn, resp, url, answer, conn.sock)
    raise HubError(f"{what}: more than {MAX_REDIRECTS} redirects",
                   hint="check HF_ENDPOINT points at a Hugging Face Hub (or a faithful mirror)")


def read_some(resp: http.client.HTTPResponse, view: memoryview) -> int:
    """Body bytes into ``view``: what has arrived, after at most one ``recv`` (0 at the body's end).

    ``HTTPResponse.readinto`` waits until ``view`` is full, so on a slow link a 1 MiB buffer held
    its bytes for seconds — received but not written, so no checkpoint could claim them and a
    kill -9 lost them. ``readinto1`` of the response's own buffered reader returns at once with what
    is there, into the same memory (no copy); the body's remaining length is kept as ``readinto``
    keeps it, and the response closed at the end the way ``readinto`` closes it (the connection
    stays reusable). Chunked or close-delimited bodies keep ``http.client``'s own reader."""
    fp = resp.fp
    if fp is None or resp.chunked or resp.length is None:
        return resp.readinto(view)
    if len(view) > resp.length:
        view = view[:resp.length]
    n = fp.readinto1(view) if view else 0
    resp.length -= n
    if not resp.length or (not n and view):
        resp.close()  # like http.client at the body's end: fp dropped, the socket kept for reuse
    return n


def finish(pool: ConnectionPool, url: str, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
    """Give a connection back when its answer was read to the end and may be reused, else close it."""
    if resp.isclosed() and not resp.will_close and conn.sock is not None:
        pool.give_back(url, conn)
    else:
        conn.close()


class BufferPool:
    """A fixed set of reusable receive buffers: the bound on bytes received but not yet written."""

    def __init__(self, count: int, size_bytes: int) -> None:
        self.size_bytes = size_bytes
        self._free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        for _ in range(max(2, count)):
            self._free.put(bytearray(size_bytes))

    def take(self, stop: Callable[[], bool]) -> bytearray | None:
        """A free buffer, or None once ``stop()`` says to give up waiting."""
        while True:
            try:
                return self._free.get(timeout=0.05)
            except queue.Empty:
                if stop():
                    return None

    def put(self, buf: bytearray) -> None:
        self._free.put(buf)

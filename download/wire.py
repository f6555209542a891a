"""One GET on a blocking socket in a worker thread: the body read straight into reused buffers.

Why: on one stream the event loop was the bound (scripts/bench-download, issue 11: ~1.5 s of loop
CPU per GiB in httpx/httpcore/h11 — each body byte copied by the asyncio transport, by h11's
receive buffer and again into a ``Data`` event — against curl's 1.3 s for everything). Here a
``Content-Length`` body goes ``recv_into`` → a pooled 1 MiB buffer → ``pwrite`` + sha256 in the
write-behind thread, with no copy in Python; ``http.client`` only parses the status line and headers
(chunked or close-delimited bodies are read by it too, with its own copies: they do not occur for
ranged Hub/CDN answers). HEADs and Hub metadata calls stay on httpx.

Kept from the httpx path: redirects followed (at most 20, like httpx), the Authorization header only
to the endpoint's origin on every hop (``HubSession.headers_for``), the connect and read timeouts,
keep-alive connections reused between blocks, the same certificate store (``httpx.create_ssl_context``,
certifi), and transport failures as :class:`Retryable` named like httpx's (``ConnectError``,
``ReadTimeout``, ``ReadError``, ``RemoteProtocolError``) for the ``download.retry`` events.
"""

from __future__ import annotations

import http.client
import queue
import socket
import ssl
import threading
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urljoin, urlsplit

from core.errors import HubError
from core.lazy_import import lazy_module
from download.hub_errors import Retryable

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


def transport_error(what: str, exc: BaseException, *, connecting: bool = False) -> Retryable:
    """A socket or protocol failure as a Retryable whose text names it the way httpx did."""
    if connecting:
        name = "ConnectTimeout" if isinstance(exc, TimeoutError) else "ConnectError"
    elif isinstance(exc, TimeoutError):
        name = "ReadTimeout"
    elif isinstance(exc, http.client.HTTPException):
        name = "RemoteProtocolError"
    else:
        name = "ReadError"
    return Retryable(f"{what}: {name}: {exc.__class__.__name__}: {exc}")


class ConnectionPool:
    """Idle keep-alive ``http.client`` connections per (scheme, host, port); thread-safe."""

    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float, user_agent: str) -> None:
        self.connect_timeout_s, self.read_timeout_s, self.user_agent = connect_timeout_s, read_timeout_s, user_agent
        self._idle: dict[_Key, list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    def take(self, url: str) -> tuple[http.client.HTTPConnection, bool]:
        """(a connection to ``url``'s origin, whether it was reused)."""
        key = _key(url)
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                return idle.pop(), True
        scheme, host, port = key
        if scheme == "https":
            if self._ssl is None:
                # the store httpx verifies the HEADs with (certifi)
                make = getattr(httpx, "create_ssl_context", None)
                self._ssl = make() if make is not None else ssl.create_default_context()
            return http.client.HTTPSConnection(host, port, timeout=self.connect_timeout_s, context=self._ssl), False
        if scheme != "http":
            raise HubError(f"cannot download from {scheme!r} URL", hint="HF_ENDPOINT and the CDN must be http(s)")
        return http.client.HTTPConnection(host, port, timeout=self.connect_timeout_s), False

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


def _connect(conn: http.client.HTTPConnection, pool: ConnectionPool, what: str) -> None:
    try:
        conn.connect()
    except OSError as exc:
        conn.close()
        raise transport_error(what, exc, connecting=True) from exc
    if conn.sock is not None:
        conn.sock.settimeout(pool.read_timeout_s)  # the connect timeout was for connecting only


def _send(pool: ConnectionPool, url: str, headers: dict[str, str], what: str,
          on_socket: Callable[[socket.socket | None], None]) -> tuple[http.client.HTTPConnection,
                                                                       http.client.HTTPResponse]:
    for _try in range(2):
        conn, reused = pool.take(url)
        if conn.sock is None:
            _connect(conn, pool, what)
        on_socket(conn.sock)
        try:
            conn.request("GET", _target(url), headers={"user-agent": pool.user_agent, **headers})
            return conn, conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            # A kept-alive connection the server has since closed: one fresh try, as httpcore does.
            if reused and isinstance(exc, (http.client.RemoteDisconnected, ConnectionError)):
                continue
            raise transport_error(what, exc) from exc
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

"""Proxies from the environment: ``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY``, ``NO_PROXY`` (either case).

One reading for every request hotfit makes, with the rules of httpx — the library ``huggingface_hub``
runs hotfit's metadata calls on, with ``trust_env`` — so a HEAD, a ranged GET, a CDN redirect and a
``model_info`` call in the same process always agree (docs/network.md):

- a lowercase variable wins over its uppercase twin; an empty one means "none";
- an ``http://`` target uses ``HTTP_PROXY``, an ``https://`` one ``HTTPS_PROXY``, either falls back
  to ``ALL_PROXY``; ``http://`` targets go to the proxy in absolute form, ``https://`` through ``CONNECT``;
- ``NO_PROXY``: comma-separated; ``*`` bypasses every proxy; ``example.com`` matches that host and its
  subdomains, ``.example.com`` subdomains only; IP addresses and ``localhost`` match exactly; an
  entry with ``scheme://`` matches that scheme (and port, if given). Loopback is *not* bypassed by
  default (httpx and curl neither);
- a value without ``scheme://`` is ``http://``; a missing port is the scheme's (80), as httpx has it.

Only ``http://`` proxies are spoken to (TLS to a target always runs through a ``CONNECT`` tunnel);
anything that is not a usable proxy URL is a :class:`UsageError` (exit 2) naming the variable —
before a request, never minutes of retries.
"""

from __future__ import annotations

import base64
import ipaddress
import re
from dataclasses import dataclass, field
from typing import Mapping
from urllib.parse import unquote, urlsplit

from hotfit.core.errors import TransferError, UsageError
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class Proxy:
    """One proxy as a connection needs it; ``url`` carries no credentials (it may be logged)."""

    variable: str  # the environment variable it came from, as spelled there
    url: str  # http://host:port
    host: str
    port: int
    # Proxy-Authorization from user:password@, and the URL httpx is given (it sends them itself):
    # never in a repr, a message or the log.
    authorization: str | None = field(default=None, repr=False)
    httpx_url: str = field(default="", repr=False)

    @property
    def named(self) -> str:
        """How messages name it: ``http://proxy:3128 (HTTPS_PROXY)``."""
        return f"{self.url} ({self.variable})"


@dataclass(frozen=True)
class _Bypass:
    scheme: str | None  # None: any
    host: str  # lowercase, no brackets
    port: int | None
    suffix: str | None  # "any" (host and subdomains), "sub" (subdomains only), None (exact)

    def matches(self, scheme: str, host: str, port: int) -> bool:
        if self.scheme is not None and scheme != self.scheme:
            return False
        if self.port is not None and port != self.port:
            return False
        if self.suffix == "sub":
            return host.endswith("." + self.host)
        if self.suffix == "any":
            return host == self.host or host.endswith("." + self.host)
        return host == self.host


@dataclass(frozen=True)
class ProxyConfig:
    """The proxies of one environment; :meth:`for_url` is the one routing decision."""

    http: Proxy | None = None
    https: Proxy | None = None
    all: Proxy | None = None
    bypass_all: bool = False
    bypass: tuple[_Bypass, ...] = ()

    def for_url(self, url: str) -> Proxy | None:
        """The proxy a request to ``url`` goes through, or None (direct)."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        proxy = (self.http if scheme == "http" else self.https if scheme == "https" else None) or self.all
        if proxy is None or self.bypass_all:
            return None
        host = (parts.hostname or "").lower()
        port = parts.port or _DEFAULT_PORTS.get(scheme, 0)
        if any(b.matches(scheme, host, port) for b in self.bypass):
            return None
        return proxy


def proxy_refused(proxy: Proxy, what: str) -> TransferError:
    """The proxy asked for credentials (HTTP 407), or others than it was given: not worth a retry."""
    given = "were refused" if proxy.authorization else "are required"
    return TransferError(f"{what}: proxy {proxy.named} answered 407 Proxy Authentication Required "
                         f"(credentials {given})",
                         hint=f"put the proxy's user:password@ in {proxy.variable} "
                              f"(http://USER:PASSWORD@HOST:PORT, percent-encoded), or bypass it with NO_PROXY",
                         proxy=proxy.url, variable=proxy.variable)


def is_proxy_auth_failure(exc: BaseException) -> bool:
    """A refused CONNECT that said 407 (httpx's ProxyError "407 Proxy Authentication Required",
    http.client's "Tunnel connection failed: 407 ...")."""
    return re.search(r"(^|: )407\b", str(exc)) is not None


def _pick(env: Mapping[str, str], name: str) -> tuple[str, str] | None:
    """(variable as spelled, value) — lowercase first, like urllib and curl; empty means unset."""
    for spelled in (name.lower(), name):
        if spelled in env:
            value = env[spelled].strip()
            return (spelled, value) if value else None
    return None


def _bad(variable: str, value: str, why: str) -> UsageError:
    shown = _redacted(value)
    return UsageError(f"{variable}={shown!r} is not a usable proxy URL: {why}",
                      hint=f"set {variable} to http://HOST:PORT (user:password@ allowed), or unset it",
                      variable=variable, value=shown)


def _redacted(value: str) -> str:
    """A proxy value as messages may show it: any password replaced (the rest is what the operator wrote)."""
    scheme, sep, rest = value.partition("://")
    if not sep:
        scheme, rest = "", value
    userinfo, at, hostpart = rest.rpartition("@")
    if not at:
        return value
    user = userinfo.split(":", 1)[0]
    return f"{scheme}{sep}{user}:***@{hostpart}"


def parse_proxy(variable: str, value: str) -> Proxy:
    """One proxy variable's value, or a UsageError naming it."""
    raw = value if "://" in value else f"http://{value}"
    try:
        parts = urlsplit(raw)
        port = parts.port
    except ValueError as exc:  # "http://[::1", "http://h:99999", "http://h:x"
        raise _bad(variable, value, str(exc)) from None
    scheme = parts.scheme.lower()
    if scheme != "http":
        raise _bad(variable, value, f"{scheme}:// proxies are not supported (hotfit speaks to a proxy over "
                                    "plain http://; https targets still run TLS end to end through CONNECT)")
    if not parts.hostname:
        raise _bad(variable, value, "no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise _bad(variable, value, "a proxy URL has no path or query")
    host = parts.hostname
    port = port or _DEFAULT_PORTS["http"]
    shown_host = f"[{host}]" if ":" in host else host
    authorization = None
    if parts.username is not None:
        pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        authorization = "Basic " + base64.b64encode(pair.encode()).decode("ascii")
    return Proxy(variable=variable, url=f"http://{shown_host}:{port}", host=host, port=port,
                 authorization=authorization, httpx_url=raw)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def parse_no_proxy(variable: str, value: str) -> tuple[bool, tuple[_Bypass, ...]]:
    """(bypass everything, the entries) of a NO_PROXY value — httpx's reading of it."""
    out: list[_Bypass] = []
    for item in (p.strip() for p in value.split(",")):
        if not item:
            continue
        if item == "*":
            return True, ()
        if "://" in item:
            try:
                parts = urlsplit(item)
                port = parts.port
            except ValueError as exc:
                raise UsageError(f"{variable}: entry {item!r} is not a host or URL: {exc}",
                                 hint=f"list host names, IP addresses or scheme://host entries in {variable}",
                                 variable=variable, value=value) from None
            host = (parts.hostname or "").lower()
            suffix = None
            if host.startswith("*."):
                host, suffix = host[2:], "sub"
            elif host.startswith("*"):
                host, suffix = host[1:], "any"
            out.append(_Bypass(parts.scheme.lower() if parts.scheme.lower() != "all" else None, host, port, suffix))
            continue
        bare = item.split("/", 1)[0]  # httpx keeps only the address of "10.0.0.0/8" (no CIDR matching)
        if _is_ip(bare.strip("[]")):
            out.append(_Bypass(None, bare.strip("[]").lower(), None, None))
        elif item.lower() == "localhost":
            out.append(_Bypass(None, "localhost", None, None))
        else:
            host, _, port_text = item.lower().partition(":")
            port = int(port_text) if port_text.isdigit() else None
            if host.startswith("*"):
                host = host[1:]
            if host.startswith("."):
                out.append(_Bypass(None, host[1:], port, "sub"))
            else:
                out.append(_Bypass(None, host, port, "any"))
    return False, tuple(out)


def proxy_config(env: Mapping[str, str]) -> ProxyConfig:
    """The proxies ``env`` sets (see the module docstring), or a UsageError naming the variable."""
    proxies: dict[str, Proxy | None] = {}
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        found = _pick(env, name)
        proxies[name] = parse_proxy(*found) if found else None
    no = _pick(env, "NO_PROXY")
    bypass_all, bypass = parse_no_proxy(*no) if no else (False, ())
    return ProxyConfig(http=proxies["HTTP_PROXY"], https=proxies["HTTPS_PROXY"], all=proxies["ALL_PROXY"],
                       bypass_all=bypass_all, bypass=bypass)

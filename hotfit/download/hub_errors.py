"""The one mapping from what a Hub (or something posing as one) answered to hotfit's errors.

Two kinds of answers reach it: raw ``httpx`` responses from the engine's own HEAD/GET
(:func:`hub_error_from_response`, hf-protocol.md §3.1) and ``huggingface_hub`` exceptions from its
metadata calls — the snapshot listing and ``registry lock``'s ``model_info``
(:func:`hub_error_from_hf_exception`). Both give the same words for the same cause: gated, repository
or revision missing, not a Hub at all, unreachable. What is worth another attempt is
:class:`Retryable` (the retry policy in ``download.retry`` decides how often).
"""

from __future__ import annotations

import ssl
import time
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from hotfit.core.errors import CertificateError, HubError, HubUnreachable, TransferError
from hotfit.core.lazy_import import lazy_module
from hotfit.download.proxy import Proxy, proxy_refused

if TYPE_CHECKING:  # the type checker reads the real module; at run time it loads on first use
    import httpx
else:
    httpx = lazy_module("httpx")  # third-party, imported on first use (core.lazy_import says why)

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
NOT_A_HUB = "HF_ENDPOINT does not answer like a Hugging Face Hub"


class Retryable(Exception):
    """A failure worth another attempt; ``retry_after_s`` from the server when it said so; ``proxy``
    when the connection went through one (the final error then points at it)."""

    def __init__(self, message: str, retry_after_s: float | None = None, *, proxy: Proxy | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.proxy = proxy


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or HTTP date)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


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


def not_a_hub_error(endpoint: str, url: str, answered: str) -> HubError:
    """The endpoint is some other web server (a mistyped HF_ENDPOINT, a proxy's landing page, a plain
    file server): its answer says nothing about the registry, so the registry is not blamed."""
    return HubError(
        f"{NOT_A_HUB}: {redact_url(url)} {answered}",
        hint=f"HF_ENDPOINT is {redact_url(endpoint)}; point it at the Hub (https://huggingface.co, or unset it) "
             "or at a mirror that speaks the Hub's protocol (X-Repo-Commit on resolve answers, X-Error-Code "
             "on errors), then rerun",
        endpoint=redact_url(endpoint), url=redact_url(url), hub_code=None)


def is_not_a_hub(err: BaseException) -> bool:
    return isinstance(err, HubError) and err.what.startswith(NOT_A_HUB)


def speaks_hub(headers: httpx.Headers) -> bool:
    """The real Hub puts X-Error-Code on every 404 and X-Repo-Commit on every resolve answer
    (hf-protocol.md §3): a 404 carrying neither did not come from a Hub."""
    return bool(headers.get("x-error-code") or headers.get("x-repo-commit"))


def answer_text(status: int, content_type: str | None) -> str:
    kind = (content_type or "").split(";")[0].strip()
    return f"answered HTTP {status}" + (f" ({kind})" if kind else "")


def _gated(name: str, what: str, **details: object) -> HubError:
    repo = name
    return HubError(f"{repo} is gated: access to {what} requires accepting its licence",
                    hint=f"accept the licence at https://huggingface.co/{repo} with your account, then set HF_TOKEN "
                         "(or run `hf auth login`) on this machine and rerun", **details)


def _repo_missing(name: str, **details: object) -> HubError:
    return HubError(f"repository {name} not found (or private)",
                    hint="check the registry entry's repo; for a private repo set HF_TOKEN", **details)


def _revision_missing(name: str, rev: str | None, **details: object) -> HubError:
    return HubError(f"revision {rev} not found in {name}",
                    hint="the pinned commit no longer exists; re-pin the entry (hotfit registry lock)", **details)


def hub_error_from_response(resp: httpx.Response, *, repo: str, revision: str, path: str | None,
                            endpoint: str | None = None) -> Exception:
    """Map an error response to a typed error (hf-protocol.md §3.1), or a :class:`Retryable`.

    ``endpoint``: the response came from HF_ENDPOINT itself (not a CDN), so an answer without the
    Hub's headers means the endpoint is not a Hub."""
    status = resp.status_code
    code = resp.headers.get("x-error-code", "")
    message = resp.headers.get("x-error-message", "")
    target = f"{repo}@{revision[:12]}" + (f" {path}" if path else "")
    if endpoint is not None and status == 404 and not speaks_hub(resp.headers):
        return not_a_hub_error(endpoint, str(resp.request.url),
                               answer_text(status, resp.headers.get("content-type")) + " without the Hub's "
                               "X-Error-Code")
    if status in RETRYABLE_STATUS:
        return Retryable(f"HTTP {status} for {target}" + (f": {message}" if message else ""),
                         parse_retry_after(resp.headers.get("retry-after")))
    details = {"repo": repo, "revision": revision, "file": path, "status": status, "hub_code": code or None}
    if code == "GatedRepo" or (status in (401, 403) and "gated" in message.lower()):
        return _gated(repo, path or "it", **details)
    if code == "RepoNotFound" or (status == 401 and not code):
        return _repo_missing(repo, **details)
    if code == "RevisionNotFound":
        return _revision_missing(repo, revision, **details)
    if code == "EntryNotFound" or status == 404:
        return HubError(f"{path or 'file'} not found in {repo} at {revision[:12]}",
                        hint="the file was renamed or removed at that revision; fix the registry entry",
                        **details)
    return HubError(f"Hub answered HTTP {status} for {target}" + (f": {message}" if message else ""),
                    hint="check HF_ENDPOINT and the network, then rerun", **details)


def hf_exception_not_a_hub(exc: BaseException, endpoint: str, url: str) -> HubError | None:
    """For a ``huggingface_hub`` API call (model_info, list_repo_tree): the not-a-Hub error when the
    failure shows the endpoint is no Hub — a 404 without X-Error-Code, or a body that is not JSON."""
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(exc, HfHubHTTPError):
        resp = getattr(exc, "response", None)
        if resp is not None and resp.status_code == 404 and not speaks_hub(resp.headers):
            return not_a_hub_error(endpoint, str(resp.url), answer_text(404, resp.headers.get("content-type"))
                                   + " without the Hub's X-Error-Code")
        return None
    if isinstance(exc, ValueError):  # json.JSONDecodeError: an HTML page where the API answers JSON
        return not_a_hub_error(endpoint, url, "answered with a body that is not the Hub API's JSON")
    return None


def certificate_failure(exc: BaseException | None) -> ssl.SSLCertVerificationError | None:
    """The TLS certificate verification error under ``exc`` (httpx and huggingface_hub wrap it as a
    ConnectError; ``http.client`` raises it as it is), or None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, ssl.SSLCertVerificationError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def certificate_error(failure: ssl.SSLCertVerificationError, url: str, *, proxy: Proxy | None = None) -> CertificateError:
    """What a failed certificate verification is and what to do, by the verifier's reason: a clock
    (not yet valid, expired), a trust store (self-signed, unknown issuer: a private mirror or a
    TLS-inspecting proxy), or a name. Not retried: retrying changes none of them (docs/network.md)."""
    reason = failure.verify_message or failure.reason or str(failure)
    host = urlsplit(url).netloc or url
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    lowered = reason.lower()
    if "not yet valid" in lowered or "expired" in lowered:
        hint = (f"this machine's clock reads {now} UTC: if that is wrong, set it (timedatectl set-ntp true, or "
                "chronyc makestep) and rerun; if it is right, the server's certificate is out of date: tell "
                "whoever runs it")
    elif "self-signed" in lowered or "issuer" in lowered or "untrusted" in lowered:
        via = f" or of the proxy {proxy.named} if it inspects TLS" if proxy is not None else \
            " (or of a TLS-inspecting proxy)"
        hint = (f"the certificate is not signed by an authority this machine trusts: point SSL_CERT_FILE (or "
                f"SSL_CERT_DIR) at the CA bundle of {host}{via}, or install it in the system trust store, "
                "and rerun")
    elif "hostname" in lowered or "ip address mismatch" in lowered:
        hint = f"the certificate does not name {host}: set HF_ENDPOINT to the host name the certificate names"
    else:
        hint = "fix the certificate (or the trust store: SSL_CERT_FILE / SSL_CERT_DIR) and rerun"
    return CertificateError(
        f"the TLS certificate of {host} failed verification: {reason} (not retried: retrying cannot fix a "
        "certificate)", hint=hint, url=redact_url(url), host=host, reason=reason,
        verify_code=failure.verify_code)


def _is_transport_error(exc: BaseException) -> bool:
    # connection refused, DNS, TLS, timeouts: OSError, or httpx transport errors (not OSError subclasses)
    return isinstance(exc, (OSError, httpx.TransportError)) or (
        type(exc).__module__.startswith(("httpx", "httpcore")) and "Error" in type(exc).__name__)


def hub_error_from_hf_exception(exc: BaseException, *, repo: str, revision: str | None, endpoint: str,
                                url: str, proxy: Proxy | None = None) -> TransferError | None:
    """The typed error for a failed ``huggingface_hub`` metadata call, or None for an exception that is
    no Hub answer at all (a bug: the caller re-raises it). ``proxy``: the one the call went through
    (named when it could not be reached)."""
    from huggingface_hub import errors as hf

    response = getattr(exc, "response", None)
    if proxy is not None and getattr(response, "status_code", None) == 407:
        refused = proxy_refused(proxy, f"{repo}@{revision or 'main'}")
        return HubError(refused.what, hint=refused.hint, repo=repo, revision=revision, **refused.details)
    not_a_hub = hf_exception_not_a_hub(exc, endpoint, url)
    if not_a_hub is not None:
        return not_a_hub
    details = {"repo": repo, "revision": revision}
    failure = certificate_failure(exc)
    if failure is not None:
        cert = certificate_error(failure, url, proxy=proxy)
        cert.details.update(details)
        return cert
    if isinstance(exc, hf.OfflineModeIsEnabled):
        return HubError(f"HF_HUB_OFFLINE is set and {repo} is not on disk",
                        hint="unset HF_HUB_OFFLINE (or set it to 0) to download, or copy the files in", **details)
    if isinstance(exc, hf.GatedRepoError):  # a RepositoryNotFoundError subclass: first
        return _gated(repo, "its files", **details)
    if isinstance(exc, hf.RevisionNotFoundError):
        return _revision_missing(repo, revision, **details)
    if isinstance(exc, hf.RepositoryNotFoundError):
        return _repo_missing(repo, **details)
    if isinstance(exc, hf.HfHubHTTPError):
        # a 5xx/429 still there after the retries passes by itself: exit 11, not 4 (core.errors)
        status = getattr(getattr(exc, "response", None), "status_code", None)
        return (HubUnreachable if status in RETRYABLE_STATUS else HubError)(
            f"the Hub answered an error for {repo}@{revision or 'main'}: {exc}",
            hint="check HF_ENDPOINT and the network, then rerun", **details)
    if _is_transport_error(exc):
        if proxy is not None:
            return HubUnreachable(f"cannot reach the Hub for {repo} through proxy {proxy.named}: {exc}",
                                  hint=f"check the proxy ({proxy.variable}, NO_PROXY), the network and "
                                       "HF_ENDPOINT, then rerun", proxy=proxy.url, variable=proxy.variable,
                                  **details)
        return HubUnreachable(f"cannot reach the Hub for {repo}: {exc}",
                              hint="check the network / HF_ENDPOINT and rerun", **details)
    return None


def is_retryable_hf_exception(exc: BaseException) -> bool:
    """A ``huggingface_hub`` metadata call worth another attempt: a 408/429/5xx answer or a transport
    error; never a missing repository, revision or file."""
    from huggingface_hub import errors as hf

    if certificate_failure(exc) is not None:  # permanent: the clock, the trust store or the name
        return False
    if isinstance(exc, hf.HfHubHTTPError) and not isinstance(exc, (hf.RepositoryNotFoundError,
                                                                   hf.RevisionNotFoundError,
                                                                   hf.EntryNotFoundError)):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        return status in RETRYABLE_STATUS
    return type(exc).__module__.startswith(("httpx", "httpx2")) and "Error" in type(exc).__name__

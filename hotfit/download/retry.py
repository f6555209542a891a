"""The one retry policy: every HEAD, ranged GET and Hub metadata call retries the same way.

Progress is bytes: an attempt that left at least ``min_progress_bytes`` more on disk than there were
at the last progress (an attempt cut after a stretch of bytes, or several short ones together) made
progress. Progress resets the backoff — the next attempt goes at once, since the link was working
(a link cut every few MiB on one connection keeps close to its speed) — and restarts the bounds:

- ``max_attempts_without_progress`` attempts in a row without progress give up;
- so does ``max_total_retry_s`` spent failing without progress (new progress pushes the deadline
  out again: a cut hours into a long download is retried like one in its first minute).

Between attempts without progress the wait grows exponentially (with jitter) from
``backoff_initial_s`` to ``backoff_max_s``; ``Retry-After`` is honoured on 429/503 (capped; beyond
the cap it is a "give up"). A server that sends a trickle per connection (1 byte, then a close)
makes no progress and is given up on after those attempts, with exit 11 (a passing fault, not a
bad file: core.errors) naming the bound and the
last failure. Every wait is announced as a ``download.retry`` event (attempt, attempts without
progress, cause, wait_s, the URL without credentials or signed query), so an unreachable mirror is
never minutes of silence.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import anyio
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    retry_if_exception_type,
)

from hotfit.core.errors import TransferError, TransientTransferError
from hotfit.core.lazy_import import lazy_module
from hotfit.core.log import get_logger
from hotfit.download.hub import HubSession, RemoteFile, StaticPins
from hotfit.download.hub_errors import Retryable, is_retryable_hf_exception, redact_url
from hotfit.download.options import TransferOptions

if TYPE_CHECKING:  # the type checker reads the real module; at run time it loads on first use
    import httpx
else:
    httpx = lazy_module("httpx")  # third-party, imported on first use (core.lazy_import says why)

log = get_logger()
T = TypeVar("T")


class StopPolicy:
    """The stop half of the policy (see the module docstring), and the count of attempts without
    progress the wait half reads. Called by tenacity once per failed attempt, before the wait."""

    def __init__(self, options: TransferOptions, progress_fn: Callable[[], int], deadline: float) -> None:
        self._max = options.max_attempts_without_progress
        self._window_s = options.max_total_retry_s
        self._min_bytes = max(1, options.min_progress_bytes)
        # a retry loop that starts late (a block handed out an hour in) still gets its own window
        self._deadline = max(deadline, time.monotonic() + self._window_s)
        self._cap = options.retry_after_cap_s
        self._progress_fn = progress_fn
        self._mark = progress_fn()  # bytes on disk at the last progress
        self._observed = 0  # the attempt number last counted
        self.without_progress = 0  # failed attempts since the last progress (0: the last one made some)
        self.reason: str | None = None  # why it stopped, for the error

    def observe(self, state: RetryCallState) -> None:
        """Count a failed attempt once, whichever of the wait and the stop tenacity asks first."""
        if state.attempt_number == self._observed:
            return
        self._observed = state.attempt_number
        done = self._progress_fn()
        if done - self._mark >= self._min_bytes:
            self.without_progress, self._mark = 0, done
            self._deadline = max(self._deadline, time.monotonic() + self._window_s)
        else:
            self.without_progress += 1

    def __call__(self, state: RetryCallState) -> bool:
        self.observe(state)
        exc = state.outcome.exception() if state.outcome else None
        retry_after = getattr(exc, "retry_after_s", None)
        if retry_after is not None and retry_after > self._cap:
            self.reason = f"the server asked to retry after {retry_after:g} s (more than {self._cap:g} s)"
        elif self.without_progress >= self._max:
            self.reason = (f"{self.without_progress} attempts in a row brought less than {self._min_bytes} "
                           "bytes")
        elif time.monotonic() >= self._deadline:
            self.reason = (f"less than {self._min_bytes} bytes arrived in {self._window_s:g} s of retrying")
        if self.reason is not None and exc is not None:
            # an attribute of our own on the library's exception, read by gave_up()
            exc.hotfit_gave_up = self.reason  # type: ignore[attr-defined]
        return self.reason is not None


def wait_policy(options: TransferOptions, stop: StopPolicy | None = None) -> Callable[[RetryCallState], float]:
    """Retry-After when the server gave one (capped); else none after an attempt that made progress,
    and ``backoff_initial_s × 2^(n-1)`` plus jitter (at most ``backoff_max_s``) after the n-th attempt
    in a row without (``stop`` counts them; without it every attempt counts)."""

    def wait(state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        retry_after = getattr(exc, "retry_after_s", None)
        if retry_after is not None:
            return min(retry_after, options.retry_after_cap_s)
        if stop is not None:
            stop.observe(state)
        n = stop.without_progress if stop is not None else state.attempt_number
        if n <= 0:
            return 0.0
        exp = options.backoff_initial_s * 2 ** min(n - 1, 32)
        return min(options.backoff_max_s, exp + random.uniform(0, options.backoff_initial_s))

    return wait


def _retry_cause(exc: BaseException | None) -> str:
    if exc is None:
        return "unknown"
    if isinstance(exc, Retryable):
        return str(exc)  # already says what failed ("HTTP 503 for …", "HEAD …: ConnectError: …")
    return f"{type(exc).__name__}: {exc}"


def log_retry(repo: str, path: str | None, url_fn: Callable[[], str]) -> Callable[[RetryCallState], None]:
    """A tenacity ``before_sleep`` hook: one ``download.retry`` event per wait, so retries are seen as
    they happen (``url_fn`` gives the URL the failed attempt used; it is logged redacted)."""

    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        wait_s = state.next_action.sleep if state.next_action is not None else 0.0
        log.warning("download.retry", repo=repo, file=path, attempt=state.attempt_number,
                    attempts_without_progress=getattr(state.retry_object.stop, "without_progress", None),
                    cause=_retry_cause(exc), wait_s=round(wait_s, 3), url=redact_url(url_fn()))

    return before_sleep


def retrying(options: TransferOptions, *, progress_fn: Callable[[], int] = lambda: 0,
             deadline: float | None = None, before_sleep: Callable[[RetryCallState], None],
             retry_on: Callable[[BaseException], bool] | None = None) -> AsyncRetrying:
    """The policy as a tenacity loop. Retried by default: :class:`Retryable` and httpx transport errors;
    ``retry_on`` replaces that test (a ``huggingface_hub`` call raises its own exception types)."""
    stop = StopPolicy(options, progress_fn, time.monotonic() + options.max_total_retry_s if deadline is None
                      else deadline)
    return AsyncRetrying(
        retry=retry_if_exception(retry_on) if retry_on else retry_if_exception_type((Retryable, httpx.TransportError)),
        stop=stop,
        wait=wait_policy(options, stop),
        before_sleep=before_sleep,
        reraise=True,
    )


def gave_up(repo: str, path: str | None, exc: BaseException, done_bytes: int) -> TransientTransferError:
    """Retries ran out on passing faults only (a permanent answer is never retried): exit 11, which a
    fleet's scheduler retries, not 4 (core.errors)."""
    why = getattr(exc, "hotfit_gave_up", None) or "repeated failures"
    proxy = getattr(exc, "proxy", None)  # the last attempt went through a proxy (download.proxy)
    check = (f"check the proxy {proxy.url} ({proxy.variable}; NO_PROXY bypasses it), the network and HF_ENDPOINT"
             if proxy is not None else "check the network / HF_ENDPOINT")
    extra = {"proxy": proxy.url, "variable": proxy.variable} if proxy is not None else {}
    return TransientTransferError(
        f"{repo}/{path}: gave up ({why}); the last failure: {exc}",
        hint=f"{check} and rerun the same command"
             + (f"; the {done_bytes} bytes already on disk are kept and resumed" if done_bytes else ""),
        repo=repo, file=path, done_bytes=done_bytes, gave_up=why, **extra)


async def head_retrying(session: HubSession, repo: str, revision: str, path: str, *,
                        expected_size: int | None = None, expected_sha256: str | None = None,
                        pinned: bool = False, deadline: float | None = None,
                        counters: dict[str, Any] | None = None,
                        done_bytes: Callable[[], int] = lambda: 0, static: StaticPins | None = None) -> RemoteFile:
    """``session.head`` (``pinned``: ``head_pinned``, checking commit and size) under the retry policy;
    exhausted retries end as TransferError (never an internal retryable error). ``counters["attempts"]``
    counts the attempts; ``done_bytes`` says what the error may promise is kept on disk."""
    url = session.resolve_url(repo, revision, path)
    try:
        async for attempt in retrying(session.options, deadline=deadline,
                                      before_sleep=log_retry(repo, path, lambda: url)):
            with attempt:
                if counters is not None:
                    counters["attempts"] += 1
                if pinned:
                    return await session.head_pinned(repo, revision, path, expected_size, expected_sha256, static)
                return await session.head(repo, revision, path)
    except (Retryable, httpx.TransportError) as exc:
        raise gave_up(repo, path, exc, done_bytes()) from exc
    raise AssertionError("unreachable")  # pragma: no cover


async def hub_call_retrying(fn: Callable[..., T], *args: Any, options: TransferOptions, repo: str,
                            url: str) -> T:
    """A blocking ``huggingface_hub`` metadata call (in a worker thread) under the same policy; it
    re-raises the last exception for the caller to map (``download.hub_errors``)."""
    async for attempt in retrying(options, before_sleep=log_retry(repo, None, lambda: url),
                                  retry_on=is_retryable_hf_exception):
        with attempt:
            result: T = await anyio.to_thread.run_sync(lambda: fn(*args))
            return result
    raise AssertionError("unreachable")  # pragma: no cover



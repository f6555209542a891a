"""The one retry policy: every HEAD, ranged GET and Hub metadata call retries the same way.

Exponential backoff with jitter, ``Retry-After`` honoured on 429/503 (capped; beyond the cap it is a
"give up"), the attempt counter reset whenever bytes arrived, and a bounded time spent failing (new
bytes restart it). Every wait is announced as a ``download.retry`` event (attempt, cause, wait_s, the
URL without credentials or signed query), so an unreachable mirror is never minutes of silence.
"""

from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

import anyio
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    retry_if_exception_type,
    wait_exponential_jitter,
)

from core.errors import TransferError
from core.lazy_import import lazy_module
from core.log import get_logger
from download.hub import HubSession, RemoteFile
from download.hub_errors import Retryable, is_retryable_hf_exception, redact_url
from download.options import TransferOptions

httpx = lazy_module("httpx")  # third-party, imported on first use (core.lazy_import says why)

log = get_logger()
T = TypeVar("T")


class StopPolicy:
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


def wait_policy(options: TransferOptions) -> Callable[[RetryCallState], float]:
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
                    cause=_retry_cause(exc), wait_s=round(wait_s, 3), url=redact_url(url_fn()))

    return before_sleep


def retrying(options: TransferOptions, *, progress_fn: Callable[[], int] = lambda: 0,
             deadline: float | None = None, before_sleep: Callable[[RetryCallState], None],
             retry_on: Callable[[BaseException], bool] | None = None) -> AsyncRetrying:
    """The policy as a tenacity loop. Retried by default: :class:`Retryable` and httpx transport errors;
    ``retry_on`` replaces that test (a ``huggingface_hub`` call raises its own exception types)."""
    return AsyncRetrying(
        retry=retry_if_exception(retry_on) if retry_on else retry_if_exception_type((Retryable, httpx.TransportError)),
        stop=StopPolicy(options, progress_fn, time.monotonic() + options.max_total_retry_s if deadline is None
                        else deadline),
        wait=wait_policy(options),
        before_sleep=before_sleep,
        reraise=True,
    )


def gave_up(repo: str, path: str | None, exc: BaseException, done_bytes: int) -> TransferError:
    proxy = getattr(exc, "proxy", None)  # the last attempt went through a proxy (download.proxy)
    check = (f"check the proxy {proxy.url} ({proxy.variable}; NO_PROXY bypasses it), the network and HF_ENDPOINT"
             if proxy is not None else "check the network / HF_ENDPOINT")
    extra = {"proxy": proxy.url, "variable": proxy.variable} if proxy is not None else {}
    return TransferError(
        f"{repo}/{path}: gave up after repeated failures: {exc}",
        hint=f"{check} and rerun the same command"
             + (f"; the {done_bytes} bytes already on disk are kept and resumed" if done_bytes else ""),
        repo=repo, file=path, done_bytes=done_bytes, **extra)


async def head_retrying(session: HubSession, repo: str, revision: str, path: str, *,
                        expected_size: int | None = None, pinned: bool = False, deadline: float | None = None,
                        counters: dict[str, Any] | None = None,
                        done_bytes: Callable[[], int] = lambda: 0) -> RemoteFile:
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
                    return await session.head_pinned(repo, revision, path, expected_size)
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



"""The one chat boundary between hotfit and a model server: :class:`ChatReply`, :class:`ChatFailed`
and, for the grade, :class:`ChatEndpoint`.

Every chat call hotfit makes answers with a :class:`ChatReply` or raises :class:`ChatFailed` — the
tool-call probe and the speed check (``Session.call_tools``, :mod:`backends.base`) as much as the
grade (``ChatEndpoint.chat``): one reply type, one failure type. They live here, in grading/, the
lowest layer that both the grade's runner and the backends reach (pyproject's import-linter layers).
Anything that answers OpenAI-style chat completions plugs into the grade (llama-server,
``hotfit serve``, a remote server, a scripted fake in the tests): the runner only ever calls
``chat``, ``reset`` and ``describe``. The httpx implementation lives in :mod:`backends.http_chat`
(it does I/O); this module is pure: the protocol, the records, and :func:`parse_chat_body`, which
turns a raw HTTP answer into a :class:`ChatReply` or a :class:`ChatFailed` (a *stack* failure: the
grade is inconclusive, the model is not blamed).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "HTTP_ERROR",
    "MALFORMED_BODY",
    "MAX_TOKENS_PER_STEP",
    "SAMPLING",
    "SLOT_ERASED",
    "SLOT_FRESH_PROMPT",
    "SLOT_UNSUPPORTED",
    "ChatEndpoint",
    "ChatFailed",
    "ChatReply",
    "ServerFacts",
    "parse_chat_body",
]

HTTP_ERROR = "http_error"
MALFORMED_BODY = "malformed_body"
SLOT_ERASED = "erased"
SLOT_FRESH_PROMPT = "fresh_prompt"  # no erase; the scenario's first request skips the prompt cache instead
SLOT_UNSUPPORTED = "unsupported"

# A call is 30-60 tokens; the cap is generous so a tight limit never truncates a call
# (club-3090#665), and fixed, so it is part of what grade_version pins.
MAX_TOKENS_PER_STEP = 512
# Greedy, neutral penalties, fixed seed (irrelevant under greedy, set anyway); only the string
# form of tool_choice (llama.cpp#26849); parallel calls must be asked for (llama.cpp
# docs/function-calling.md). top_k / min_p / repeat_penalty are llama-server extensions that
# OpenAI-compatible servers commonly accept.
SAMPLING: Mapping[str, Any] = {
    "temperature": 0,
    "top_k": 1,
    "top_p": 1,
    "min_p": 0,
    "repeat_penalty": 1,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "seed": 42,
    "stream": False,
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "max_tokens": MAX_TOKENS_PER_STEP,
}


class ChatFailed(Exception):
    """The call got no usable answer — the stack failed, not the model: ``cause`` (timeout,
    transport, server_exited, http_status, malformed_body, runtime_error, status, prose), ``what``
    happened, ``hint`` what to do, ``details`` for the record. Each caller turns it into its own
    outcome: the probe a ``ToolCallProbeFailed``, the speed check a ``BackendError``, the grade an
    inconclusive ``http_error`` or ``malformed_body`` (:func:`grading.runner.stack_outcome`)."""

    def __init__(self, cause: str, what: str, hint: str, **details: Any) -> None:
        super().__init__(what)
        self.cause = cause
        self.what = what
        self.hint = hint
        self.details = details


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class ChatReply:
    """One answered chat completion, as the caller judges it.

    ``body`` is the OpenAI chat-completions body with the tool calls parsed into
    ``choices[0].message.tool_calls`` (llama-server parses them; for OpenVINO the backend does,
    with the model family's parser). The figures are the server's own (None: it did not say) —
    its rates too, never derived here: llama-server leaves the first generated token out of its
    generation rate (it comes with the prompt), which tokens / ms would not;
    ``template``, ``supports_tools`` and ``facts`` are what a backend's session adds for the probe's
    record (which template formatted the prompt, what the server says of it, backend-specific fields)."""

    body: Mapping[str, Any]
    prompt_tokens: int | None = None
    generated_tokens: int | None = None
    prompt_ms: float | None = None
    generated_ms: float | None = None
    cache_n: int | None = None  # llama-server: prompt tokens taken from the slot's cache
    prompt_tokens_per_s: float | None = None
    generation_tokens_per_s: float | None = None
    template: str = ""  # named in a failed probe ("": the caller does not know, as over plain HTTP)
    supports_tools: bool | None = None  # what the server says of the template; None: it did not say
    facts: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of_body(cls, body: Mapping[str, Any], **known: Any) -> ChatReply:
        """The reply ``body`` is, with the figures its ``timings`` (llama-server) or ``usage``
        (OpenAI) give; ``known`` adds or overrides fields."""
        timings, usage = (value if isinstance(value, Mapping) else {}
                          for value in (body.get("timings"), body.get("usage")))
        figures: dict[str, Any] = {
            "prompt_tokens": _int(timings.get("prompt_n")) if "prompt_n" in timings
            else _int(usage.get("prompt_tokens")),
            "generated_tokens": (_int(timings.get("predicted_n")) if "predicted_n" in timings
                                 else _int(usage.get("completion_tokens"))),
            "prompt_ms": _float(timings.get("prompt_ms")),
            "generated_ms": _float(timings.get("predicted_ms")),
            "cache_n": _int(timings.get("cache_n")),
            "prompt_tokens_per_s": _float(timings.get("prompt_per_second")),
            "generation_tokens_per_s": _float(timings.get("predicted_per_second")),
        }
        return cls(body=body, **(figures | known))

    @property
    def choice(self) -> Mapping[str, Any]:
        """``choices[0]`` ({} when the body has none: the probe judges such an answer)."""
        choices = self.body.get("choices")
        first = choices[0] if isinstance(choices, list) and choices else None
        return first if isinstance(first, Mapping) else {}

    @property
    def message(self) -> Mapping[str, Any]:
        """The assistant message as received (role, content, reasoning_content, tool_calls)."""
        message = self.choice.get("message")
        return message if isinstance(message, Mapping) else {}

    @property
    def finish_reason(self) -> str | None:
        reason = self.choice.get("finish_reason")
        return reason if isinstance(reason, str) else None

    @property
    def content(self) -> str:
        value = self.message.get("content")
        return value if isinstance(value, str) else ""

    @property
    def reasoning(self) -> str:
        value = self.message.get("reasoning_content")
        return value if isinstance(value, str) else ""

    @property
    def tool_calls(self) -> list[Mapping[str, Any]]:
        return list(self.message.get("tool_calls") or [])



@dataclass(frozen=True)
class ServerFacts:
    """What the server says about itself (``/props``, ``/v1/models``); None = it did not say."""

    model: str | None = None
    model_path: str | None = None
    model_sha256: str | None = None
    chat_template_sha256: str | None = None
    chat_format: str | None = None
    supports_tools: bool | None = None
    build: str | None = None
    context_tokens: int | None = None
    slots: int | None = None
    raw: Mapping[str, Any] = field(default_factory=dict)


class ChatEndpoint(Protocol):
    async def chat(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]],
                   **sampling: Any) -> ChatReply:
        """One non-streamed chat completion; raises :class:`ChatFailed` for stack failures."""
        ...

    async def reset(self) -> str:
        """Make the next request start from an empty prompt cache: SLOT_ERASED (slot 0 erased),
        SLOT_FRESH_PROMPT (the next request will not reuse the cache) or SLOT_UNSUPPORTED."""
        ...

    async def describe(self) -> ServerFacts:
        """What the server reports about model, template and build (never raises)."""
        ...

    async def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> str | None:
        """The prompt the server's template makes of ``messages`` (None: it cannot say; never raises)."""
        ...


def parse_chat_body(status: int, body: bytes | str) -> ChatReply:
    """Pure: an HTTP answer to /v1/chat/completions → ChatReply, or raise ChatFailed.

    A 200 whose body is not a chat completion is a stack failure, never "no tool calls"
    (mlcommons/endpoints#346: that mistake silently costs score)."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    if status != 200:
        raise ChatFailed("http_status", f"HTTP {status}: {text[:300]}",
                         "the server refused the request; its log says why (the stack failed, not the model)",
                         status=status)

    def malformed(what: str) -> ChatFailed:
        return ChatFailed(MALFORMED_BODY, what, "the server's answer is not an OpenAI chat completion: check that the "
                          "URL names an OpenAI-compatible server (its base URL, with or without /v1)", status=status)

    try:
        data = json.loads(text)
    except ValueError:
        raise malformed(f"the body is not JSON: {text[:200]!r}") from None
    try:
        choice = data["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise malformed(f"no choices[0].message in {text[:200]!r}") from None
    if not isinstance(message, dict):
        raise malformed("choices[0].message is not an object")
    calls = message.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise malformed("message.tool_calls is not a list")
    for call in calls or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise malformed(f"a tool call without function.name: {call!r}"[:300])
    for key in ("content", "reasoning_content"):
        if message.get(key) is not None and not isinstance(message.get(key), str):
            raise malformed(f"message.{key} is not a string")
    return ChatReply.of_body(data)

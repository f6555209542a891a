"""The one boundary between the grade and a model server: :class:`ChatEndpoint`.

Anything that answers OpenAI-style chat completions plugs in (llama-server, ``hotfit serve``, a
remote server, a scripted fake in the tests): the runner only ever calls ``chat``, ``reset`` and
``describe``. The httpx implementation lives in :mod:`stages.grade` (it does I/O); this module
is pure: the protocol, the reply record, and :func:`parse_chat_body`, which turns a raw HTTP
answer into a :class:`ChatReply` or an :class:`EndpointFailure` (a *stack* failure: the grade
is inconclusive, the model is not blamed).
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
    "ChatReply",
    "EndpointFailure",
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


class EndpointFailure(Exception):
    """The server, not the model, failed: ``kind`` is HTTP_ERROR or MALFORMED_BODY."""

    def __init__(self, kind: str, detail: str, *, status: int | None = None) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail
        self.status = status


@dataclass(frozen=True)
class ChatReply:
    message: Mapping[str, Any]  # the assistant message as received (role, content, reasoning_content, tool_calls)
    finish_reason: str | None
    prompt_tokens: int | None = None
    generated_tokens: int | None = None
    prompt_ms: float | None = None
    generated_ms: float | None = None
    cache_n: int | None = None  # llama-server: prompt tokens taken from the slot's cache

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
        """One non-streamed chat completion; raises :class:`EndpointFailure` for stack failures."""
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


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def parse_chat_body(status: int, body: bytes | str) -> ChatReply:
    """Pure: an HTTP answer to /v1/chat/completions → ChatReply, or raise EndpointFailure.

    A 200 whose body is not a chat completion is a stack failure, never "no tool calls"
    (mlcommons/endpoints#346: that mistake silently costs score)."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    if status != 200:
        raise EndpointFailure(HTTP_ERROR, f"HTTP {status}: {text[:300]}", status=status)
    try:
        data = json.loads(text)
    except ValueError:
        raise EndpointFailure(MALFORMED_BODY, f"the body is not JSON: {text[:200]!r}", status=status) from None
    try:
        choice = data["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise EndpointFailure(MALFORMED_BODY, f"no choices[0].message in {text[:200]!r}", status=status) from None
    if not isinstance(message, dict):
        raise EndpointFailure(MALFORMED_BODY, "choices[0].message is not an object", status=status)
    calls = message.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise EndpointFailure(MALFORMED_BODY, "message.tool_calls is not a list", status=status)
    for call in calls or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise EndpointFailure(MALFORMED_BODY, f"a tool call without function.name: {call!r}"[:300], status=status)
    for key in ("content", "reasoning_content"):
        if message.get(key) is not None and not isinstance(message.get(key), str):
            raise EndpointFailure(MALFORMED_BODY, f"message.{key} is not a string", status=status)
    timings = data.get("timings") if isinstance(data.get("timings"), dict) else {}
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
    return ChatReply(
        message=message,
        finish_reason=choice.get("finish_reason") if isinstance(choice, dict) else None,
        prompt_tokens=_int(timings.get("prompt_n")) if "prompt_n" in timings else _int(usage.get("prompt_tokens")),
        generated_tokens=(_int(timings.get("predicted_n")) if "predicted_n" in timings
                          else _int(usage.get("completion_tokens"))),
        prompt_ms=_float(timings.get("prompt_ms")),
        generated_ms=_float(timings.get("predicted_ms")),
        cache_n=_int(timings.get("cache_n")),
    )

"""An OpenAI-compatible chat endpoint over HTTP: the grade's :class:`~grading.protocol.ChatEndpoint`.

Serves llama-server sessions (:meth:`backends.llama_server.process.LoadedServer.chat_endpoint`)
and any server already running (``hotfit grade --endpoint``): chat completions, llama-server's slot
erase (``POST /slots/0?action=erase``; ``cache_prompt: false`` where the server refuses slot
actions), ``/apply-template`` and ``/props`` + ``/v1/models`` for the fingerprint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self

from hotfit.core.lazy_import import lazy_module
from hotfit.grading.protocol import (
    SLOT_ERASED,
    SLOT_FRESH_PROMPT,
    SLOT_UNSUPPORTED,
    ChatFailed,
    ChatReply,
    ServerFacts,
    parse_chat_body,
)

if TYPE_CHECKING:  # the type checker reads the real module; at run time it loads on first use
    import httpx
else:
    httpx = lazy_module("httpx")  # third-party, imported on first use (core.lazy_import says why)

__all__ = ["REQUEST_TIMEOUT_S", "HttpChatEndpoint", "facts_from"]

# One step on a CPU-only large model (prompt of ~1-3K tokens plus a call) can take minutes;
# longer than this the server is not usable as an agent, and the grade says http_error.
REQUEST_TIMEOUT_S = 300.0
_DESCRIBE_TIMEOUT_S = 10.0


def _base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url.removesuffix("/v1")


class HttpChatEndpoint:
    """:class:`~grading.protocol.ChatEndpoint` over httpx. Use as ``async with``."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = REQUEST_TIMEOUT_S,
                 transport: httpx.AsyncBaseTransport | None = None, slot_id: int = 0) -> None:
        self.base_url = _base_url(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=self.base_url, headers=headers, transport=transport,
                                         timeout=httpx.Timeout(timeout_s, connect=10.0), trust_env=False)
        self._slot_id = slot_id
        self._skip_cache_once = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.aclose()

    async def chat(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]],
                   **sampling: Any) -> ChatReply:
        body = {"messages": list(messages), "tools": list(tools), **sampling}
        if self._skip_cache_once:
            body["cache_prompt"] = False
            self._skip_cache_once = False
        try:
            response = await self._client.post("/v1/chat/completions", json=body)
        except httpx.HTTPError as exc:  # refused, reset, timed out: the stack, not the model
            raise ChatFailed("transport", f"{type(exc).__name__}: {exc}",
                             f"no answer from {self.base_url}: check that the server is running and reachable "
                             "(the stack failed, not the model)") from None
        return parse_chat_body(response.status_code, response.content)

    async def reset(self) -> str:
        # Whatever the erase answers, the scenario's first request goes out with cache_prompt:false:
        # an erased slot is not an empty cache — llama-server's RAM prompt cache (--cache-ram, on by
        # default since llama.cpp#16391) restores an earlier grade's prefix into it (measured on the
        # pinned build: first-request cache_n 669-2,025 after a successful erase on a server that had
        # served a grade; 0 with this). Later requests reuse the scenario's own prefix.
        self._skip_cache_once = True
        try:
            response = await self._client.post(f"/slots/{self._slot_id}", params={"action": "erase"},
                                               timeout=_DESCRIBE_TIMEOUT_S)
        except httpx.HTTPError:
            return SLOT_UNSUPPORTED
        if response.status_code == 200:
            return SLOT_ERASED
        if response.status_code == 501:
            # llama-server without --slot-save-path refuses slot actions (measured on the pinned
            # build: "Start it with `--slot-save-path`"), and then the next scenario reuses the last
            # one's cache (cache_n in the thousands); the uncached first request stands in.
            return SLOT_FRESH_PROMPT
        return SLOT_UNSUPPORTED

    async def _get_json(self, route: str) -> dict[str, Any]:
        try:
            response = await self._client.get(route, timeout=_DESCRIBE_TIMEOUT_S)
            data = response.json() if response.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    async def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> str | None:
        try:
            response = await self._client.post("/apply-template", json={"messages": list(messages),
                                                                         "tools": list(tools)},
                                               timeout=_DESCRIBE_TIMEOUT_S)
            prompt = response.json().get("prompt") if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return prompt if isinstance(prompt, str) else None

    async def describe(self) -> ServerFacts:
        props = await self._get_json("/props")
        models = await self._get_json("/v1/models")
        return facts_from(props, models)


def facts_from(props: Mapping[str, Any], models: Mapping[str, Any]) -> ServerFacts:
    """Pure: what llama-server's /props and an OpenAI /v1/models answer say (None where silent)."""
    caps = props.get("chat_template_caps") if isinstance(props.get("chat_template_caps"), dict) else {}
    settings = props.get("default_generation_settings")
    settings = settings if isinstance(settings, dict) else {}
    template = props.get("chat_template")
    data = models.get("data")
    entries: list[Any] = data if isinstance(data, list) else []
    first = entries[0] if entries and isinstance(entries[0], dict) else {}
    supports = caps.get("supports_tools") if isinstance(caps, dict) else None
    chat_format = props.get("chat_format") or (settings.get("chat_format") if settings else None)
    return ServerFacts(
        model=first.get("id") or props.get("model_alias"),
        model_path=props.get("model_path"),
        model_sha256=props.get("model_sha256"),
        chat_template_sha256=hashlib.sha256(template.encode()).hexdigest() if isinstance(template, str) else None,
        chat_format=str(chat_format) if chat_format else None,
        supports_tools=supports if isinstance(supports, bool) else None,
        build=props.get("build_info"),
        context_tokens=settings.get("n_ctx") if isinstance(settings.get("n_ctx"), int) else None,
        slots=props.get("total_slots") if isinstance(props.get("total_slots"), int) else None,
        raw={"props_keys": sorted(props), "models": [e.get("id") for e in entries if isinstance(e, dict)]},
    )

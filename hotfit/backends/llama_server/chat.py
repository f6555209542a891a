"""llama-server's chat call: one chat completion with tools, watched for a dying server.

llama-server parses the model's tool calls itself (``--jinja``, the template's markers) and
reports ``chat_template_caps.supports_tools`` in ``/props``: a template that cannot express tools
makes it drop them silently and answer in prose with HTTP 200 (ggml-org/llama.cpp#27129,
anchors.md §4), which the caller must judge. This module only turns what happened on the wire
into a :class:`~grading.protocol.ChatReply` or a :class:`~grading.protocol.ChatFailed` whose cause
names the stack failure: no answer in time, a dropped connection, an HTTP error, or the server
dead (by a signal: diagnosed from the build, as at load).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio

from hotfit.core.lazy_import import lazy_module
from hotfit.backends.llama_server.crash import signal_death_report
from hotfit.backends.llama_server.logs import relevant_log_lines
from hotfit.grading.protocol import ChatFailed, ChatReply

if TYPE_CHECKING:  # the type checker reads the real module; at run time it loads on first use
    import httpx
else:
    httpx = lazy_module("httpx")  # third-party, imported on first use (core.lazy_import says why)

if TYPE_CHECKING:  # annotations only: process.py imports this module
    from hotfit.backends.llama_server.process import LoadedServer

__all__ = ["DYING_SERVER_WAIT_S", "call_tools", "supports_tools", "tool_call_fix"]

# A crashing process may still be writing its core dump (seconds for a big mapped model, more on a
# loaded host); a dropped connection waits this long to see the server dead before calling it a
# transport error, which would hide the crash.
DYING_SERVER_WAIT_S = 15.0
_WATCH_POLL_S = 0.1


async def supports_tools(client: httpx.AsyncClient) -> bool | None:
    """``/props`` ``chat_template_caps.supports_tools`` (None when the server does not say)."""
    try:
        props = (await client.get("/props")).json()
        caps = props.get("chat_template_caps") or {}
        value = caps.get("supports_tools")
        return bool(value) if value is not None else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


async def call_tools(server: LoadedServer, request: Mapping[str, Any], *, timeout_s: float,
                     purpose: str) -> ChatReply:
    """POST ``request`` to ``/v1/chat/completions`` of ``server``; a dead server must not look
    like a slow one, so the process is watched while the request runs."""
    outcome: dict[str, Any] = {}
    async with server.client(timeout_s) as client:
        tools_supported = await supports_tools(client)
        with anyio.move_on_after(timeout_s) as scope:
            async with anyio.create_task_group() as tg:

                async def send() -> None:
                    try:
                        outcome["response"] = await client.post("/v1/chat/completions", json=dict(request))
                    except httpx.HTTPError as exc:
                        outcome["error"] = exc
                    tg.cancel_scope.cancel()

                async def watch() -> None:
                    while server.returncode() is None:
                        await anyio.sleep(_WATCH_POLL_S)
                    await anyio.sleep(0.5)  # let send() see the closed connection first
                    tg.cancel_scope.cancel()

                tg.start_soon(send)
                tg.start_soon(watch)

    if "error" in outcome:  # a dropped connection: give a dying server time to be seen dead
        with anyio.move_on_after(DYING_SERVER_WAIT_S):
            while server.returncode() is None:
                await anyio.sleep(0.05)
    code = server.returncode()
    if code is not None and code < 0:  # a crash at the first real inference names the build, like load
        message, hint, facts = signal_death_report(server, -code, f"during {purpose}")
        raise ChatFailed("server_exited", message, hint, **facts)
    if code is not None:
        raise ChatFailed(
            "server_exited",
            f"llama-server {server.describe_exit()} during {purpose}",
            "the server died while answering; its last log lines are quoted in details "
            f"(full log: {server.log_path}). Memory pressure (the OOM killer) is the usual cause",
            returncode=server.returncode(),
            log_lines=relevant_log_lines(server.log_lines()),
        )
    if "response" not in outcome:
        if scope.cancelled_caught or "error" not in outcome:
            raise ChatFailed("timeout", f"no answer to {purpose} within {timeout_s:.0f} s",
                             "the session is too slow to serve as an agent on this device, or the server hangs")
        raise ChatFailed("transport", f"{purpose} request failed: {outcome['error']!r}",
                         f"see the server log {server.log_path}")
    response: httpx.Response = outcome["response"]
    try:
        answer = response.json()
    except ValueError:
        answer = {"raw": response.text[:4000]}
    if response.status_code != 200:
        raise ChatFailed(
            "http_status",
            f"llama-server answered {purpose} with HTTP {response.status_code}: {json.dumps(answer)[:500]}",
            "the chat template or the request was rejected; see the server log",
            status=response.status_code,
            answer=answer,
        )
    return ChatReply.of_body(answer if isinstance(answer, dict) else {"raw": answer},
                             template=server.template.describe(), supports_tools=tools_supported)


def tool_call_fix(cause: str, answer: ChatReply | None = None) -> str:
    """What the operator does about a failed tool call on llama-server (the probe's hint)."""
    if cause in ("call_without_markers", "ignored_tools"):
        return ("Load the chat template the model was trained with (the registry's chat_template: "
                "`hotfit pull NAME`); if it already is that template, the model does not call tools "
                "reliably and its registry entry must not be auto-eligible")
    return ("Fetch the registry's tool-capable chat template (`hotfit pull NAME`) and load it with "
            "--chat-template-file")

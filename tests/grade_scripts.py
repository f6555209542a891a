"""Scripted chat servers for the grade's tests: no model, exact expected outcomes.

An *agent* is a function ``(scenario, turn, step, messages, tools) -> response`` where
``response`` is ``(status, body)``; ``turn`` is the index of the current user turn and ``step``
the number of assistant messages since it. :class:`ScriptedServer` routes the HTTP surface the
grade uses (chat completions, slot erase, /props, /v1/models) to one agent, both in process
(:meth:`ScriptedServer.transport`, an httpx.MockTransport) and over a real socket on 127.0.0.1
(:func:`http_stub`). Tool-call ids are random, as llama-server's are: the grade must not let
that reach its transcripts.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

import anyio
import httpx

from hotfit.grading.scenarios import SCENARIOS, Scenario
from hotfit.grading.world import TOOLS, WRITE_TOOLS
from tests.hubserver import serve_handler

HANG = -1  # an agent status meaning "never answer" (in process only): for the budget tests
Response = tuple[int, Any]  # (status, JSON value or raw str/bytes)
Agent = Callable[[Scenario, int, int, list[dict[str, Any]], list[dict[str, Any]]], Response]

_BY_FIRST_USER_TEXT = {s.turns[0].user: s for s in SCENARIOS}


def completion(content: str | None = "", calls: list[tuple[str, Any]] | None = None, *,
               finish: str | None = None, reasoning: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"id": secrets.token_hex(8), "type": "function",
             "function": {"name": n, "arguments": a if isinstance(a, str) else json.dumps(a)}}
            for n, a in calls]
    return {
        "choices": [{"index": 0, "finish_reason": finish or ("tool_calls" if calls else "stop"), "message": message}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 20},
        "timings": {"prompt_n": 100, "prompt_ms": 50.0, "predicted_n": 20, "predicted_ms": 100.0, "cache_n": 0},
    }


def ok(body: dict[str, Any]) -> Response:
    return 200, body


# ---------------------------------------------------------------- agents


def oracle(scenario: Scenario, turn: int, step: int, *_: Any) -> Response:
    """Replays the reference: its calls step by step, then its reply."""
    ref = scenario.turns[turn]
    if step < len(ref.steps):
        return ok(completion("", [(c.name, dict(c.args)) for c in ref.steps[step]]))
    return ok(completion(ref.reply))


def sequential_oracle(scenario: Scenario, turn: int, step: int, *_: Any) -> Response:
    """The reference with every parallel step issued one call at a time."""
    calls = [c for s in scenario.turns[turn].steps for c in s]
    if step < len(calls):
        return ok(completion("", [(calls[step].name, dict(calls[step].args))]))
    return ok(completion(scenario.turns[turn].reply))


def never_calls(*_: Any) -> Response:
    return ok(completion("I'm sorry, I can't help with that."))


def _invented(spec_name: str) -> dict[str, Any]:
    spec = TOOLS[spec_name]
    fake = {"string": "example", "integer": 1, "number": 1.0, "boolean": True, "array": []}
    return {k: fake[spec.properties[k]["type"]] for k in spec.properties}


def reckless(scenario: Scenario, turn: int, step: int, messages: Any, tools: list[dict[str, Any]]) -> Response:
    """Calls the first offered write tool with invented values at once, every turn."""
    if step == 0:
        name = next(t["function"]["name"] for t in tools if t["function"]["name"] in WRITE_TOOLS)
        return ok(completion("", [(name, _invented(name))]))
    return ok(completion("Done."))


def call_in_content(scenario: Scenario, turn: int, step: int, *_: Any) -> Response:
    """The call is written as text and left unparsed in content (template/handler mismatch)."""
    return ok(completion('<tool_call>\n{"name": "list_dir", "arguments": {"path": "."}}\n</tool_call>'))


def call_in_reasoning(scenario: Scenario, turn: int, step: int, *_: Any) -> Response:
    return ok(completion("", reasoning='<tool_call>\n{"name": "list_dir", "arguments": {"path": "."}}'))


def bare_json_in_content(*_: Any) -> Response:
    return ok(completion('{"name": "list_dir", "arguments": {"path": "."}}'))


def truncates(*_: Any) -> Response:
    """max_tokens cut the call off: the server gives up parsing and returns the fragment."""
    return ok(completion('<tool_call>\n{"name": "list_d', finish="length"))


def truncates_parsed(scenario: Scenario, turn: int, step: int, *_: Any) -> Response:
    return ok(completion("", [("list_dir", '{"path": "scr')], finish="length"))


def http_500_on_turn_2(scenario: Scenario, turn: int, step: int, *rest: Any) -> Response:
    if turn == 1:
        return 500, {"error": {"code": 500, "message": "Failed to parse tool call arguments", "type": "server_error"}}
    return oracle(scenario, turn, step, *rest)


def hangs_on(scenario_id: str) -> Agent:
    """The oracle, except that requests of one scenario are never answered."""

    def agent(scenario: Scenario, *rest: Any) -> Response:
        return (HANG, "") if scenario.id == scenario_id else oracle(scenario, *rest)

    return agent


def malformed_body(*_: Any) -> Response:
    return 200, "<html>502 Bad Gateway</html>"


def empty_choices(*_: Any) -> Response:
    return 200, {"choices": []}


def _first_call_step(scenario: Scenario) -> tuple[int, int]:
    return next((t, k) for t, turn in enumerate(scenario.turns) for k, s in enumerate(turn.steps) if s)


def _inject(bad: Callable[[Scenario], tuple[str, Any]]) -> Agent:
    """The oracle, with one bad call issued just before the reference's first call."""

    def agent(scenario: Scenario, turn: int, step: int, *rest: Any) -> Response:
        t_inj, k_inj = _first_call_step(scenario)
        if (turn, step) == (t_inj, k_inj):
            return ok(completion("", [bad(scenario)]))
        if turn == t_inj and step > k_inj:
            step -= 1
        return oracle(scenario, turn, step, *rest)

    return agent


unknown_tool_then_recovers = _inject(lambda s: ("frobnicate", {"x": 1}))


def _with_extra(s: Scenario) -> tuple[str, Any]:
    t, k = _first_call_step(s)
    first = s.turns[t].steps[k][0]
    return first.name, {**first.args, "force": True}


extra_argument_then_recovers = _inject(_with_extra)


def bad_json_arguments_then_recovers(s: Scenario) -> tuple[str, Any]:
    t, k = _first_call_step(s)
    return s.turns[t].steps[k][0].name, '{"path": '


bad_json_then_recovers = _inject(bad_json_arguments_then_recovers)


def unknown_tool_only(scenario: Scenario, turn: int, step: int, *_: Any) -> Response:
    if step == 0:
        return ok(completion("", [("frobnicate", {})]))
    return ok(completion("Done."))


def loops_on_reads(scenario: Scenario, turn: int, step: int, messages: Any, tools: list[dict[str, Any]]) -> Response:
    """Never stops calling a read tool: the step limit must end it."""
    name = next(t["function"]["name"] for t in tools if t["function"]["name"] not in WRITE_TOOLS)
    return ok(completion("", [(name, _invented(name))]))


# ---------------------------------------------------------------- the server


@dataclass
class ScriptedServer:
    agent: Agent
    props: dict[str, Any] = field(default_factory=lambda: {
        "model_path": "/models/scripted.gguf", "build_info": "b0000-scripted", "total_slots": 1,
        "chat_template": "{{ messages }}", "chat_template_caps": {"supports_tools": True},
        "default_generation_settings": {"n_ctx": 32768}})
    erase_status: int = 200  # 501: llama-server without --slot-save-path; 404: not a llama-server
    renders: str = "all"  # /apply-template: "all" keeps everything, "chatml" drops tools and calls, "none" = 404
    api_key: str | None = None  # when set, chat requests without "Bearer <key>" get 401
    erases: int = 0
    chat_requests: list[dict[str, Any]] = field(default_factory=list)

    def handle(self, method: str, path: str, query: str, body: bytes,
               headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
        if method == "POST" and path == "/slots/0" and "action=erase" in query:
            if self.erase_status != 200:
                return self.erase_status, b'{"error": {"code": 501, "message": "This server does not support slots action."}}'
            self.erases += 1
            return 200, b'{"id_slot": 0, "n_erased": 0}'
        if method == "GET" and path == "/props":
            return 200, json.dumps(self.props).encode()
        if method == "GET" and path == "/v1/models":
            return 200, json.dumps({"object": "list", "data": [{"id": "scripted-model"}]}).encode()
        if method == "POST" and path == "/apply-template":
            if self.renders == "none":
                return 404, b'{"error": "not found"}'
            request = json.loads(body)
            if self.renders == "chatml":  # what llama.cpp's fallback does: no tools, no calls
                request = {"messages": [{k: v for k, v in m.items() if k != "tool_calls"} for m in request["messages"]]}
            return 200, json.dumps({"prompt": json.dumps(request)}).encode()
        if method == "POST" and path == "/v1/chat/completions":
            if self.api_key and (headers or {}).get("authorization") != f"Bearer {self.api_key}":
                return 401, b'{"error": {"code": 401, "message": "Invalid API Key"}}'
            request = json.loads(body)
            self.chat_requests.append(request)
            messages = request["messages"]
            users = [i for i, m in enumerate(messages) if m["role"] == "user"]
            scenario = _BY_FIRST_USER_TEXT[messages[users[0]]["content"]]
            step = sum(1 for m in messages[users[-1]:] if m["role"] == "assistant")
            status, payload = self.agent(scenario, len(users) - 1, step, messages, request["tools"])
            raw = payload if isinstance(payload, (str, bytes)) else json.dumps(payload)
            return status, raw.encode() if isinstance(raw, str) else raw
        return 404, b'{"error": "not found"}'

    def transport(self) -> httpx.MockTransport:
        async def handler(request: httpx.Request) -> httpx.Response:
            status, body = self.handle(request.method, request.url.path, request.url.query.decode(), request.content,
                                       {k.lower(): v for k, v in request.headers.items()})
            if status == HANG:
                await anyio.sleep_forever()
            return httpx.Response(status, content=body, headers={"Content-Type": "application/json"})

        return httpx.MockTransport(handler)


@contextlib.contextmanager
def http_stub(server: ScriptedServer) -> Iterator[str]:
    """Serve ``server`` on 127.0.0.1:<ephemeral port>; yield its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            path, _, query = self.path.partition("?")
            length = int(self.headers.get("Content-Length") or 0)
            status, body = server.handle(self.command, path, query, self.rfile.read(length) if length else b"",
                                         {k.lower(): v for k, v in self.headers.items()})
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _serve

        def log_message(self, *args: Any) -> None:
            pass

    with serve_handler(Handler) as url:
        yield url


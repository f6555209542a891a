"""Run one scenario against a :class:`~grading.protocol.ChatEndpoint` and decide its outcome.

The runner decides the outcome class while it runs, not by string heuristics
afterwards. Model failures and stack failures are kept apart, because a harness or server fault
that looks like a model fault is the commonest way such grades mislead (docs/grade.md):

- model failures: ``wrong_state`` (the end state differs from the reference replay),
  ``forbidden_call`` (a call in a turn no tool serves, a write while a value is missing or the
  needed tool is not offered yet), ``missing_read`` (a required read never made),
  ``communicate_miss`` (the answer lacks a fact the tools returned), ``step_limit``;
- stack failures: ``http_error``, ``malformed_body``, ``unparsed_call`` (call markup left in
  ``content`` or ``reasoning_content``: the server's parser did not recognise the call),
  ``truncated`` (``finish_reason: length`` while emitting a call), ``preflight_failed``.

Invalid calls (an unknown or not-yet-offered tool, arguments that are not a JSON object, or
that break the schema, an invented extra key included) are answered with a structured error the
model may recover from; they count against call validity, not against the scenario.

A turn of a forced pack (:class:`~grading.scenarios.Turn` ``tool_choice`` / ``pinned``) sends its
``tool_choice`` on its first request and checks calls against the narrowed schema it offered.

The runner does no I/O of its own and reads no clock: the same replies give the same transcript
and the same outcome.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hotfit.grading.protocol import HTTP_ERROR, MALFORMED_BODY, SAMPLING, ChatEndpoint, ChatFailed, ChatReply
from hotfit.grading.scenarios import (
    FORBID_ANY_CALL,
    FORBID_WRITES,
    SYSTEM_PROMPT,
    Call,
    Scenario,
    canonical_json,
    comparable_state,
    expected_state,
    state_differences,
)
from hotfit.grading.schema import validate_arguments
from hotfit.grading.world import WRITE_TOOLS, ToolError, World

__all__ = [
    "MODEL_FAILURES",
    "NOT_RUN",
    "PASS",
    "STACK_FAILURES",
    "STEP_LIMIT",
    "CallRecord",
    "ScenarioResult",
    "find_call_markup",
    "outcome_class",
    "run_scenario",
    "stack_outcome",
]

PASS = "pass"
NOT_RUN = "not_run"  # the budget ran out before or during the scenario
MODEL_FAILURES = ("wrong_state", "forbidden_call", "missing_read", "communicate_miss", "step_limit")
STACK_FAILURES = ("http_error", "malformed_body", "unparsed_call", "truncated", "preflight_failed")


def stack_outcome(failure: ChatFailed) -> str:
    """The outcome of a scenario whose request failed: ``malformed_body`` when the server answered
    something that is not a chat completion, ``http_error`` for every other failure of the stack."""
    return MALFORMED_BODY if failure.cause == MALFORMED_BODY else HTTP_ERROR


# Model requests per user turn. The longest reference turn needs 4 requests done one call at a
# time; BFCL allows 20, but a loop that long on 2-3 step tasks is already a failure.
STEP_LIMIT = 8

# Openers the common chat formats use for a call; seen in content or reasoning they mean the
# server's parser missed a call (llama.cpp#27363, #26849), which is not the model declining.
_CALL_TAGS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<function=", "<tool_calls>",
              "<|tool_call_begin|>", "<|tool_calls_section_begin|>", "<｜tool▁calls▁begin｜>", "<|tool_call>",
              "<start_function_call>")
_BARE_JSON_CALL = re.compile(r'\{\s*"name"\s*:\s*"[^"]+"\s*,\s*"(?:arguments|parameters)"\s*:')


def outcome_class(outcome: str) -> str:
    if outcome == PASS:
        return "pass"
    if outcome in STACK_FAILURES:
        return "stack"
    if outcome == NOT_RUN:
        return "not_run"
    return "model"


def find_call_markup(content: str, reasoning: str) -> str | None:
    """The call markup left in text, if any: tags in either field, a bare JSON call in content."""
    for tag in _CALL_TAGS:
        if tag in content:
            return f"{tag!r} in content"
        if tag in reasoning:
            return f"{tag!r} in reasoning_content"
    if _BARE_JSON_CALL.search(content):
        return "a JSON tool call in content"
    return None


@dataclass(frozen=True)
class CallRecord:
    turn: int
    step: int
    name: str
    arguments: Any  # decoded when it decoded, else the raw text
    problem: str | None  # None = valid (it ran; the tool may still have refused)
    writes: bool

    def to_json(self) -> dict[str, Any]:
        return {"turn": self.turn, "step": self.step, "name": self.name, "arguments": self.arguments,
                "valid": self.problem is None, "problem": self.problem}


@dataclass(frozen=True)
class ScenarioResult:
    scenario_id: str
    category: str
    outcome: str
    detail: str
    failed_checks: tuple[str, ...] = ()
    requests: int = 0
    calls: tuple[CallRecord, ...] = ()
    parallel_steps: int = 0  # model requests that issued more than one call (diagnostic)
    transcript: tuple[Mapping[str, Any], ...] = ()
    transcript_sha256: str | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prompt_ms: float = 0.0
    generated_ms: float = 0.0
    first_cache_n: int | None = None  # 0 after a slot erase; more means the cache survived
    slot: str | None = None
    wall_s: float | None = None  # filled in by the effectful stage

    @property
    def outcome_class(self) -> str:
        return outcome_class(self.outcome)

    @property
    def invalid_calls(self) -> int:
        return sum(1 for c in self.calls if c.problem is not None)

    def to_json(self, *, transcript: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.scenario_id, "category": self.category, "outcome": self.outcome,
            "outcome_class": self.outcome_class, "detail": self.detail, "failed_checks": list(self.failed_checks),
            "requests": self.requests, "calls": len(self.calls), "invalid_calls": self.invalid_calls,
            "parallel_steps": self.parallel_steps, "transcript_sha256": self.transcript_sha256,
            "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
            "first_cache_n": self.first_cache_n, "slot": self.slot, "wall_s": self.wall_s,
            "call_log": [c.to_json() for c in self.calls],
        }
        if transcript:
            out["transcript"] = list(self.transcript)
        return out


def _norm(value: Any) -> Any:
    return value.strip().strip("/").lower() if isinstance(value, str) else value


def _matches(read: Call, record: CallRecord) -> bool:
    if record.problem is not None or record.name != read.name or not isinstance(record.arguments, dict):
        return False
    return all(_norm(record.arguments.get(k)) == _norm(v) for k, v in read.args.items())


@dataclass
class _Run:
    scenario: Scenario
    messages: list[dict[str, Any]] = field(default_factory=list)
    turn_tools: list[list[str]] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)
    requests: int = 0
    parallel_steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prompt_ms: float = 0.0
    generated_ms: float = 0.0
    first_cache_n: int | None = None
    slot: str | None = None

    def account(self, reply: ChatReply) -> None:
        if self.requests == 0:
            self.first_cache_n = reply.cache_n
        self.requests += 1
        self.prompt_tokens += reply.prompt_tokens or 0
        self.generated_tokens += reply.generated_tokens or 0
        self.prompt_ms += reply.prompt_ms or 0.0
        self.generated_ms += reply.generated_ms or 0.0

    def result(self, outcome: str, detail: str, failed: tuple[str, ...] = ()) -> ScenarioResult:
        transcript = tuple(self.messages)
        digest = hashlib.sha256(canonical_json(
            {"scenario": self.scenario.id, "tools": self.turn_tools, "messages": transcript}).encode()).hexdigest()
        return ScenarioResult(
            self.scenario.id, self.scenario.category, outcome, detail, failed, self.requests, tuple(self.calls),
            self.parallel_steps, transcript, digest, self.prompt_tokens, self.generated_tokens, self.prompt_ms,
            self.generated_ms, self.first_cache_n, self.slot,
        )


def _call_id(turn: int, step: int, index: int) -> str:
    # Servers make call ids at random (llama-server does); some templates render them, so echoing
    # them back would make the next prompt differ between runs. Deterministic 9-character
    # alphanumeric ids also satisfy templates that insist on that shape (Mistral's).
    return f"call{turn:01d}{step:02d}{index:02d}"[:9].ljust(9, "0")


def _decode_arguments(raw: Any) -> tuple[Any, str | None]:
    if isinstance(raw, dict):
        return raw, None
    if not isinstance(raw, str):
        return raw, f"arguments must be a JSON object (as a string), got {type(raw).__name__}"
    try:
        value = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return raw, "arguments are not valid JSON"
    if not isinstance(value, dict):
        return value, "arguments must be a JSON object"
    return value, None


def _tool_message(call_id: str, payload: Any) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": canonical_json(payload)}


async def run_scenario(endpoint: ChatEndpoint, scenario: Scenario, *, step_limit: int = STEP_LIMIT,
                       sampling: Mapping[str, Any] = SAMPLING) -> ScenarioResult:
    """Erase the slot, play the scripted user turns, execute valid calls on a fresh world, and
    return the outcome (first failure wins; end-state checks run only when nothing failed on the way)."""
    run = _Run(scenario)
    run.slot = await endpoint.reset()
    world = World.from_state(scenario.initial)
    run.messages.append({"role": "system", "content": SYSTEM_PROMPT})
    finals: list[str] = []
    for t, turn in enumerate(scenario.turns):
        offered = scenario.tools_at(t)
        tool_defs = scenario.tool_defs(t)
        schemas = {d["function"]["name"]: d["function"]["parameters"] for d in tool_defs}
        run.turn_tools.append(list(offered))
        run.messages.append({"role": "user", "content": turn.user})
        final: str | None = None
        for step in range(step_limit):
            # a forced turn asks "required" on its first request only; once its call is answered the
            # model may end the turn (string form only: llama.cpp#26849)
            step_sampling = ({**sampling, "tool_choice": turn.tool_choice}
                             if step == 0 and turn.tool_choice != "auto" else sampling)
            try:
                reply = await endpoint.chat(list(run.messages), tool_defs, **step_sampling)
            except ChatFailed as exc:
                return run.result(stack_outcome(exc), f"turn {t + 1} request {step + 1}: {exc.what}")
            run.account(reply)
            markup = find_call_markup(reply.content, reply.reasoning)
            if reply.finish_reason == "length" and (reply.tool_calls or markup):
                return run.result("truncated", f"turn {t + 1}: finish_reason 'length' while emitting a call "
                                               f"(max_tokens {sampling.get('max_tokens')})")
            assistant: dict[str, Any] = {"role": "assistant", "content": reply.message.get("content")}
            if reply.message.get("reasoning_content") is not None:
                assistant["reasoning_content"] = reply.message["reasoning_content"]
            if markup:
                run.messages.append(assistant)
                return run.result("unparsed_call", f"turn {t + 1}: {markup}: the server did not parse the call "
                                                   "(template or chat-format handler)")
            if not reply.tool_calls:
                run.messages.append(assistant)
                final = reply.content
                break
            if len(reply.tool_calls) > 1:
                run.parallel_steps += 1
            echoed, results, forbidden = [], [], None
            for i, call in enumerate(reply.tool_calls):
                fn = call["function"]
                name, raw = fn["name"], fn.get("arguments")
                call_id = _call_id(t, step, i)
                args, problem = _decode_arguments(raw)
                if name not in offered:
                    problem = f"no tool named {name!r} is offered (offered: {', '.join(offered)})"
                    code = "unknown_tool"
                elif problem is None:
                    problem = validate_arguments(schemas[name], args)  # the schema as offered (pinned: narrowed)
                    code = "schema"
                else:
                    code = "bad_arguments"
                writes = name in WRITE_TOOLS
                run.calls.append(CallRecord(t, step, name, args, problem, writes))
                # never echo arguments the server could not re-render (club-3090#665: HTTP 500 next turn)
                echo_args = raw if isinstance(raw, str) and problem != "arguments are not valid JSON" else (
                    canonical_json(args) if isinstance(args, dict) else "{}")
                echoed.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": echo_args}})
                if forbidden is None and turn.forbid == FORBID_ANY_CALL:
                    forbidden = f"turn {t + 1}: called {name!r} where no tool serves the request"
                elif forbidden is None and turn.forbid == FORBID_WRITES and writes:
                    forbidden = f"turn {t + 1}: called the write tool {name!r} before the user gave what it needs"
                if problem is not None:
                    results.append(_tool_message(call_id, {"error": {"code": code, "message": problem}}))
                    continue
                try:
                    results.append(_tool_message(call_id, {"result": world.call(name, args)}))
                except ToolError as exc:
                    results.append(_tool_message(call_id, {"error": {"code": exc.code, "message": exc.message}}))
            assistant["tool_calls"] = echoed
            run.messages.append(assistant)
            run.messages.extend(results)
            if forbidden:
                return run.result("forbidden_call", forbidden)
        else:
            return run.result("step_limit", f"turn {t + 1}: still calling tools after {step_limit} requests")
        finals.append(final or "")

    failed: list[str] = []
    diffs = state_differences(comparable_state(expected_state(scenario)), comparable_state(world.state()))
    if diffs:
        failed.append("wrong_state: " + "; ".join(diffs[:5]))
    for t, turn in enumerate(scenario.turns):
        turn_calls = [c for c in run.calls if c.turn == t]
        for read in turn.required_reads:
            if not any(_matches(read, c) for c in turn_calls):
                failed.append(f"missing_read: turn {t + 1} never called {read.name}({canonical_json(dict(read.args))})")
        for fact in turn.must_say:
            if fact.lower() not in finals[t].lower():
                failed.append(f"communicate_miss: turn {t + 1} answer lacks {fact!r}")
    if failed:
        return run.result(failed[0].split(":", 1)[0], failed[0], tuple(failed))
    return run.result(PASS, "end state, reads and answers as the reference")

"""probe-tool-call: prove that one tool call parses in the opened session.

Spec ("Selection and hot context"): the check is a single probe tool with one required
parameter; it certifies that a call parses, not that the model selects and fills calls across
turns. The probe tool has one required string parameter and one optional boolean: a schema with
no required parameter cannot fail under llama.cpp's generated grammar.

Why the check must be live: llama-server accepts ``tools`` and silently drops them when the chat
template cannot express tool calls (ggml-org/llama.cpp#27129, anchors.md §4), answering in prose
with HTTP 200. ``tool_choice: "required"`` and temperature 0 make the answer a deterministic
function of the model, the template and the grammar.

A failed probe names its likely cause (:func:`classify_failure`): when the server
says the template supports tools and the answer holds call-shaped JSON (``{"name": ...,
"arguments": ...}``, bare or in a ```json block) but no parsed call, the model wrote its call
without the template's tool-call markers, which is a model/template mismatch, not a template that
cannot express tools; that cause is kept for when the server says the template lacks tool support.

The request, the answer, the verdict and the server's measured prompt and generation speed are
written to ``probe-tool-call.json`` in the run directory: a fitting estimate is no throughput
guarantee (spec), so the operator gets the measured figure.

The stage is the same for every backend: it sends the probe through
:meth:`backends.base.Session.call_tools` (llama-server parses the call itself; OpenVINO renders
the model's own template, forces the call with a structural tag and parses it with the family's
parser, :mod:`backends.openvino.chat`) and judges the OpenAI-shaped answer here.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from hotfit.backends.base import Session
from hotfit.core.errors import ToolCallProbeFailed
from hotfit.core.log import get_logger
from hotfit.core.records import decode_record
from hotfit.grading.protocol import ChatFailed
from hotfit.stages.declaration import StageContext, StageDeclaration
from hotfit.stages.load import SERVER_SESSION, LoadResult

__all__ = [
    "PROBE_TOOL",
    "PROBE_TOOL_NAME",
    "PROBE_REQUIRED_PARAM",
    "PROBE_MAX_TOKENS",
    "PROBE_TIMEOUT_S",
    "ToolCallVerdict",
    "ProbeToolCallResult",
    "probe_request",
    "judge_answer",
    "CALL_SCAN_MAX_CHARS",
    "WrittenCall",
    "find_written_call",
    "ProbeFailure",
    "classify_failure",
    "probe_tool_call",
    "decode_probe_call",
    "DECLARATION",
]

log = get_logger()

PROBE_TOOL_NAME = "hotfit_probe"
PROBE_REQUIRED_PARAM = "text"
# Harmless by construction: nothing executes it; hotfit only checks that the call parses.
PROBE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": PROBE_TOOL_NAME,
        "description": "Echo a short text back. Harmless; used to check that tool calls parse.",
        "parameters": {
            "type": "object",
            "properties": {
                PROBE_REQUIRED_PARAM: {"type": "string", "description": "text to echo"},
                "loud": {"type": "boolean", "description": "echo in capitals"},
            },
            "required": [PROBE_REQUIRED_PARAM],
        },
    },
}
# A call with a short argument is a few dozen tokens; thinking models may spend some first.
PROBE_MAX_TOKENS = 512
# Prompt processing of the tool catalogue plus the call on a CPU-only large model takes a while;
# beyond this the session is not usable as an agent anyway.
PROBE_TIMEOUT_S = 300.0
PROBE_FILE = "probe-tool-call.json"


def probe_request(max_tokens: int = PROBE_MAX_TOKENS) -> dict[str, Any]:
    """The chat-completions body (pure; no key: that travels in a header)."""
    return {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant. Use the provided tool."},
            {
                "role": "user",
                "content": f'Call the {PROBE_TOOL_NAME} tool with {PROBE_REQUIRED_PARAM} set to "ping".',
            },
        ],
        "tools": [PROBE_TOOL],
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": False,
    }


@dataclass(frozen=True)
class ToolCallVerdict:
    passed: bool
    reason: str  # "parsed" or why not
    tool_name: str | None = None
    arguments: dict[str, Any] | None = None
    content: str | None = None
    finish_reason: str | None = None
    reasoning_content: str | None = None  # a thinking model's reasoning, where the server split it off


def judge_answer(answer: Mapping[str, Any]) -> ToolCallVerdict:
    """Pure: pass only for a parsed call of the probe tool whose arguments are a JSON object
    holding the required string parameter."""
    try:
        choice = answer["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError):
        return ToolCallVerdict(False, "the answer has no choices[0].message")
    content = message.get("content")
    finish = choice.get("finish_reason")
    calls = message.get("tool_calls") or []
    if not calls:
        reasoning = message.get("reasoning_content")
        return ToolCallVerdict(False, "answered in prose: no parsed tool call", content=content, finish_reason=finish,
                               reasoning_content=reasoning if isinstance(reasoning, str) else None)
    fn = (calls[0] or {}).get("function") or {}
    name = fn.get("name")
    if name != PROBE_TOOL_NAME:
        return ToolCallVerdict(False, f"called {name!r}, not {PROBE_TOOL_NAME!r}", name, None, content, finish)
    raw = fn.get("arguments")
    try:
        args = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return ToolCallVerdict(False, f"arguments are not valid JSON: {raw!r}", name, None, content, finish)
    if not isinstance(args, dict):
        return ToolCallVerdict(False, f"arguments are not a JSON object: {raw!r}", name, None, content, finish)
    if not isinstance(args.get(PROBE_REQUIRED_PARAM), str):
        return ToolCallVerdict(
            False, f"arguments lack the required string {PROBE_REQUIRED_PARAM!r}: {raw!r}", name, args, content, finish
        )
    return ToolCallVerdict(True, "parsed", name, args, content, finish)


# How much of an answer is searched for a written call. The probe caps the answer at
# PROBE_MAX_TOKENS (a few KiB of text); the bound keeps a runaway or hostile answer cheap.
CALL_SCAN_MAX_CHARS = 32768
# At most this many '{' / '[' positions are tried as the start of a JSON value (each try is one
# bounded json decode), so deep unclosed nesting cannot make the scan quadratic.
_CALL_SCAN_MAX_STARTS = 256
_JSON_START_RE = re.compile(r"\{(?=\s*\")|\[(?=\s*\{)")
_FENCE_RE = re.compile(r"```[ \t]*(?:json|JSON|javascript|js)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)


@dataclass(frozen=True)
class WrittenCall:
    """A tool call the model wrote as plain JSON text, not in the template's call syntax."""

    name: str
    arguments: Any  # as written: an object, or a string holding one
    fenced: bool  # inside a Markdown code fence (```json)
    names_probe_tool: bool
    field: str = "content"  # where it was found: "content" or "reasoning_content"

    def describe(self) -> str:
        form = "a ```json block" if self.fenced else "bare JSON"
        where = "its reasoning" if self.field == "reasoning_content" else "its answer"
        return f"{form} in {where} calling {self.name!r}"


def _call_of(value: Any) -> tuple[str, Any] | None:
    """(name, arguments) when ``value`` is call-shaped: {"name", "arguments"|"parameters"},
    OpenAI's {"function": {...}}, {"tool_calls": [...]} or a list of calls (the first counts)."""
    if isinstance(value, list):
        for item in value:
            found = _call_of(item)
            if found is not None:
                return found
        return None
    if not isinstance(value, dict):
        return None
    if isinstance(value.get("function"), dict):
        return _call_of(value["function"])
    if isinstance(value.get("tool_calls"), list):
        return _call_of(value["tool_calls"])
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    for key in ("arguments", "parameters"):
        if isinstance(value.get(key), (dict, str)):
            return name, value[key]
    return None


def find_written_call(text: str | None, field: str = "content") -> WrittenCall | None:
    """Pure: the first call-shaped JSON value in the first :data:`CALL_SCAN_MAX_CHARS` of ``text``
    (bare, inside prose, or in a fenced block), or None. Malformed JSON is not a call."""
    if not text:
        return None
    text = text[:CALL_SCAN_MAX_CHARS]
    fences = [m.span(1) for m in _FENCE_RE.finditer(text)]
    decoder = json.JSONDecoder()
    for tried, match in enumerate(_JSON_START_RE.finditer(text)):
        if tried >= _CALL_SCAN_MAX_STARTS:
            break
        start = match.start()
        try:
            value, _end = decoder.raw_decode(text, start)
        except (ValueError, RecursionError):
            continue
        found = _call_of(value)
        if found is not None:
            name, arguments = found
            fenced = any(a <= start < b for a, b in fences)
            return WrittenCall(name, arguments, fenced, name == PROBE_TOOL_NAME, field)
    return None


@dataclass(frozen=True)
class ProbeFailure:
    """Why a probe that reached the server failed: a stable cause and what most likely lies behind it."""

    cause: str  # "call_without_markers" | "prose" | "ignored_tools" | "bad_call"
    what: str  # what happened, for the error message
    likely: str  # the likely cause, for the hint
    written_call: WrittenCall | None = None


def classify_failure(verdict: ToolCallVerdict, supports_tools: bool | None, template: str) -> ProbeFailure:
    """Pure: the cause of a failed ``verdict``, given what ``/props`` says of the template
    (``chat_template_caps.supports_tools``; None when the server did not say)."""
    if verdict.passed:
        raise ValueError("classify_failure needs a failed verdict")
    if not verdict.reason.startswith("answered in prose"):
        return ProbeFailure("bad_call", verdict.reason,
                            f"the model's call did not match the probe schema (template used: {template})")
    written = find_written_call(verdict.content) or find_written_call(verdict.reasoning_content, "reasoning_content")
    if supports_tools is False:
        seen = f"; it wrote {written.describe()} as text" if written else ""
        return ProbeFailure("prose", verdict.reason,
                            "the chat template cannot express tool calls, so llama-server dropped the tools "
                            f"(template used: {template}; the server reports supports_tools=false{seen})", written)
    if written is not None:
        said = ("the server reports the template supports tools" if supports_tools
                else "the server did not say whether the template supports tools")
        return ProbeFailure(
            "call_without_markers",
            f"the model wrote its call without the template's tool-call markers ({written.describe()}): "
            "no parsed tool call",
            f"the model does not write calls in this template's syntax ({said}; template used: {template}): "
            "the template is not the one the model was trained with, or the model does not follow it",
            written)
    if supports_tools:
        return ProbeFailure("ignored_tools", verdict.reason,
                            "the model answered in prose although the server reports the template supports tools "
                            f"(template used: {template}): the model does not follow this template's tool syntax")
    return ProbeFailure("prose", verdict.reason,
                        "the chat template cannot express tool calls, so llama-server dropped the tools "
                        f"(template used: {template}; supports_tools={supports_tools})")


@dataclass(frozen=True)
class ProbeToolCallResult:
    """The probe's record, one type for every backend (``backend_facts``: what only that backend
    reports, e.g. OpenVINO's tool-call family and raw text; flattened into the record)."""

    verdict: ToolCallVerdict
    template: str  # which template formatted the prompt
    supports_tools: bool | None  # what the server says of the template's tool support
    prompt_tokens_per_s: float | None
    generation_tokens_per_s: float | None
    prompt_tokens: int | None
    generated_tokens: int | None
    request: dict[str, Any]
    answer: dict[str, Any]
    backend_facts: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:  # a backend fact reads like a field (result.family)
        facts = self.__dict__.get("backend_facts") or {}
        if name in facts:
            return facts[name]
        raise AttributeError(name)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        return data | data.pop("backend_facts")


async def probe_tool_call(
    session: Session,
    *,
    timeout_s: float = PROBE_TIMEOUT_S,
    max_tokens: int = PROBE_MAX_TOKENS,
    force: bool = True,
    family: str | None = None,
) -> ProbeToolCallResult:
    """Send the probe to ``session`` (any backend); return the result or raise
    :class:`ToolCallProbeFailed` (``details.cause``).

    ``force=False`` asks with ``tool_choice: "auto"`` (the model answers freely: a diagnostic,
    and how the tests show that prose fails); ``family`` overrides an OpenVINO model's
    tool-call syntax."""
    request = probe_request(max_tokens)
    if not force:
        request["tool_choice"] = "auto"
    backend = session.backend

    def fail(what: str, hint: str, **details: Any) -> ToolCallProbeFailed:
        # a crash report's own "backend" (the build: cpu, cuda, vulkan) is the more precise fact
        details = {"backend": backend, **details}
        log.error("probe_tool_call.failed", what=what, **details)
        return ToolCallProbeFailed(what, hint=hint, log_path=str(session.log_path), **details)

    extra = {"family": family} if family is not None else {}
    try:
        got = await session.call_tools(request, timeout_s=timeout_s, purpose="the tool-call probe", **extra)
    except ChatFailed as exc:
        raise fail(exc.what, exc.hint, cause=exc.cause, **exc.details) from None

    verdict = judge_answer(got.body)
    result = ProbeToolCallResult(
        verdict=verdict,
        template=got.template,
        supports_tools=got.supports_tools,
        prompt_tokens_per_s=got.prompt_tokens_per_s,
        generation_tokens_per_s=got.generation_tokens_per_s,
        prompt_tokens=got.prompt_tokens,
        generated_tokens=got.generated_tokens,
        request=request,
        answer=dict(got.body),
        backend_facts=dict(got.facts),
    )
    record = {"outcome": "pass" if verdict.passed else "fail", **result.to_json()}
    (session.run_dir / PROBE_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    facts = {k: v for k, v in got.facts.items() if k == "family"}
    if not verdict.passed:
        failure = classify_failure(verdict, got.supports_tools, got.template)
        written = failure.written_call
        raise fail(
            f"tool-call probe failed: {failure.what}",
            f"likely cause: {failure.likely}. {session.tool_call_fix(failure.cause, got)}",
            cause=failure.cause,
            reason=verdict.reason,
            content=(verdict.content or "")[:500],
            finish_reason=verdict.finish_reason,
            supports_tools=got.supports_tools,
            template=got.template,
            written_call=None if written is None else {
                "name": written.name, "fenced": written.fenced, "field": written.field,
                "names_probe_tool": written.names_probe_tool,
            },
            record=str(session.run_dir / PROBE_FILE),
            **facts,
        )
    log.info(
        "probe_tool_call.passed",
        backend=backend,
        tool=verdict.tool_name,
        arguments=verdict.arguments,
        template=got.template,
        prompt_tokens_per_s=result.prompt_tokens_per_s,
        generation_tokens_per_s=result.generation_tokens_per_s,
        **facts,
    )
    return result


# --------------------------------------------------------------------------- the stage

_PROBE_FIELDS = frozenset(f.name for f in dataclasses.fields(ProbeToolCallResult)) - {"backend_facts"}


def decode_probe_call(record: Mapping[str, Any]) -> ProbeToolCallResult:
    """The probe's record back; StageRecordError names a damaged field."""
    if not isinstance(record, Mapping):
        return decode_record(ProbeToolCallResult, record)  # names the problem
    # to_json flattens the backend's own facts (OpenVINO's family, raw text…) into the record
    facts = {k: v for k, v in record.items() if k not in _PROBE_FIELDS}
    known = {k: v for k, v in record.items() if k in _PROBE_FIELDS}
    return decode_record(ProbeToolCallResult, known | {"backend_facts": facts})


async def probe_tool_call_work(ctx: StageContext) -> ProbeToolCallResult:
    return await probe_tool_call(ctx.result("load", LoadResult).live())


def probe_call_figures(result: ProbeToolCallResult) -> dict[str, Any]:
    return {"passed": result.verdict.passed, "reason": result.verdict.reason, "tool": result.verdict.tool_name,
            "prompt_tokens_per_s": result.prompt_tokens_per_s,
            "generation_tokens_per_s": result.generation_tokens_per_s}


def probe_call_fingerprint(result: ProbeToolCallResult) -> Any:
    return {"passed": result.verdict.passed, "template": result.template}


DECLARATION = StageDeclaration(
    "probe-tool-call", probe_tool_call_work, deps=("load",), session=SERVER_SESSION, decode=decode_probe_call,
    fingerprint=probe_call_fingerprint, figures=probe_call_figures, version=1, result_type=ProbeToolCallResult)

"""OpenVINO probe-tool-call: one call of hotfit's probe tool must parse (issue 13 item 2).

The same check as :mod:`stages.probe_tool_call` (same tool, same messages, same verdict rules via
:func:`stages.probe_tool_call.judge_answer` and :func:`~stages.probe_tool_call.classify_failure`),
through the model's own Jinja template as GenAI renders it (minja, like llama-server ``--jinja``):

1. the template renders the conversation with ``tools``; a rendering that does not contain the
   probe tool means the template cannot express tools, and the probe fails before generating
   (constrained decoding would otherwise force a call the template never offered);
2. one greedy generation, forced to a call in the family's own syntax by a structural tag (GenAI's
   xgrammar ``triggered_tags``, ``at_least_one``): the analogue of llama-server's grammar under
   ``tool_choice: "required"``; the tag's content is the probe tool's JSON schema;
3. the text (special tokens kept) is parsed by the family's parser: GenAI ships none for these
   formats (design note §3), so they are here, as pure functions.

Families (:func:`tool_call_family`), with the parser each uses:

- ``hermes`` — Qwen3 (and Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
- ``qwen3_coder`` — Qwen3-Coder: ``<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>``
  (what its template teaches; values are text, typed here by the tool's schema);
- ``harmony`` — gpt-oss: ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``
  (the recipient may also sit in the role header: ``<|start|>assistant to=functions.NAME<|channel|>...``);
- ``phi4`` — Phi-4-mini: ``functools[{"name": ..., "arguments": {...}}]`` (vLLM's and OVMS's phi4
  parsers), also accepted between ``<|tool_call|>`` and ``<|/tool_call|>``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from core.errors import ToolCallProbeFailed
from core.log import get_logger
from stages.openvino_session import OpenVinoSession, _WorkerGone
from stages.probe_tool_call import (
    PROBE_MAX_TOKENS,
    PROBE_TIMEOUT_S,
    PROBE_TOOL,
    PROBE_TOOL_NAME,
    ToolCallVerdict,
    classify_failure,
    judge_answer,
    probe_request,
)

__all__ = [
    "FAMILIES",
    "PARSERS",
    "Family",
    "OpenVinoProbeResult",
    "ParsedCall",
    "answer_from_text",
    "parse_harmony",
    "parse_hermes",
    "parse_phi4",
    "parse_qwen3_coder",
    "probe_openvino_tool_call",
    "structural_tag",
    "template_expresses_tools",
    "tool_call_family",
]

log = get_logger()

Family = Literal["hermes", "qwen3_coder", "harmony", "phi4"]
FAMILIES: tuple[str, ...] = ("hermes", "qwen3_coder", "harmony", "phi4")
PROBE_FILE = "probe-tool-call.json"
TOOL_DESCRIPTION: str = PROBE_TOOL["function"]["description"]


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: Any  # a dict when the JSON parsed as an object; else the raw text


def _json_value(text: str) -> Any:
    """The first JSON value at the start of ``text`` (trailing text ignored), or the stripped text."""
    stripped = text.strip()
    try:
        value, _end = json.JSONDecoder().raw_decode(stripped)
    except ValueError:
        return stripped
    return value


def _call_from_object(value: Any) -> ParsedCall | None:
    if isinstance(value, dict) and isinstance(value.get("function"), dict):  # OpenAI-style wrapper
        value = value["function"]
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters"))
    if isinstance(args, str):
        args = _json_value(args) if args.strip().startswith("{") else args
    return ParsedCall(value["name"], args)


_HERMES_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def parse_hermes(text: str) -> list[ParsedCall]:
    """Pure: Qwen3/Hermes ``<tool_call>{json}</tool_call>`` blocks (an unclosed last block counts:
    generation may stop on the closing tag)."""
    calls = []
    for m in _HERMES_RE.finditer(text):
        call = _call_from_object(_json_value(m[1]))
        if call is not None:
            calls.append(call)
    return calls


_CODER_CALL_RE = re.compile(r"<tool_call>\s*<function=(?P<name>[^>\n]+)>(?P<body>.*?)(?:</function>|\Z)", re.DOTALL)
_CODER_PARAM_RE = re.compile(r"<parameter=(?P<key>[^>\n]+)>\n?(?P<value>.*?)\n?</parameter>", re.DOTALL)


def _typed(value: str, schema: dict[str, Any] | None) -> Any:
    """A Qwen3-Coder parameter's text as the schema's type (strings stay text; others parse as JSON)."""
    kind = (schema or {}).get("type")
    if kind == "string" or kind is None:
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def parse_qwen3_coder(text: str, tools: list[dict[str, Any]] | None = None) -> list[ParsedCall]:
    """Pure: Qwen3-Coder XML calls; parameter values typed by ``tools``' schemas (default: the probe tool)."""
    schemas = {t["function"]["name"]: t["function"].get("parameters", {}).get("properties", {})
               for t in (tools if tools is not None else [PROBE_TOOL])}
    calls = []
    for m in _CODER_CALL_RE.finditer(text):
        name = m["name"].strip()
        props = schemas.get(name, {})
        args = {p["key"].strip(): _typed(p["value"], props.get(p["key"].strip())) for p in _CODER_PARAM_RE.finditer(m["body"])}
        calls.append(ParsedCall(name, args))
    return calls


_HARMONY_RE = re.compile(
    r"to=functions\.(?P<name>[\w.\-]+)"  # recipient, in the header or after the channel
    r"[^<]*(?:<\|channel\|>[^<]*)?(?:<\|constrain\|>[^<]*)?"
    r"<\|message\|>(?P<body>.*?)(?:<\|call\|>|<\|end\|>|<\|return\|>|<\|start\|>|\Z)",
    re.DOTALL,
)


def parse_harmony(text: str) -> list[ParsedCall]:
    """Pure: gpt-oss harmony calls; the arguments are the message body (JSON)."""
    return [ParsedCall(m["name"], _json_value(m["body"])) for m in _HARMONY_RE.finditer(text)]


_PHI4_RE = re.compile(r"(?:functools|<\|tool_call\|>)\s*(\[.*)", re.DOTALL)


def parse_phi4(text: str) -> list[ParsedCall]:
    """Pure: Phi-4-mini ``functools[...]`` (or ``<|tool_call|>[...]<|/tool_call|>``): a JSON list of calls."""
    m = _PHI4_RE.search(text)
    if m is None:
        return []
    body = m[1].split("<|/tool_call|>")[0]
    value = _json_value(body)
    items = value if isinstance(value, list) else [value]
    return [c for c in (_call_from_object(v) for v in items) if c is not None]


PARSERS: dict[str, Callable[[str], list[ParsedCall]]] = {
    "hermes": parse_hermes,
    "qwen3_coder": parse_qwen3_coder,
    "harmony": parse_harmony,
    "phi4": parse_phi4,
}


def tool_call_family(chat_template: str | None, entry_name: str = "") -> Family:
    """Pure: the tool-call syntax the model's template teaches (the template decides; the entry
    name only where the template says nothing recognisable)."""
    t = chat_template or ""
    if "<|channel|>" in t or "to=functions." in t:
        return "harmony"
    if "functools" in t or "<|tool_call|>" in t:
        return "phi4"
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if "<tool_call>" in t:
        return "hermes"
    name = entry_name.lower()
    if "gpt-oss" in name:
        return "harmony"
    if "phi-4" in name or "phi4" in name:
        return "phi4"
    if "coder" in name and "qwen3" in name:
        return "qwen3_coder"
    return "hermes"


# minja (GenAI's template engine) "polyfills" a template that ignores `tools`: it prepends a system
# turn listing them with a generic JSON syntax (measured: this sentence, for a ChatML template without
# a tools branch). The model never learned that syntax, so a polyfilled rendering does not count.
_MINJA_TOOLS_POLYFILL = "You can call any of the following tools to satisfy the user's requests"
_TEMPLATE_TOOLS_RE = re.compile(r"{[{%][^}]*\btools\b")


def template_expresses_tools(template: str | None, prompt: str) -> tuple[bool, str]:
    """Pure: (True, "") when the template itself renders ``tools`` into ``prompt``; else why not."""
    if not template:
        return False, "the export carries no chat template"
    if not _TEMPLATE_TOOLS_RE.search(template):
        return False, "the template never reads the `tools` variable"
    if _MINJA_TOOLS_POLYFILL in prompt:
        return False, "the template ignored the tools and the engine's generic tool prompt was substituted"
    if TOOL_DESCRIPTION not in prompt:
        return False, f"the rendered prompt does not hold the {PROBE_TOOL_NAME!r} tool's definition"
    return True, ""


def _tag(family: str) -> tuple[str, str, str]:
    """(trigger, begin, end) of one forced call of the probe tool in ``family``'s syntax."""
    if family == "hermes":
        return "<tool_call>", f'<tool_call>\n{{"name": "{PROBE_TOOL_NAME}", "arguments": ', "}\n</tool_call>"
    if family == "harmony":
        return ("<|channel|>commentary to=",
                f"<|channel|>commentary to=functions.{PROBE_TOOL_NAME} <|constrain|>json<|message|>", "<|call|>")
    if family == "phi4":
        return "functools[", f'functools[{{"name": "{PROBE_TOOL_NAME}", "arguments": ', "}]"
    raise ValueError(f"unknown tool-call family {family!r}")


# Qwen3-Coder's parameters are XML, not JSON: the forced content is a regex over the probe tool's two
# parameters, every repeat bounded (an unbounded one never ends on a random-weight model; design note §3).
_CODER_PROBE_PATTERN = (
    r"<parameter=text>\n[^<\n]{0,64}\n</parameter>\n(<parameter=loud>\n(true|false)\n</parameter>\n)?"
)


def structural_tag(family: str) -> str:
    """Pure: the xgrammar structural tag (JSON) that forces exactly one probe call (contenox's
    ``openvino:json_schema_tool_calls`` idea, with ``at_least_one`` for ``tool_choice: required``)."""
    if family == "qwen3_coder":
        trigger = "<tool_call>"
        begin, end = f"<tool_call>\n<function={PROBE_TOOL_NAME}>\n", "</function>\n</tool_call>"
        content: dict[str, Any] = {"type": "regex", "pattern": _CODER_PROBE_PATTERN}
    else:
        trigger, begin, end = _tag(family)
        content = {"type": "json_schema", "json_schema": PROBE_TOOL["function"]["parameters"]}
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": [trigger],
            "tags": [{"type": "tag", "begin": begin, "content": content, "end": end}],
            "at_least_one": True,
            "stop_after_first": True,
        },
    }
    return json.dumps(tag)


def answer_from_text(text: str, family: str, finish_reason: str | None) -> dict[str, Any]:
    """Pure: the generated text -> an OpenAI-shaped answer (so :func:`judge_answer` applies)."""
    calls = PARSERS[family](text)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments if isinstance(c.arguments, str)
                                               else json.dumps(c.arguments)}}
            for c in calls
        ]
    return {"choices": [{"message": message, "finish_reason": finish_reason}]}


@dataclass(frozen=True)
class OpenVinoProbeResult:
    verdict: ToolCallVerdict
    family: str
    forced: bool
    status: str  # GenAI GenerationStatus: FINISHED, IGNORED (did not fit the cache), ...
    text: str
    prompt_tokens: int
    generated_tokens: int
    generation_seconds: float
    generation_tokens_per_s: float | None
    template_renders_tools: bool

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def probe_openvino_tool_call(
    session: OpenVinoSession,
    *,
    family: str | None = None,
    force: bool = True,
    timeout_s: float = PROBE_TIMEOUT_S,
    max_tokens: int = PROBE_MAX_TOKENS,
) -> OpenVinoProbeResult:
    """Probe ``session``; return the result or raise :class:`ToolCallProbeFailed` (``details.cause``).

    ``force=False`` drops the structural tag (the model answers freely: a diagnostic, and how the
    tests show that prose fails)."""
    request = probe_request(max_tokens)

    def fail(what: str, hint: str, **details: Any) -> ToolCallProbeFailed:
        log.error("probe_tool_call.failed", what=what, backend="openvino", **details)
        return ToolCallProbeFailed(what, hint=hint, backend="openvino", log_path=str(session.log_path), **details)

    async def ask(op: str, **fields: Any) -> dict[str, Any]:
        try:
            reply = await session.request(op, timeout_s, **fields)
        except TimeoutError:
            raise fail(f"no answer to the tool-call probe within {timeout_s:.0f} s",
                       "the session is too slow to serve as an agent on this device, or the runtime hangs",
                       cause="timeout") from None
        except _WorkerGone:
            raise fail(f"the OpenVINO worker {session.describe_exit()} during the tool-call probe",
                       "memory pressure (the OOM killer) is the usual cause; see the worker log",
                       cause="server_exited", log_lines=session.log_tail()) from None
        if not reply.get("ok"):
            raise fail(f"OpenVINO failed during the tool-call probe ({op}): {reply.get('error', '')[:500]}",
                       "the chat template or the runtime rejected the request; see the worker log",
                       cause="runtime_error", op=op)
        return reply

    rendered = await ask("render", messages=request["messages"], tools=request["tools"])
    template = rendered.get("chat_template") or ""
    fam = family or tool_call_family(template, session.plan.entry.name)
    prompt = rendered["prompt"]
    renders_tools, why_not = template_expresses_tools(template, prompt)
    if not renders_tools:
        raise fail(f"tool-call probe failed: the model's chat template cannot express tools ({why_not})",
                   "the export's template cannot express tool calls: use an export whose template renders "
                   "`tools`, or the registry entry must not be auto-eligible",
                   cause="prose", reason="template drops tools", family=fam)
    out = await ask("generate", prompt=prompt, max_new_tokens=max_tokens,
                    structural_tag=structural_tag(fam) if force else None)
    status = str(out["status"])
    seconds = float(out["seconds"])
    generated = int(out["generated_tokens"])
    text = str(out["text"])
    if status != "FINISHED":
        hint = ("the request did not fit the KV cache (GenAI reports IGNORED for an out-of-memory condition): "
                "the cache holds fewer tokens than the plan" if status == "IGNORED"
                else "see the worker log")
        raise fail(f"tool-call probe failed: generation ended with status {status}", hint, cause="status",
                   status=status)
    answer = answer_from_text(text, fam, "tool_calls" if PARSERS[fam](text) else "stop")
    verdict = judge_answer(answer)
    result = OpenVinoProbeResult(
        verdict=verdict, family=fam, forced=force, status=status, text=text,
        prompt_tokens=int(out["prompt_tokens"]), generated_tokens=generated, generation_seconds=seconds,
        generation_tokens_per_s=(generated / seconds) if seconds > 0 and generated else None,
        template_renders_tools=renders_tools,
    )  # fmt: skip
    record = {"outcome": "pass" if verdict.passed else "fail", "request": request, **result.to_json()}
    (session.run_dir / PROBE_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    if not verdict.passed:
        failure = classify_failure(verdict, True, f"the export's own ({fam} syntax)")
        raise fail(
            f"tool-call probe failed: {failure.what}",
            f"likely cause: {failure.likely}. The model does not call tools in its template's {fam} syntax, "
            "so its registry entry must not be auto-eligible",
            cause=failure.cause, reason=verdict.reason, family=fam, content=text[:500],
            record=str(session.run_dir / PROBE_FILE),
        )  # fmt: skip
    log.info("probe_tool_call.passed", backend="openvino", family=fam, arguments=verdict.arguments,
             generation_tokens_per_s=result.generation_tokens_per_s)
    return result

"""Tool calls in the model's own syntax, for OpenVINO GenAI (which ships no parser for them).

GenAI renders the conversation with the model's own Jinja template (minja, like llama-server
``--jinja``) but returns plain text, so the OpenVINO backend does what llama-server does itself:
it checks that the template really renders ``tools`` (:func:`template_expresses_tools`: a
rendering without them means the template cannot express tools, and forcing a call would invent a
syntax the model never learned), forces a call where the caller requires one with a structural tag
(:func:`structural_tag`: GenAI's xgrammar ``triggered_tags``, ``at_least_one``; the analogue of
llama-server's grammar under ``tool_choice: "required"``), and parses the text (special tokens
kept) with the family's parser into the OpenAI shape (:func:`answer_from_text`). All pure.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "FAMILIES",
    "PARSERS",
    "Family",
    "ParsedCall",
    "answer_from_text",
    "parse_harmony",
    "parse_hermes",
    "parse_phi4",
    "parse_qwen3_coder",
    "structural_tag",
    "template_expresses_tools",
    "unrendered_tool_template",
    "SNAPSHOT_TEMPLATE_FILES",
    "tool_call_family",
]

Family = Literal["hermes", "qwen3_coder", "harmony", "phi4"]
FAMILIES: tuple[str, ...] = ("hermes", "qwen3_coder", "harmony", "phi4")


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


def parse_hermes(text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> list[ParsedCall]:
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


def parse_qwen3_coder(text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> list[ParsedCall]:
    """Pure: Qwen3-Coder XML calls; parameter values typed by ``tools``' schemas (without them: text)."""
    schemas = {t["function"]["name"]: t["function"].get("parameters", {}).get("properties", {})
               for t in (tools or [])}
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


def parse_harmony(text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> list[ParsedCall]:
    """Pure: gpt-oss harmony calls; the arguments are the message body (JSON)."""
    return [ParsedCall(m["name"], _json_value(m["body"])) for m in _HARMONY_RE.finditer(text)]


_PHI4_RE = re.compile(r"(?:functools|<\|tool_call\|>)\s*(\[.*)", re.DOTALL)


def parse_phi4(text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> list[ParsedCall]:
    """Pure: Phi-4-mini ``functools[...]`` (or ``<|tool_call|>[...]<|/tool_call|>``): a JSON list of calls."""
    m = _PHI4_RE.search(text)
    if m is None:
        return []
    body = m[1].split("<|/tool_call|>")[0]
    value = _json_value(body)
    items = value if isinstance(value, list) else [value]
    return [c for c in (_call_from_object(v) for v in items) if c is not None]


# Each takes the text and the request's tools (only Qwen3-Coder's untyped XML values need the schemas).
PARSERS: dict[str, Callable[[str, Sequence[Mapping[str, Any]] | None], list[ParsedCall]]] = {
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


# What GenAI also reads a template from, beside the tokenizer IR (openvino.genai
# src/cpp/src/tokenizer/tokenizer_impl.cpp: these files first, then the IR's rt_info ``chat_template``,
# which wins when present: measured on openvino-genai 2026.4.1).
SNAPSHOT_TEMPLATE_FILES = ("tokenizer_config.json", "chat_template.jinja")


def _file_template(name: str, text: str) -> str | None:
    if not name.endswith(".json"):
        return text
    try:
        value = json.loads(text).get("chat_template")
    except (ValueError, AttributeError, RecursionError):
        return None
    if isinstance(value, list):  # [{"name", "template"}]: the tool_use one, else the default
        named = {i.get("name"): i.get("template") for i in value if isinstance(i, dict)}
        value = named.get("tool_use") or named.get("default")
    return value if isinstance(value, str) else None


def unrendered_tool_template(files: Mapping[str, str], rendered: str | None) -> str | None:
    """Pure: the first of the export's template files (name -> text) whose template reads ``tools``
    but is not the template GenAI rendered — the tokenizer IR's own took precedence — or None."""
    for name in SNAPSHOT_TEMPLATE_FILES:
        text = files.get(name)
        template = _file_template(name, text) if text is not None else None
        if template and template != rendered and _TEMPLATE_TOOLS_RE.search(template):
            return name
    return None


def template_expresses_tools(template: str | None, prompt: str,
                             tools: Sequence[Mapping[str, Any]]) -> tuple[bool, str]:
    """Pure: (True, "") when the template itself renders ``tools`` into ``prompt``; else why not
    (every tool's description must be in the rendering)."""
    if not template:
        return False, "the export carries no chat template"
    if not _TEMPLATE_TOOLS_RE.search(template):
        return False, "the template never reads the `tools` variable"
    if _MINJA_TOOLS_POLYFILL in prompt:
        return False, "the template ignored the tools and the engine's generic tool prompt was substituted"
    for tool in tools:
        fn = tool.get("function") or {}
        description = fn.get("description")
        if isinstance(description, str) and description and description not in prompt:
            return False, f"the rendered prompt does not hold the {fn.get('name')!r} tool's definition"
    return True, ""


def _tag(family: str, name: str) -> tuple[str, str, str]:
    """(trigger, begin, end) of one forced call of tool ``name`` in ``family``'s syntax."""
    if family == "hermes":
        return "<tool_call>", f'<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>"
    if family == "harmony":
        return ("<|channel|>commentary to=",
                f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>", "<|call|>")
    if family == "phi4":
        return "functools[", f'functools[{{"name": "{name}", "arguments": ', "}]"
    raise ValueError(f"unknown tool-call family {family!r}")


# Qwen3-Coder's parameters are XML, not JSON: the forced content is a regex over the tool's
# parameters, every repeat bounded (an unbounded one never ends on a random-weight model; design
# note §3). Required parameters come first and must appear; optional ones may.
_CODER_VALUE_PATTERNS: dict[str, str] = {
    "string": r"[^<\n]{0,64}", "boolean": r"(true|false)", "integer": r"-?[0-9]{1,12}",
    "number": r"-?[0-9]{1,12}(\.[0-9]{1,6})?",
}


def _coder_pattern(parameters: Mapping[str, Any]) -> str:
    props: Mapping[str, Any] = parameters.get("properties") or {}
    required = [k for k in parameters.get("required") or [] if k in props]
    optional = [k for k in props if k not in required]

    def one(key: str) -> str:
        kind = (props[key] or {}).get("type")
        value = _CODER_VALUE_PATTERNS.get(kind if isinstance(kind, str) else "string", r"[^<\n]{0,64}")
        return rf"<parameter={re.escape(key)}>\n{value}\n</parameter>\n"

    return "".join(one(k) for k in required) + "".join(f"({one(k)})?" for k in optional)


def structural_tag(family: str, tool: Mapping[str, Any]) -> str:
    """Pure: the xgrammar structural tag (JSON) that forces exactly one call of ``tool`` (contenox's
    ``openvino:json_schema_tool_calls`` idea, with ``at_least_one`` for ``tool_choice: required``)."""
    fn = tool["function"]
    name = fn["name"]
    parameters = fn.get("parameters") or {"type": "object"}
    if family == "qwen3_coder":
        trigger = "<tool_call>"
        begin, end = f"<tool_call>\n<function={name}>\n", "</function>\n</tool_call>"
        content: dict[str, Any] = {"type": "regex", "pattern": _coder_pattern(parameters)}
    else:
        trigger, begin, end = _tag(family, name)
        content = {"type": "json_schema", "json_schema": parameters}
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


def answer_from_text(text: str, family: str, finish_reason: str | None,
                     tools: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Pure: the generated text -> an OpenAI-shaped chat completion (what llama-server answers)."""
    calls = PARSERS[family](text, tools)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments if isinstance(c.arguments, str)
                                               else json.dumps(c.arguments)}}
            for c in calls
        ]
    return {"choices": [{"message": message, "finish_reason": finish_reason}]}

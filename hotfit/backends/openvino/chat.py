"""OpenVINO's chat call: the model's own template, a forced call where one is required, its parser.

What llama-server does behind ``/v1/chat/completions`` is done here over the worker protocol
(:mod:`backends.openvino.toolcall` says why each step is needed):

1. ``render``: the conversation with ``tools`` through the model's own Jinja template; a rendering
   that does not hold the tools means the template cannot express them, and the call fails before
   generating (cause ``prose``) — constrained decoding would otherwise force a call the template
   never offered;
2. ``generate``: one greedy generation, forced to one call in the family's syntax by a structural
   tag when the request says ``tool_choice: "required"`` for a single tool;
3. the text (special tokens kept) parsed by the family's parser into an OpenAI-shaped answer.

:class:`SessionChatEndpoint` is the same call as the grade's :class:`~grading.protocol.ChatEndpoint`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from hotfit.backends.openvino.config import prompt_cap_problem
from hotfit.backends.openvino.protocol import WorkerGone
from hotfit.backends.openvino.toolcall import (
    PARSERS,
    SNAPSHOT_TEMPLATE_FILES,
    answer_from_text,
    structural_tag,
    template_expresses_tools,
    tool_call_family,
    unrendered_tool_template,
)
from hotfit.grading.protocol import MAX_TOKENS_PER_STEP, SLOT_FRESH_PROMPT, ChatFailed, ChatReply, ServerFacts

if TYPE_CHECKING:  # annotations only: session.py imports this module
    from hotfit.backends.openvino.session import OpenVinoSession

__all__ = ["CHAT_TIMEOUT_S", "SessionChatEndpoint", "call_tools", "tool_call_fix"]

# One grade step on a CPU-only model; beyond it the session is not usable as an agent.
CHAT_TIMEOUT_S = 300.0


async def _ask(session: OpenVinoSession, op: str, timeout_s: float, purpose: str, **fields: Any) -> dict[str, Any]:
    try:
        reply = await session.request(op, timeout_s, **fields)
    except TimeoutError:
        raise ChatFailed("timeout", f"no answer to {purpose} within {timeout_s:.0f} s",
                         "the session is too slow to serve as an agent on this device, or the runtime hangs") from None
    except WorkerGone:
        raise ChatFailed("server_exited", f"the OpenVINO worker {session.describe_exit()} during {purpose}",
                         "memory pressure (the OOM killer) is the usual cause; see the worker log",
                         log_lines=session.log_tail()) from None
    if not reply.get("ok"):
        error = str(reply.get("error", ""))[:500]
        raise ChatFailed("runtime_error", f"OpenVINO failed during {purpose} ({op}): {error}",
                         "the chat template or the runtime rejected the request; see the worker log", op=op)
    return reply


MAX_TEMPLATE_FILE_BYTES = 8 << 20  # as fetch-template bounds a template source


def _export_template_files(ir_dir: Path) -> dict[str, str]:
    """The export's own template files (SNAPSHOT_TEMPLATE_FILES) that are there and readable."""
    found: dict[str, str] = {}
    for name in SNAPSHOT_TEMPLATE_FILES:
        path = ir_dir / name
        try:
            if path.is_file() and path.stat().st_size <= MAX_TEMPLATE_FILE_BYTES:
                found[name] = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
    return found


async def call_tools(session: OpenVinoSession, request: Mapping[str, Any], *, timeout_s: float, purpose: str,
                     family: str | None = None) -> ChatReply:
    """One chat completion of ``request`` on ``session`` (``family`` overrides the template's)."""
    messages = list(request.get("messages") or [])
    tools = list(request.get("tools") or [])
    rendered = await _ask(session, "render", timeout_s, purpose, messages=messages, tools=tools)
    template = rendered.get("chat_template") or ""
    fam = family or tool_call_family(template, session.plan.entry.name)
    prompt = str(rendered["prompt"])
    if tools:
        renders_tools, why_not = template_expresses_tools(template, prompt, tools)
        if not renders_tools:
            other = unrendered_tool_template(_export_template_files(session.ir_dir), template)
            if other is not None:  # the export names tools in a file GenAI does not render from
                raise ChatFailed(
                    "prose", f"{purpose} failed: the chat template GenAI renders (the tokenizer IR's own, in "
                    f"openvino_tokenizer.xml) cannot express tools ({why_not}); the export's {other} can, but "
                    "GenAI renders the tokenizer IR's template in preference to it",
                    "use an export whose tokenizer IR carries the tool-capable template (optimum-cli export "
                    "openvino writes the repository's template there), or the registry entry must not be "
                    "auto-eligible", reason="template drops tools", family=fam, unrendered_template=other)
            raise ChatFailed("prose", f"{purpose} failed: the model's chat template cannot express tools ({why_not})",
                             "the export's template cannot express tool calls: use an export whose template renders "
                             "`tools`, or the registry entry must not be auto-eligible",
                             reason="template drops tools", family=fam)
    else:
        renders_tools = False
    forced = request.get("tool_choice") == "required" and len(tools) == 1
    out = await _ask(session, "generate", timeout_s, purpose, prompt=prompt,
                     max_new_tokens=int(request.get("max_tokens") or MAX_TOKENS_PER_STEP),
                     structural_tag=structural_tag(fam, tools[0]) if forced else None)
    status = str(out["status"])
    seconds = float(out["seconds"])
    generated = int(out["generated_tokens"])
    text = str(out["text"])
    if status == "TRUNCATED":  # the worker refused a prompt its tokenizer would cut (worker._prompt_cap)
        cap = int(out.get("prompt_max_tokens") or 0)
        raise ChatFailed("status", f"{purpose} failed: the prompt has {cap} tokens or more, and "
                         + prompt_cap_problem(cap, session.config.planned_tokens),
                         "send a shorter prompt, or use an export whose tokenizer has no length limit below the "
                         "planned window (docs/openvino.md, \"Prompt length\")",
                         status=status, prompt_max_tokens=cap)
    if status != "FINISHED":
        hint = ("the request did not fit the KV cache (GenAI reports IGNORED for an out-of-memory condition): "
                "the cache holds fewer tokens than the plan" if status == "IGNORED" else "see the worker log")
        raise ChatFailed("status", f"{purpose} failed: generation ended with status {status}", hint, status=status)
    answer = answer_from_text(text, fam, "tool_calls" if PARSERS[fam](text, tools) else "stop", tools)
    # GenAI's own figures (worker._perf_metrics): the prompt's time to the first token, and the
    # generation rate after it (the first token comes with the prompt, as in llama-server's timings)
    ttft_ms, tpot_ms = _positive(out.get("ttft_ms")), _positive(out.get("tpot_ms"))
    return ChatReply(
        body=answer,
        template=f"the export's own ({fam} syntax)",
        supports_tools=True if renders_tools else None,
        prompt_tokens=int(out["prompt_tokens"]),
        generated_tokens=generated,
        prompt_ms=ttft_ms,
        generated_ms=(seconds * 1000 - (ttft_ms or 0.0)) if seconds > 0 else None,
        generation_tokens_per_s=1000 / tpot_ms if tpot_ms else None,
        facts={"family": fam, "forced": forced, "status": status, "text": text, "generation_seconds": seconds,
               "template_renders_tools": renders_tools},
    )


def _positive(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def tool_call_fix(cause: str, answer: ChatReply | None = None) -> str:
    """What the operator does about a failed tool call on OpenVINO: the export is the only lever."""
    fam = (answer.facts.get("family") if answer is not None else None) or "its own"
    return (f"The model does not call tools in its template's {fam} syntax, so its registry entry must not be "
            "auto-eligible")


class SessionChatEndpoint:
    """The grade's :class:`~grading.protocol.ChatEndpoint` on an OpenVINO session (``async with``).

    Prefix caching is off in every hotfit session, so each request starts from an empty cache:
    :meth:`reset` has nothing to erase (SLOT_FRESH_PROMPT)."""

    def __init__(self, session: OpenVinoSession, *, timeout_s: float = CHAT_TIMEOUT_S) -> None:
        self.session = session
        self.timeout_s = timeout_s

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def chat(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]],
                   **sampling: Any) -> ChatReply:
        request = {"messages": list(messages), "tools": list(tools), **sampling}
        return await call_tools(self.session, request, timeout_s=self.timeout_s, purpose="a grade step")

    async def reset(self) -> str:
        return SLOT_FRESH_PROMPT

    async def describe(self) -> ServerFacts:
        s = self.session
        return ServerFacts(model=s.plan.entry.name, model_path=str(s.ir_dir),
                           build=f"openvino-genai {s.opened.get('genai_version') or 'unknown'}",
                           context_tokens=s.config.capacity_tokens, slots=s.config.max_num_seqs)

    async def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> str | None:
        try:
            reply = await self.session.request("render", self.timeout_s, messages=list(messages), tools=list(tools))
        except (TimeoutError, WorkerGone):
            return None
        prompt = reply.get("prompt") if reply.get("ok") else None
        return prompt if isinstance(prompt, str) else None

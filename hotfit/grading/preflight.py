"""Template preflight: can the server's chat template carry a tool loop at all? (pure)

Mirrors llama.cpp's model-free ``tests/test-chat.cpp`` idea: render a canned conversation (the
tools, one assistant call, one tool result) through the server's own template
(llama-server's ``POST /apply-template``) and check that the tool names, the call's argument
value and the tool result all reach the prompt. If they do not, every later "no call" would be
the template's fault, so the grade stops as inconclusive (docs/grade.md).
Checked on the pinned build: with the Qwen3 template all four appear; with llama.cpp's ChatML
fallback (no template) only the tool result does.
"""

from __future__ import annotations

from typing import Any

from hotfit.grading.world import TOOLS

__all__ = ["PREFLIGHT_MESSAGES", "PREFLIGHT_TOOLS", "roundtrip_problem"]

_ARG_MARKER = "preflight-folder-7c1"
_RESULT_MARKER = "preflight-result-4e9"
PREFLIGHT_TOOLS: list[dict[str, Any]] = [TOOLS["list_dir"].openai(), TOOLS["make_dir"].openai()]
PREFLIGHT_MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You operate tools."},
    {"role": "user", "content": "What is in the folder?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call00000", "type": "function",
         "function": {"name": "list_dir", "arguments": '{"path": "' + _ARG_MARKER + '"}'}}]},
    {"role": "tool", "tool_call_id": "call00000", "content": '{"result": "' + _RESULT_MARKER + '"}'},
]


def roundtrip_problem(prompt: str) -> str | None:
    """None when the rendered prompt carries tools, the call and its result; else what is lost."""
    lost = [what for what, marker in (("the tool definitions", "make_dir"), ("the assistant's tool call", _ARG_MARKER),
                                      ("the tool result", _RESULT_MARKER)) if marker not in prompt]
    if not lost:
        return None
    return (f"the server's chat template drops {', '.join(lost)} (rendered through /apply-template): it cannot "
            "carry a tool loop; load the model's tool-capable template (--jinja --chat-template-file)")

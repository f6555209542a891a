"""stages.probe_tool_call: passes only for a parsed call of the probe tool; a prose answer fails
naming the template; a server that dies mid-probe is a clear error and leaves no process.

The real-server tests use the deterministic tool-call fixture (tests/gguf_fixtures.py): with the
pinned Qwen3 template it makes exactly one parsed call, with llama.cpp's ChatML fallback none."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import anyio
import pytest

from pipeline.errors import ToolCallProbeFailed
from stages.load import open_server
from stages.probe_tool_call import (
    PROBE_MAX_TOKENS,
    PROBE_REQUIRED_PARAM,
    PROBE_TOOL,
    PROBE_TOOL_NAME,
    judge_answer,
    probe_request,
    probe_tool_call,
)
from tests.gguf_fixtures import FixtureInfo, pinned_template, require_llama_server, write_tool_call_model
from tests.test_load import children_of, fixture_plan, process_gone


def _answer(calls: list[dict[str, Any]] | None = None, content: str | None = "") -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls is not None:
        message["tool_calls"] = calls
    return {"choices": [{"index": 0, "finish_reason": "tool_calls" if calls else "stop", "message": message}]}


def _call(name: str = PROBE_TOOL_NAME, arguments: Any = '{"text": "ping"}') -> dict[str, Any]:
    return {"type": "function", "id": "c1", "function": {"name": name, "arguments": arguments}}


# ---------------------------------------------------------------- pure core


def test_probe_schema_has_one_required_string_and_one_optional_boolean() -> None:
    params = PROBE_TOOL["function"]["parameters"]
    assert params["required"] == [PROBE_REQUIRED_PARAM]
    props = params["properties"]
    assert props[PROBE_REQUIRED_PARAM]["type"] == "string"
    optional = [k for k in props if k not in params["required"]]
    assert len(optional) == 1 and props[optional[0]]["type"] == "boolean"


def test_request_forces_a_call_greedily_with_a_bound() -> None:
    body = probe_request()
    assert body["tool_choice"] == "required"
    assert body["temperature"] == 0
    assert body["max_tokens"] == PROBE_MAX_TOKENS > 0
    assert body["tools"] == [PROBE_TOOL]
    assert "key" not in json.dumps(body).lower()


@pytest.mark.parametrize(
    ("answer", "passed", "reason"),
    [
        (_answer([_call()]), True, "parsed"),
        (_answer([_call(arguments='{"text": "", "loud": true}')]), True, "parsed"),
        (_answer([_call(arguments={"text": "x"})]), True, "parsed"),  # already-decoded object
        (_answer(None, "Sure! I would call hotfit_probe."), False, "answered in prose"),
        (_answer([], "text"), False, "answered in prose"),
        (_answer([_call(name="other")]), False, "called 'other'"),
        (_answer([_call(arguments='{"text": ')]), False, "not valid JSON"),
        (_answer([_call(arguments='["text"]')]), False, "not a JSON object"),
        (_answer([_call(arguments='{"loud": true}')]), False, "lack the required"),
        (_answer([_call(arguments='{"text": 3}')]), False, "lack the required"),
        ({"error": "x"}, False, "no choices"),
    ],
)
def test_judge_answer(answer: dict[str, Any], passed: bool, reason: str) -> None:
    verdict = judge_answer(answer)
    assert verdict.passed is passed
    assert reason in verdict.reason


# ---------------------------------------------------------------- real llama-server


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> FixtureInfo:
    return write_tool_call_model(tmp_path_factory.mktemp("models") / "tool-call.gguf")


def _open(info: FixtureInfo, run_dir: Path, template: Path | None = None, kv: str = "f16") -> Any:
    return open_server(
        fixture_plan(info, 32768, kv), info.path, binary=require_llama_server(), run_dir=run_dir,
        template_path=template, threads=1, warmup=False,
    )  # fmt: skip


@pytest.mark.llama
@pytest.mark.anyio
@pytest.mark.parametrize("kv", ["f16", "q8_0"])
async def test_fetched_template_makes_the_probe_pass(tool_model: FixtureInfo, tmp_path: Path, kv: str) -> None:
    template = pinned_template()
    async with _open(tool_model, tmp_path / "run", template, kv) as srv:
        result = await probe_tool_call(srv, timeout_s=60)
    assert result.verdict.passed
    assert result.verdict.tool_name == PROBE_TOOL_NAME
    assert isinstance(result.verdict.arguments, dict) and PROBE_REQUIRED_PARAM in result.verdict.arguments
    assert result.template == str(template)
    assert result.supports_tools is True
    assert result.prompt_tokens_per_s and result.prompt_tokens_per_s > 0
    assert result.generation_tokens_per_s and result.generation_tokens_per_s > 0
    record = json.loads((tmp_path / "run" / "probe-tool-call.json").read_text())
    assert record["outcome"] == "pass" and record["verdict"]["passed"] is True
    assert record["request"]["tool_choice"] == "required"
    assert record["answer"]["choices"][0]["message"]["tool_calls"]


@pytest.mark.llama
@pytest.mark.anyio
async def test_embedded_template_makes_the_probe_pass(tmp_path: Path) -> None:
    info = write_tool_call_model(tmp_path / "embedded.gguf", embed_template=True)
    async with _open(info, tmp_path / "run") as srv:
        result = await probe_tool_call(srv, timeout_s=60)
    assert result.verdict.passed
    assert result.template.startswith("embedded")


@pytest.mark.llama
@pytest.mark.anyio
async def test_no_template_fails_naming_the_cause_and_the_template(tool_model: FixtureInfo, tmp_path: Path) -> None:
    assert not tool_model.has_chat_template
    async with _open(tool_model, tmp_path / "run") as srv:
        with pytest.raises(ToolCallProbeFailed) as caught:
            await probe_tool_call(srv, timeout_s=60)
    err = caught.value
    assert err.details["cause"] == "prose"
    assert "ChatML fallback" in err.details["template"]
    assert "chat template" in (err.hint or "") and "ChatML fallback" in (err.hint or "")
    assert err.details["supports_tools"] is False
    record = json.loads((tmp_path / "run" / "probe-tool-call.json").read_text())
    assert record["outcome"] == "fail" and record["verdict"]["passed"] is False
    assert not record["answer"]["choices"][0]["message"].get("tool_calls")


@pytest.mark.llama
@pytest.mark.anyio
async def test_server_killed_mid_probe_is_a_clear_error_and_no_orphan(tool_model: FixtureInfo, tmp_path: Path) -> None:
    pid = 0
    async with _open(tool_model, tmp_path / "run", pinned_template()) as srv:
        pid = srv.pid
        os.kill(pid, signal.SIGSTOP)  # the request is accepted by the kernel and never answered...
        failure: list[ToolCallProbeFailed] = []

        async def probe() -> None:
            try:
                await probe_tool_call(srv, timeout_s=60)
            except ToolCallProbeFailed as exc:
                failure.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(probe)
            await anyio.sleep(0.5)
            os.kill(pid, signal.SIGKILL)  # ...until the server dies mid-probe
    assert failure, "the probe must fail when the server dies"
    err = failure[0]
    assert err.details["cause"] == "server_exited"
    assert "killed by SIGKILL" in str(err) and "during the tool-call probe" in str(err)
    assert process_gone(pid)
    assert children_of(os.getpid()) == []

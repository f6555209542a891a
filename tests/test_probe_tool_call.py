"""stages.probe_tool_call: passes only for a parsed call of the probe tool; a prose answer fails
naming the template; a server that dies mid-probe is a clear error and leaves no process.

The real-server tests use the deterministic tool-call fixture (tests/gguf_fixtures.py): with the
pinned Qwen3 template it makes exactly one parsed call, with llama.cpp's ChatML fallback none."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from hotfit.backends.llama_server.discovery import BuildInfo
from hotfit.core.errors import ToolCallProbeFailed
from hotfit.backends.llama_server.process import open_server
from hotfit.stages.probe_tool_call import (
    CALL_SCAN_MAX_CHARS,
    PROBE_MAX_TOKENS,
    PROBE_REQUIRED_PARAM,
    PROBE_TOOL,
    PROBE_TOOL_NAME,
    ToolCallVerdict,
    classify_failure,
    find_written_call,
    judge_answer,
    probe_request,
    probe_tool_call,
)
from tests.gguf_fixtures import FixtureInfo, pinned_template, require_llama_server, write_tool_call_model
from tests.polling import unread_request_bytes_at, wait_until_async
from tests.test_load import children_of, fixture_plan, process_gone

TIER = "unit"


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


CALL = '{"name": "hotfit_probe", "arguments": {"text": "ping"}}'
FENCE = "```"


@pytest.mark.parametrize(
    ("text", "name", "fenced"),
    [
        pytest.param(CALL, "hotfit_probe", False, id="bare"),
        pytest.param(f"  \n{CALL}\n", "hotfit_probe", False, id="bare-whitespace"),
        pytest.param(f"{FENCE}json\n{CALL}\n{FENCE}", "hotfit_probe", True, id="fenced-json"),
        pytest.param(f"Here is the call:\n{FENCE}\n{CALL}\n{FENCE}\nDone.", "hotfit_probe", True, id="fenced-plain"),
        pytest.param(f"{FENCE}json\n{CALL}", "hotfit_probe", True, id="fence-never-closed"),
        pytest.param(f"Sure! I will call it now: {CALL} Hope that helps.", "hotfit_probe", False, id="in-prose"),
        pytest.param('{"name": "hotfit_probe", "parameters": {"text": "ping"}}', "hotfit_probe", False,
                     id="parameters"),
        pytest.param('{"name": "other_tool", "arguments": {}}', "other_tool", False, id="other-tool"),
        pytest.param('{"name": "hotfit_probe", "arguments": "{\\"text\\": \\"ping\\"}"}', "hotfit_probe", False,
                     id="arguments-as-string"),
        pytest.param('{"type": "function", "function": {"name": "hotfit_probe", "arguments": {"text": "x"}}}',
                     "hotfit_probe", False, id="openai-shape"),
        pytest.param(f"[{CALL}, {CALL}]", "hotfit_probe", False, id="array-of-calls"),
        pytest.param(f'[{{"note": 1}}, {CALL}]', "hotfit_probe", False, id="array-call-second"),
        pytest.param(f'{{"tool_calls": [{CALL}]}}', "hotfit_probe", False, id="tool-calls-wrapper"),
        pytest.param(f'{{"thought": "x"}} then {CALL}', "hotfit_probe", False, id="after-other-json"),
        pytest.param(f"[{CALL}, ", "hotfit_probe", False, id="unclosed-array-complete-call-inside"),
        pytest.param('{"name": "hotfit_probe", "arguments": {"text": "ping"}', None, False, id="malformed-unclosed"),
        pytest.param("{'name': 'hotfit_probe', 'arguments': {'text': 'ping'}}", None, False, id="python-literal"),
        pytest.param('{"name": "hotfit_probe", "arguments": {"text": "ping",}}', None, False, id="trailing-comma"),
        pytest.param('{"name": "hotfit_probe"}', None, False, id="no-arguments"),
        pytest.param('{"name": "", "arguments": {}}', None, False, id="empty-name"),
        pytest.param('{"name": 3, "arguments": {}}', None, False, id="name-not-string"),
        pytest.param('{"name": "hotfit_probe", "arguments": 5}', None, False, id="arguments-not-object"),
        pytest.param('{"text": "ping"}', None, False, id="not-call-shaped"),
        pytest.param('[1, 2, {"a": "b"}]', None, False, id="array-not-calls"),
        pytest.param("I cannot call tools, sorry.", None, False, id="prose"),
        pytest.param("", None, False, id="empty"),
        pytest.param('{"a":' * 50_000, None, False, id="deep-unclosed-nesting"),
        pytest.param("[{" * 50_000, None, False, id="deep-array-nesting"),
        pytest.param("x" * 2_000_000 + CALL, None, False, id="call-past-the-scan-bound"),
        pytest.param(CALL + "x" * 2_000_000, "hotfit_probe", False, id="huge-after-call"),
        pytest.param('{"k": "v"} ' * 1000 + CALL, None, False, id="call-after-too-many-starts"),
    ],
)
def test_find_written_call(text: str, name: str | None, fenced: bool) -> None:
    found = find_written_call(text)
    if name is None:
        assert found is None, found
        return
    assert found is not None
    assert found.name == name and found.fenced is fenced
    assert found.names_probe_tool is (name == PROBE_TOOL_NAME)


def test_find_written_call_reads_only_the_bounded_prefix() -> None:
    pad = "x" * (CALL_SCAN_MAX_CHARS - len(CALL))
    assert find_written_call(pad + CALL) is not None  # ends exactly at the bound: seen
    assert find_written_call(pad + " " + CALL) is None  # one character past it: not read


def _prose(content: str | None, reasoning: str | None = None) -> ToolCallVerdict:
    return ToolCallVerdict(False, "answered in prose: no parsed tool call", content=content, finish_reason="stop",
                           reasoning_content=reasoning)


TPL = "/models/chat_template.jinja"


@pytest.mark.parametrize(
    ("verdict", "supports", "cause", "in_text", "not_in_text"),
    [
        pytest.param(_prose(CALL), True, "call_without_markers",
                     ["the model wrote its call without the template's tool-call markers", "bare JSON",
                      "reports the template supports tools", TPL], ["cannot express"], id="bare-supported"),
        pytest.param(_prose(f"{FENCE}json\n{CALL}\n{FENCE}"), True, "call_without_markers",
                     ["without the template's tool-call markers", "a ```json block"], ["cannot express"],
                     id="fenced-supported"),
        pytest.param(_prose("", f"I should call {CALL}"), True, "call_without_markers",
                     ["without the template's tool-call markers", "in its reasoning"], ["cannot express"],
                     id="in-reasoning"),
        pytest.param(_prose(CALL), None, "call_without_markers",
                     ["without the template's tool-call markers", "did not say whether the template supports tools"],
                     [], id="bare-unknown-support"),
        pytest.param(_prose(CALL), False, "prose",
                     ["cannot express tool calls", "supports_tools=false", "wrote bare JSON"],
                     ["without the template's tool-call markers"], id="bare-unsupported"),
        pytest.param(_prose("I would call the tool."), False, "prose", ["cannot express tool calls"], [],
                     id="prose-unsupported"),
        pytest.param(_prose("I would call the tool."), None, "prose", ["cannot express tool calls"], [],
                     id="prose-unknown"),
        pytest.param(_prose("I would call the tool."), True, "ignored_tools",
                     ["answered in prose although the server reports the template supports tools"],
                     ["cannot express"], id="prose-supported"),
        pytest.param(_prose('{"text": "ping"}'), True, "ignored_tools", [], ["without the template's"],
                     id="json-not-call-shaped"),
        pytest.param(ToolCallVerdict(False, "called 'other', not 'hotfit_probe'", "other"), True, "bad_call",
                     ["did not match the probe schema"], ["cannot express"], id="bad-call"),
    ],
)
def test_classify_failure(verdict: ToolCallVerdict, supports: bool | None, cause: str, in_text: list[str],
                          not_in_text: list[str]) -> None:
    failure = classify_failure(verdict, supports, TPL)
    assert failure.cause == cause
    text = f"{failure.what} | {failure.likely}"
    for t in in_text:
        assert t in text, (t, text)
    for t in not_in_text:
        assert t not in text, (t, text)
    assert (failure.written_call is not None) is (cause == "call_without_markers" or "wrote" in failure.likely)


def test_judge_answer_keeps_reasoning_content_for_the_classifier() -> None:
    answer = _answer(None, "")
    answer["choices"][0]["message"]["reasoning_content"] = f"thinking... {CALL}"
    verdict = judge_answer(answer)
    assert not verdict.passed and verdict.reasoning_content == f"thinking... {CALL}"
    assert classify_failure(verdict, True, TPL).cause == "call_without_markers"


# ---------------------------------------------------------------- a scripted OpenAI-compatible stub


def _stub_binary(tmp_path: Path, supports_tools: bool | None, message: dict[str, Any],
                 api_key: bool = True, die_by: str | None = None) -> tuple[Path, Path]:
    """A 'llama-server' that is tests/openai_stub.py answering with ``message`` (no fixture model
    can be made to write a call as plain JSON: its output is fixed token by token)."""
    requests_log = tmp_path / "requests.jsonl"
    props = {} if supports_tools is None else {"chat_template_caps": {"supports_tools": supports_tools}}
    answer = {"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", **message}}],
              "timings": {"prompt_per_second": 100.0, "predicted_per_second": 10.0, "prompt_n": 50, "predicted_n": 20}}
    script = tmp_path / "stub-script.json"
    script.write_text(json.dumps({"props": props, "answer": answer, "requests_log": str(requests_log),
                                  "api_key": api_key, "die_by": die_by}))
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir(parents=True, exist_ok=True)
    stub = Path(__file__).resolve().parent / "openai_stub.py"
    binary.write_text(f'#!/bin/sh\nexec {sys.executable} {stub} --script {script} "$@"\n')
    binary.chmod(0o755)
    return binary, requests_log


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("supports", "message", "cause", "api_key"),
    [
        pytest.param(True, {"content": f"{FENCE}json\n{CALL}\n{FENCE}"}, "call_without_markers", True,
                     id="fenced-supported"),
        # a build that cannot take the key from the environment runs keyless: no empty Bearer header
        pytest.param(True, {"content": CALL}, "call_without_markers", False, id="bare-supported-keyless-build"),
        pytest.param(True, {"content": "", "reasoning_content": f"Calling: {CALL}"}, "call_without_markers", True,
                     id="reasoning-supported"),
        pytest.param(False, {"content": f"{FENCE}json\n{CALL}\n{FENCE}"}, "prose", True, id="fenced-unsupported"),
        pytest.param(True, {"content": "I would rather not."}, "ignored_tools", True, id="prose-supported"),
    ],
)
@pytest.mark.integration
async def test_probe_over_http_names_a_call_written_without_markers(
    tmp_path: Path, supports: bool, message: dict[str, Any], cause: str, api_key: bool
) -> None:
    """Through open_server and probe_tool_call over real HTTP on 127.0.0.1, against the scripted
    stub (tests/openai_stub.py), which enforces the API key like llama-server where it takes one."""
    info = write_tool_call_model(tmp_path / "m.gguf")
    binary, requests_log = _stub_binary(tmp_path, supports, message, api_key)
    async with open_server(fixture_plan(info, 32768), info.path, binary=binary, run_dir=tmp_path / "run",
                           template_path=pinned_template(), threads=1) as srv:
        with pytest.raises(ToolCallProbeFailed) as caught:
            await probe_tool_call(srv, timeout_s=30)
    err = caught.value
    assert err.details["cause"] == cause
    assert err.details["supports_tools"] is supports
    sent = [json.loads(line) for line in requests_log.read_text().splitlines()]
    assert len(sent) == 1 and sent[0]["tools"] == [PROBE_TOOL] and sent[0]["tool_choice"] == "required"
    record = json.loads((tmp_path / "run" / "probe-tool-call.json").read_text())
    assert record["outcome"] == "fail" and record["supports_tools"] is supports
    if cause == "call_without_markers":
        assert "the model wrote its call without the template's tool-call markers" in str(err)
        assert err.details["written_call"]["name"] == PROBE_TOOL_NAME
        assert "cannot express" not in str(err) + (err.hint or "")
        assert "trained with" in (err.hint or "")
    elif cause == "prose":
        assert "cannot express tool calls" in (err.hint or "")
    else:
        assert "cannot express" not in (err.hint or "")
    assert children_of(os.getpid()) == []


@pytest.mark.integration
@pytest.mark.anyio
async def test_server_dying_by_signal_during_the_probe_names_the_build_and_the_causes(tmp_path: Path) -> None:
    """The stub really dies by SIGSEGV when the probe arrives (a stand-in for a crash at the first
    inference: no binary here really crashes)."""
    info = write_tool_call_model(tmp_path / "m.gguf")
    binary, _ = _stub_binary(tmp_path, True, {"content": ""}, die_by="SEGV")
    build = BuildInfo("build-info.json", "0.5.0-dev", 1, "0c1e570", backend="cpu", variant="native",
                      cpu_features=("sse2",))
    async with open_server(fixture_plan(info, 32768), info.path, binary=binary, run_dir=tmp_path / "run",
                           template_path=pinned_template(), threads=1, build=build) as srv:
        with pytest.raises(ToolCallProbeFailed) as caught:
            await probe_tool_call(srv, timeout_s=30)
    err = caught.value
    assert err.details["cause"] == "server_exited" and err.details["signal"] == "SIGSEGV"
    assert err.details["returncode"] == -int(signal.SIGSEGV)
    assert "killed by SIGSEGV (segmentation fault) during the tool-call probe" in str(err)
    assert "cpu backend, native build" in str(err) and "built for 1 ISA features: sse2" in str(err)
    assert "dying by SIGSEGV" in str(err)  # the log tail
    assert "--backend cpu --force" in (err.hint or "") and "gdb -batch" in (err.hint or "")
    assert children_of(os.getpid()) == []


# ---------------------------------------------------------------- real llama-server


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> FixtureInfo:
    return write_tool_call_model(tmp_path_factory.mktemp("models") / "tool-call.gguf")


def _open(info: FixtureInfo, run_dir: Path, template: Path | None = None, kv: str = "f16") -> Any:
    # whether the GGUF embeds a template is verify's reading of the header; the fixture records it
    return open_server(
        fixture_plan(info, 32768, kv), info.path, binary=require_llama_server(), run_dir=run_dir,
        template_path=template, threads=1, warmup=False,
        embedded_template=info.has_chat_template,  # the header fact verify hands load
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
            await wait_until_async(lambda: unread_request_bytes_at(srv.port) > 0,
                                   "the probe's request to wait at the stopped server")
            os.kill(pid, signal.SIGKILL)  # ...until the server dies mid-probe
    assert failure, "the probe must fail when the server dies"
    err = failure[0]
    assert err.details["cause"] == "server_exited"
    assert "killed by SIGKILL" in str(err) and "during the tool-call probe" in str(err)
    assert process_gone(pid)
    assert children_of(os.getpid()) == []

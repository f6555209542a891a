"""stages.grade over scripted servers: each failure shape gets its exact outcome, stack failures
make the verdict inconclusive (never fail), runs are deterministic, the budget stops cleanly.

In process through httpx.MockTransport (the real HttpChatEndpoint code), and over a real HTTP
stub on 127.0.0.1, and through the CLI. No model is involved."""

from __future__ import annotations

import datetime as dt
import io
import json
from pathlib import Path
from typing import Any

import pytest

from hotfit.grading.runner import MODEL_FAILURES, NOT_RUN, STACK_FAILURES, STEP_LIMIT, find_call_markup
from hotfit.grading.scenarios import FORBID_ANY_CALL, FORBID_WRITES, SCENARIOS, scenarios_for
from hotfit.pipeline.cli import main
from hotfit.backends.http_chat import HttpChatEndpoint, facts_from
from hotfit.stages.grade import default_output_path, grade_endpoint
from tests import grade_scripts as gs
from tests.grade_scripts import ScriptedServer, http_stub
from tests.hubserver import free_port_closed

TIER = "unit"

pytestmark = pytest.mark.anyio

ALL = [s.id for s in SCENARIOS]
# scenarios with a turn where the reckless agent's immediate invented write is a minefield
WITH_FORBIDDEN_TURN = {"FS-3", "FS-4", "FS-5", "CAL-3", "CAL-4", "CAL-5", "SHOP-3", "SHOP-4"}
WITH_NO_CALL_TURN = {"FS-4", "FS-5", "SHOP-4"}


async def grade(agent: gs.Agent, tier: str = "full", **server_kw: Any) -> tuple[dict[str, Any], ScriptedServer]:
    server = ScriptedServer(agent, **server_kw)
    async with HttpChatEndpoint("http://scripted.invalid", transport=server.transport()) as endpoint:
        report = await grade_endpoint(endpoint, endpoint_label="scripted", tier=tier)
    return report, server


def outcomes(report: dict[str, Any]) -> dict[str, str]:
    return {s["id"]: s["outcome"] for s in report["scenarios"]}


def hashes(report: dict[str, Any]) -> list[str]:
    return [s["transcript_sha256"] for s in report["scenarios"]]


def test_the_scenarios_cover_what_the_expectations_below_assume() -> None:
    assert WITH_FORBIDDEN_TURN == {s.id for s in SCENARIOS if any(t.forbid for t in s.turns)}
    assert WITH_NO_CALL_TURN == {s.id for s in SCENARIOS if any(t.forbid == FORBID_ANY_CALL for t in s.turns)}
    assert all(t.forbid in (None, FORBID_ANY_CALL, FORBID_WRITES) for s in SCENARIOS for t in s.turns)


async def test_oracle_passes_every_scenario_with_a_slot_erase_each() -> None:
    report, server = await grade(gs.oracle)
    assert outcomes(report) == dict.fromkeys(ALL, "pass")
    assert report["verdict"] == {"verdict": "pass", "stack_problem": None, "reasons": [], "provisional": False}
    assert report["score"] == {"passed": 16, "total": 16, "fraction": 1.0}
    assert report["call_validity"] == 1.0
    assert server.erases == 16
    assert all(s["slot"] == "erased" and s["first_cache_n"] == 0 for s in report["scenarios"])
    assert report["categories"]["parallel"] == {"passed": 3, "total": 3, "fraction": 1.0}
    assert sum(s["parallel_steps"] for s in report["scenarios"]) >= 3
    # every request carries the fixed sampling block and the turn's tools
    assert all(r["temperature"] == 0 and r["seed"] == 42 and r["tool_choice"] == "auto"
               and r["parallel_tool_calls"] is True and r["stream"] is False for r in server.chat_requests)


async def test_quick_tier_pass_is_provisional() -> None:
    report, server = await grade(gs.oracle, tier="quick")
    assert [s["id"] for s in report["scenarios"]] == [s.id for s in scenarios_for("quick")]
    assert report["verdict"]["verdict"] == "pass" and report["verdict"]["provisional"] is True
    assert server.erases == 6


async def test_parallel_steps_issued_one_by_one_still_pass() -> None:
    report, _ = await grade(gs.sequential_oracle)
    assert outcomes(report) == dict.fromkeys(ALL, "pass")
    assert sum(s["parallel_steps"] for s in report["scenarios"]) == 0


async def test_never_calling_agent_fails_on_state_everywhere() -> None:
    report, _ = await grade(gs.never_calls)
    assert outcomes(report) == dict.fromkeys(ALL, "wrong_state")
    assert report["verdict"]["verdict"] == "fail" and report["verdict"]["stack_problem"] is None


async def test_reckless_agent_hits_the_minefields() -> None:
    report, _ = await grade(gs.reckless)
    assert outcomes(report) == {i: "forbidden_call" if i in WITH_FORBIDDEN_TURN else "wrong_state" for i in ALL}
    assert report["verdict"]["verdict"] == "fail"
    cal3 = next(s for s in report["scenarios"] if s["id"] == "CAL-3")
    assert cal3["detail"] == "turn 1: called the write tool 'create_event' before the user gave what it needs"


@pytest.mark.parametrize(("agent", "outcome", "where"), [
    (gs.call_in_content, "unparsed_call", "'<tool_call>' in content"),
    (gs.call_in_reasoning, "unparsed_call", "'<tool_call>' in reasoning_content"),
    (gs.bare_json_in_content, "unparsed_call", "a JSON tool call in content"),
    (gs.truncates, "truncated", "finish_reason 'length'"),
    (gs.truncates_parsed, "truncated", "finish_reason 'length'"),
    (gs.http_500_on_turn_2, "http_error", "turn 2 request 1: HTTP 500"),
    (gs.malformed_body, "malformed_body", "not JSON"),
    (gs.empty_choices, "malformed_body", "no choices[0].message"),
])
async def test_stack_failures_are_inconclusive_never_fail(agent: gs.Agent, outcome: str, where: str) -> None:
    report, _ = await grade(agent)
    assert outcomes(report) == dict.fromkeys(ALL, outcome)
    assert all(s["outcome_class"] == "stack" and where in s["detail"] for s in report["scenarios"])
    verdict = report["verdict"]
    assert verdict["verdict"] == "inconclusive"
    assert verdict["stack_problem"].startswith(f"{outcome} in 16 of 16 scenarios")


@pytest.mark.parametrize(("agent", "problem"), [
    (gs.unknown_tool_then_recovers, "no tool named 'frobnicate' is offered"),
    (gs.extra_argument_then_recovers, "unknown argument 'force'"),
    (gs.bad_json_then_recovers, "arguments are not valid JSON"),
])
async def test_invalid_calls_get_an_error_result_and_recovery_passes(agent: gs.Agent, problem: str) -> None:
    report, server = await grade(agent)
    assert outcomes(report) == dict.fromkeys(ALL, "pass")
    assert all(s["invalid_calls"] == 1 for s in report["scenarios"])
    bad = [c for s in report["scenarios"] for c in s["call_log"] if not c["valid"]]
    assert len(bad) == 16 and all(problem in c["problem"] for c in bad)
    # one bad call per scenario beside the reference's own: still below the floor, a model failure
    reference_calls = sum(len(list(s.reference_calls())) for s in SCENARIOS)
    assert report["call_validity"] == round(reference_calls / (reference_calls + 16), 4) < 0.9
    assert report["verdict"]["verdict"] == "fail" and report["verdict"]["stack_problem"] is None
    assert report["verdict"]["reasons"] == ["call validity 75% is below 90%"]
    # the model saw a structured error for its bad call
    tool_errors = [json.loads(m["content"]) for r in server.chat_requests for m in r["messages"]
                   if m["role"] == "tool" and problem.split("'")[0] in m["content"]]
    assert tool_errors and "error" in tool_errors[0]


async def test_unparseable_arguments_are_never_echoed_back() -> None:
    report, _ = await grade(gs.bad_json_then_recovers)
    echoed = [c["function"]["arguments"] for s in report["scenarios"] for m in s["transcript"]
              if m["role"] == "assistant" for c in m.get("tool_calls", [])]
    assert '{"path": ' not in echoed and all(json.loads(a) is not None for a in echoed)


async def test_unknown_tool_without_recovery_is_a_model_failure() -> None:
    report, _ = await grade(gs.unknown_tool_only)
    assert outcomes(report) == {i: "forbidden_call" if i in WITH_NO_CALL_TURN else "wrong_state" for i in ALL}
    assert report["call_validity"] == 0.0


async def test_endless_calling_hits_the_step_limit() -> None:
    report, _ = await grade(gs.loops_on_reads)
    assert outcomes(report) == dict.fromkeys(ALL, "step_limit")
    assert all(s["requests"] == STEP_LIMIT for s in report["scenarios"])
    assert all(o in MODEL_FAILURES for o in outcomes(report).values())


async def test_two_runs_give_identical_transcript_hashes_despite_random_call_ids() -> None:
    first, s1 = await grade(gs.oracle)
    second, s2 = await grade(gs.oracle)
    assert hashes(first) == hashes(second)
    assert len(set(hashes(first))) == 16
    # the server's ids differed (random), the prompts sent back did not
    assert [r["messages"] for r in s1.chat_requests] == [r["messages"] for r in s2.chat_requests]
    other, _ = await grade(gs.sequential_oracle)
    assert hashes(other) != hashes(first)


async def test_preflight_template_without_tools_is_inconclusive_and_sends_nothing() -> None:
    props = {"chat_template_caps": {"supports_tools": False}, "total_slots": 1, "build_info": "b1"}
    report, server = await grade(gs.oracle, props=props)
    assert report["verdict"]["verdict"] == "inconclusive"
    assert report["verdict"]["stack_problem"].startswith("preflight_failed: the server's chat template cannot")
    assert server.chat_requests == [] and report["scenarios"] == []


async def test_refused_slot_erase_falls_back_to_an_uncached_first_request() -> None:
    report, server = await grade(gs.oracle, tier="quick", erase_status=501)
    assert report["verdict"]["verdict"] == "pass"
    assert all(s["slot"] == "fresh_prompt" for s in report["scenarios"])
    assert any("cache_prompt:false" in n for n in report["determinism_notes"])
    first_of_scenario = [len([m for m in r["messages"] if m["role"] == "user"]) == 1
                         and not any(m["role"] == "assistant" for m in r["messages"]) for r in server.chat_requests]
    assert [r.get("cache_prompt") for r in server.chat_requests] == [False if f else None for f in first_of_scenario]
    assert sum(first_of_scenario) == 6


async def test_no_slot_erase_at_all_is_recorded_not_fatal() -> None:
    report, server = await grade(gs.oracle, tier="quick", erase_status=404)
    assert report["verdict"]["verdict"] == "pass"
    assert all(s["slot"] == "unsupported" for s in report["scenarios"])
    assert any("was not erased" in n for n in report["determinism_notes"])
    assert _cache_prompt_sent(server) == _uncached_first_requests(server)


def _first_of_scenario(server: ScriptedServer) -> list[bool]:
    return [len([m for m in r["messages"] if m["role"] == "user"]) == 1
            and not any(m["role"] == "assistant" for m in r["messages"]) for r in server.chat_requests]


def _cache_prompt_sent(server: ScriptedServer) -> list[object]:
    return [r.get("cache_prompt") for r in server.chat_requests]


def _uncached_first_requests(server: ScriptedServer) -> list[object]:
    return [False if first else None for first in _first_of_scenario(server)]


async def test_an_erased_slot_still_starts_each_scenario_uncached() -> None:
    # llama-server's RAM prompt cache (--cache-ram) puts an earlier run's prefix back into an erased
    # slot, so the erase alone does not make the first request start from nothing.
    report, server = await grade(gs.oracle, tier="quick")
    assert all(s["slot"] == "erased" for s in report["scenarios"])
    assert sum(_first_of_scenario(server)) == 6
    assert _cache_prompt_sent(server) == _uncached_first_requests(server)


async def test_budget_stops_cleanly_with_an_inconclusive_verdict() -> None:
    server = ScriptedServer(gs.hangs_on("FS-2"))  # the second quick scenario never gets an answer
    async with HttpChatEndpoint("http://scripted.invalid", transport=server.transport()) as endpoint:
        report = await grade_endpoint(endpoint, endpoint_label="scripted", tier="quick", budget_s=3.0)
    assert outcomes(report) == {"FS-1": "pass", "FS-2": NOT_RUN, "CAL-3": NOT_RUN, "CAL-5": NOT_RUN,
                                "SHOP-2": NOT_RUN, "SHOP-4": NOT_RUN}
    assert report["scenarios"][1]["detail"].startswith("budget: stopped after")
    assert report["scenarios"][2]["detail"] == "budget: not started"
    verdict = report["verdict"]
    assert verdict["verdict"] == "inconclusive"
    assert verdict["stack_problem"].startswith("budget: --budget-s 3 ran out during FS-2")


def test_fingerprint_facts_from_llama_server_props() -> None:
    props = {"model_path": "/m/x.gguf", "build_info": "b7000-abc", "total_slots": 1, "chat_template": "T",
             "chat_template_caps": {"supports_tools": True}, "default_generation_settings": {"n_ctx": 4096}}
    facts = facts_from(props, {"data": [{"id": "x.gguf"}]})
    assert (facts.model, facts.model_path, facts.build, facts.slots, facts.context_tokens, facts.supports_tools) == (
        "x.gguf", "/m/x.gguf", "b7000-abc", 1, 4096, True)
    assert facts.chat_template_sha256 == "e632b7095b0bf32c260fa4c539e9fd7b852d0de454e9be26f24d0d6f91d069d3"
    empty = facts_from({}, {})
    assert empty.model is None and empty.supports_tools is None and empty.chat_format is None


def test_markup_detection() -> None:
    assert find_call_markup("[TOOL_CALLS] [{...}]", "") == "'[TOOL_CALLS]' in content"
    assert find_call_markup("", "<function=list_dir>") == "'<function=' in reasoning_content"
    assert find_call_markup("I will list the folder with list_dir.", "thinking about {\"name\": 1}") is None
    assert find_call_markup('Sure: {"name": "x", "parameters": {}}', "") == "a JSON tool call in content"


# ---------------------------------------------------------------- a real HTTP stub on 127.0.0.1


@pytest.mark.integration
async def test_real_http_stub_gives_the_same_outcomes_and_hashes() -> None:
    in_process, _ = await grade(gs.oracle)
    server = ScriptedServer(gs.oracle, api_key="s3cret")
    with http_stub(server) as url:
        async with HttpChatEndpoint(url + "/v1", api_key="s3cret") as endpoint:
            report = await grade_endpoint(endpoint, endpoint_label=url, tier="full")
    assert outcomes(report) == dict.fromkeys(ALL, "pass")
    assert hashes(report) == hashes(in_process)
    assert server.erases == 16
    assert report["fingerprint"]["model"] == "scripted-model" and report["fingerprint"]["build"] == "b0000-scripted"
    assert report["fingerprint"]["model_sha256"] == "unknown" and report["fingerprint"]["flags"] == "unknown"


@pytest.mark.integration
async def test_real_http_stub_http_500_and_wrong_key() -> None:
    with http_stub(ScriptedServer(gs.http_500_on_turn_2)) as url:
        async with HttpChatEndpoint(url) as endpoint:
            report = await grade_endpoint(endpoint, endpoint_label=url, tier="quick")
    assert set(outcomes(report).values()) == {"http_error"}
    with http_stub(ScriptedServer(gs.oracle, api_key="right")) as url:
        async with HttpChatEndpoint(url, api_key="wrong") as endpoint:
            report = await grade_endpoint(endpoint, endpoint_label=url, tier="quick")
    assert set(outcomes(report).values()) == {"http_error"}
    assert "HTTP 401" in report["scenarios"][0]["detail"]
    assert report["verdict"]["verdict"] == "inconclusive"


@pytest.mark.integration
async def test_nothing_listening_is_an_inconclusive_http_error() -> None:
    url = f"http://127.0.0.1:{free_port_closed()}"
    async with HttpChatEndpoint(url) as endpoint:
        report = await grade_endpoint(endpoint, endpoint_label=url, tier="quick")
    assert set(outcomes(report).values()) == {"http_error"}
    assert "ConnectError" in report["scenarios"][0]["detail"]
    assert report["fingerprint"]["model"] == "unknown"


# ---------------------------------------------------------------- the CLI


def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(list(argv), out=out)
    return code, out.getvalue()


@pytest.mark.integration
def test_cli_grades_an_endpoint_writes_the_record_and_logs_events(hotfit_home: Path, tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    record = tmp_path / "grade.json"
    with http_stub(ScriptedServer(gs.oracle, api_key="s3cret")) as url:
        code, out = run_cli("--json", "--log-format", "json", "grade", "--endpoint", url, "--api-key-file",
                            str(key), "--tier", "quick", "--output", str(record))
    assert code == 0
    data = json.loads(out)
    assert data["verdict"]["verdict"] == "pass" and data["score"]["passed"] == 6
    assert "transcript" not in data["scenarios"][0]
    saved = json.loads(record.read_text())
    assert saved["scenarios"][0]["transcript"][0]["role"] == "system"
    assert saved["fingerprint"]["scenario_pack_sha256"] == data["fingerprint"]["scenario_pack_sha256"]
    events = [json.loads(line) for line in (hotfit_home / "logs" / "hotfit.jsonl").read_text().splitlines()]
    scenario_events = [e for e in events if e["event"] == "grade.scenario"]
    assert [e["scenario"] for e in scenario_events] == [s.id for s in scenarios_for("quick")]
    assert all(e["outcome"] == "pass" for e in scenario_events)
    assert "s3cret" not in (hotfit_home / "logs" / "hotfit.jsonl").read_text()


@pytest.mark.integration
def test_cli_exit_codes_and_default_output(hotfit_home: Path) -> None:
    with http_stub(ScriptedServer(gs.never_calls)) as url:
        code, out = run_cli("grade", "--endpoint", url, "--tier", "quick")
    assert code == 8
    assert "FAIL" in out and "wrong_state" in out
    written = list((hotfit_home / "grades").glob("grade-*-quick.json"))
    assert len(written) == 1
    with http_stub(ScriptedServer(gs.call_in_content)) as url:
        code, out = run_cli("grade", "--endpoint", url, "--tier", "quick")
    assert code == 9 and "stack problem: unparsed_call" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["grade"], "nothing is provisioned under"),
    (["grade", "--model", "x", "--endpoint", "http://127.0.0.1:1"], "--model and --endpoint both given"),
    (["grade", "--api-key-file", "/nonexistent/key"], "--api-key-file needs --endpoint"),
    (["grade", "--registry", "r.yaml"], "--registry/--probe-file need --model NAME"),
    (["grade", "--endpoint", "localhost:8080"], "is not an http(s) URL"),
    (["grade", "--endpoint", "http://127.0.0.1:1", "--budget-s", "0"], "must be a positive number"),
    (["grade", "--endpoint", "http://127.0.0.1:1", "--api-key-file", "/nonexistent/key"], "cannot read"),
])
def test_cli_usage_errors(hotfit_home: Path, argv: list[str], message: str) -> None:
    code, out = run_cli("--json", *argv)
    assert code == 2
    assert message in json.loads(out)["error"]["message"]


def test_default_output_path_is_under_home(tmp_path: Path) -> None:
    path = default_output_path(tmp_path, "full", dt.datetime(2026, 3, 2, 9, 30, tzinfo=dt.UTC))
    assert path == tmp_path / "grades" / "grade-20260302T093000Z-full.json"


def test_stack_and_model_failures_are_disjoint() -> None:
    assert not set(STACK_FAILURES) & set(MODEL_FAILURES)


async def test_template_roundtrip_that_drops_tool_calls_is_inconclusive() -> None:
    report, server = await grade(gs.oracle, renders="chatml")
    assert report["verdict"]["verdict"] == "inconclusive"
    assert report["verdict"]["stack_problem"].startswith(
        "preflight_failed: the server's chat template drops the tool definitions, the assistant's tool call")
    assert report["fingerprint"]["template_roundtrip"] == "failed"
    assert server.chat_requests == []


async def test_template_roundtrip_ok_or_unavailable() -> None:
    ok_report, _ = await grade(gs.oracle, tier="quick")
    assert ok_report["fingerprint"]["template_roundtrip"] == "ok"
    report, _ = await grade(gs.oracle, tier="quick", renders="none")  # not a llama-server: grade anyway
    assert report["fingerprint"]["template_roundtrip"] == "unavailable"
    assert report["verdict"]["verdict"] == "pass"

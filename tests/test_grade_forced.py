"""Forced packs: the grade against the REAL llama-server with an outcome known in advance.

The deterministic tool-call fixture (tests/gguf_fixtures.py :func:`write_tool_call_model`) is a
bigram model: under ``tool_choice: "auto"`` it ends its turn at once; under ``"required"`` the
server's tool grammar makes it emit exactly one call, filling each argument with the first value
the grammar leaves it (a free string closes at once: ``""``). The packs here narrow every forced
turn so that the grammar admits exactly ONE call:

- the turn's first request asks ``tool_choice: "required"`` (string form only, llama.cpp#26849);
  the next one is ``"auto"``, so the fixture ends the turn after its one call;
- the target tool's every argument is a single-value ``enum`` (strings, integers, a boolean, an
  array: each checked on the pinned build to come out as that value);
- each forced turn offers the target plus distractor tools of the real, free schemas (a write
  among them). The grammar admits a distractor's name too, so it is the greedy walk that cannot
  pick it: name characters all score the same for the fixture and greedy decoding takes the lowest
  token id among equal scores, i.e. the byte-wise smaller name at the first byte where two names
  differ (measured on the pinned build: ``list_events`` over ``make_dir``, ``add_to_cart`` over
  ``make_dir``). So every distractor's name sorts after its target's — an adaptation of the pack,
  not of the fixture (checked by :func:`test_every_distractor_loses_the_walk`). The grammar cannot
  rule an offered tool out by schema: an empty ``enum`` is refused (HTTP 400) and an unsatisfiable
  range makes the server fail mid-call.

What each pack proves is plumbing — template, grammar, parser, tool-result rendering, slots,
runner, verdict — not model quality: the forced-correct pack grades 100 % pass, the forced-wrong
pack (the enums force a wrong target or value) 0 % with ``wrong_state`` in every scenario and
verdict fail, and the same GGUF without a tool template is inconclusive (template), never fail.
The packs are test-only; :mod:`grading` only carries the mechanism (``Turn.tool_choice``,
``Turn.only_tools``, ``Turn.pinned``). Just over 400 lines: the packs are data, kept beside their tests.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from hotfit.grading.protocol import SAMPLING, ChatReply, ServerFacts
from hotfit.grading.report import GRADE_VERSION
from hotfit.grading.runner import run_scenario
from hotfit.grading.scenarios import (
    FORBID_ANY_CALL,
    FORBID_WRITES,
    SCENARIOS,
    Call,
    Scenario,
    Turn,
    comparable_state,
    expected_state,
    pack_hash,
    pinned_definition,
    scenarios_for,
    state_differences,
)
from hotfit.grading.schema import validate_arguments
from hotfit.grading.world import TOOLS, WRITE_TOOLS, ToolError, World, default_state
from hotfit.backends.http_chat import HttpChatEndpoint
from hotfit.stages.grade import grade_endpoint
from tests.gguf_fixtures import FixtureInfo, llama_server, write_tool_call_model

TIER = "unit"


def C(name: str, **args: Any) -> Call:
    return Call(name, args)


def _forced(user: str, right: Call, wrong: Call, distractors: tuple[str, ...], *, wrong_pack: bool,
            forbid: str | None = None, reads: tuple[Call, ...] = ()) -> Turn:
    """A turn whose one admissible call is ``right`` (or ``wrong`` in the wrong pack); the reference
    solution is always ``right``, so the wrong pack's expected end state is the correct one."""
    assert wrong.name == right.name, "the wrong pack forces a wrong value of the same tool"
    pinned = wrong if wrong_pack else right
    return Turn(user, ((right,),), "Done.", forbid=forbid, required_reads=reads, tool_choice="required",
                only_tools=(right.name, *distractors), pinned={pinned.name: pinned.args})


def forced_pack(*, wrong: bool) -> tuple[Scenario, ...]:
    w = wrong
    drafts = default_state()
    drafts["files"]["dirs"].append("old_drafts")
    drafts["files"]["files"].update({"old_drafts/draft-a.txt": "first try\n", "old_drafts/draft-b.txt": "second\n"})
    files_tools = ("make_dir", "move", "search_products", "write_file")
    return (
        Scenario(
            "FORCED-FS", "base", "make a folder, move a file into it, then a request no tool serves",
            files_tools,
            (
                _forced("Create the folder archive/logs.", C("make_dir", path="archive/logs"),
                        C("make_dir", path="archive/log"), ("search_products", "write_file"), wrong_pack=w),
                _forced("Move scratch/app-1.log into it.",
                        C("move", src="scratch/app-1.log", dst="archive/logs/app-1.log"),
                        C("move", src="scratch/app-2.log", dst="archive/log/app-2.log"),
                        ("search_products", "write_file"), wrong_pack=w),
                # "auto": the fixture ends its turn without a call, as a no-call turn asks
                Turn("What will the weather be in Lisbon tomorrow?", (), "I can't look that up.",
                     forbid=FORBID_ANY_CALL, only_tools=files_tools),
            ),
            default_state(), frozenset({"forced"}),
        ),
        Scenario(
            "FORCED-SHOP", "base", "add to the cart, change the quantity, check out to the saved address",
            ("add_to_cart", "create_event", "list_dir"),
            (
                _forced("Add two packs of AA batteries to my cart.", C("add_to_cart", sku="BAT-AA-4", quantity=2),
                        C("add_to_cart", sku="BAT-AAA-4", quantity=2), ("create_event", "list_dir"), wrong_pack=w),
                _forced("Make it three.", C("set_quantity", sku="BAT-AA-4", quantity=3),
                        C("set_quantity", sku="BAT-AAA-4", quantity=3), ("view_cart", "write_file"), wrong_pack=w),
                _forced("Check out and ship to my saved home address.", C("checkout", address_id="addr-1"),
                        C("checkout", address="1 Wrong Road, Nowhere"), ("create_event", "list_dir"), wrong_pack=w),
            ),
            default_state(), frozenset({"forced"}),
        ),
        Scenario(
            "FORCED-CAL", "base", "read a day, cancel an event by id, book a call with an attendee",
            ("list_events", "search_products", "write_file"),
            (
                _forced("What's on my calendar on Monday 2 March?", C("list_events", date="2026-03-02"),
                        C("list_events", date="2026-03-03"), ("search_products", "write_file"), wrong_pack=w,
                        forbid=FORBID_WRITES, reads=(C("list_events", date="2026-03-02"),)),
                _forced("Cancel the Team sync.", C("cancel_event", event_id="evt-0001"),
                        C("cancel_event", event_id="evt-0002"), ("create_event", "write_file"), wrong_pack=w),
                _forced("Book a 30-minute 'Roadmap call' with priya@example.com on Friday 6 March at 14:00.",
                        C("create_event", title="Roadmap call", date="2026-03-06", start="14:00", duration_min=30,
                          attendees=["priya@example.com"]),
                        C("create_event", title="Roadmap call", date="2026-03-06", start="15:00", duration_min=30,
                          attendees=["priya@example.com"]),
                        ("search_products", "write_file"), wrong_pack=w),
            ),
            default_state(), frozenset({"forced"}),
        ),
        Scenario(
            "FORCED-RECOVER", "error_recovery", "a delete the tool refuses (folder not empty), then recursive",
            ("delete", "list_events", "write_file"),
            (
                _forced("Please get rid of the old_drafts folder.", C("delete", path="old_drafts"),
                        C("delete", path="old_drafts"), ("list_events", "write_file"), wrong_pack=w),
                _forced("Yes, delete it with everything inside.", C("delete", path="old_drafts", recursive=True),
                        C("delete", path="old_drafts", recursive=False), ("list_events", "write_file"), wrong_pack=w),
            ),
            drafts, frozenset({"forced"}),
        ),
    )


FORCED_CORRECT = forced_pack(wrong=False)
FORCED_WRONG = forced_pack(wrong=True)


def _pinned_calls(scenario: Scenario) -> list[Call]:
    return [Call(name, args) for turn in scenario.turns for name, args in turn.pinned.items()]


def _replayed(scenario: Scenario, calls: Sequence[Call]) -> dict[str, Any]:
    world = World.from_state(scenario.initial)
    for call in calls:
        try:
            world.call(call.name, call.args)
        except ToolError:  # a refusal is part of the walk (FORCED-RECOVER's first delete)
            pass
    return world.state()


# ---------------------------------------------------------------- the packs and the mechanism (no model)


def test_the_forced_walk_is_the_reference_in_the_correct_pack_and_not_in_the_wrong_one() -> None:
    for right, wrong in zip(FORCED_CORRECT, FORCED_WRONG, strict=True):
        assert _pinned_calls(right) == list(right.reference_calls())
        good = comparable_state(expected_state(right))
        assert state_differences(good, comparable_state(_replayed(right, _pinned_calls(right)))) == []
        assert expected_state(wrong) == expected_state(right)  # same reference, same expected end state
        assert state_differences(good, comparable_state(_replayed(wrong, _pinned_calls(wrong)))) != [], wrong.id
    assert {s.id for s in FORCED_CORRECT} == {s.id for s in FORCED_WRONG}
    assert pack_hash(FORCED_CORRECT, grade_version=GRADE_VERSION) != pack_hash(FORCED_WRONG, grade_version=GRADE_VERSION)


def test_every_distractor_loses_the_walk() -> None:
    """Every forced turn offers at least two distractors (free schemas, as the real tools have them),
    each sorting after the target: the greedy walk takes the byte-wise smaller name (module docstring)."""
    write_distractor = False
    for scenario in (*FORCED_CORRECT, *FORCED_WRONG):
        for t, turn in enumerate(scenario.turns):
            if turn.tool_choice != "required":
                continue
            (target,) = turn.pinned
            defs = {d["function"]["name"]: d for d in scenario.tool_defs(t)}
            distractors = [name for name in defs if name != target]
            assert len(distractors) >= 2 and all(target < name for name in distractors), (scenario.id, t)
            assert all(defs[name] == TOOLS[name].openai() for name in distractors)
            write_distractor |= any(name in WRITE_TOOLS for name in distractors)
    assert write_distractor


def test_a_pinned_tool_offers_exactly_its_pinned_values() -> None:
    definition = pinned_definition("delete", {"path": "old_drafts", "recursive": True})
    assert definition["function"]["name"] == "delete"
    assert definition["function"]["parameters"] == {
        "type": "object", "additionalProperties": False, "required": ["path", "recursive"],
        "properties": {"path": {**TOOLS["delete"].properties["path"], "enum": ["old_drafts"]},
                       "recursive": {**TOOLS["delete"].properties["recursive"], "enum": [True]}}}


def test_a_malformed_forced_turn_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="tool_choice .* not one of auto, required, none"):
        Turn("x", (), "", tool_choice="function")  # the object form is what llama.cpp#26849 is about
    with pytest.raises(ValueError, match="pinned tool 'no_such_tool' does not exist"):
        Turn("x", (), "", pinned={"no_such_tool": {}})
    with pytest.raises(ValueError, match="pinned arguments of 'move': missing required argument 'dst'"):
        Turn("x", (), "", pinned={"move": {"src": "a"}})
    with pytest.raises(ValueError, match="pinned arguments of 'make_dir': unknown argument 'mode'"):
        Turn("x", (), "", pinned={"make_dir": {"path": "a", "mode": "755"}})


def test_the_real_packs_carry_no_forced_fields() -> None:
    assert all(t.tool_choice == "auto" and t.only_tools is None and not t.pinned for s in SCENARIOS for t in s.turns)
    assert not any({"tool_choice", "only_tools", "pinned"} & set(t) for s in SCENARIOS for t in s.to_json()["turns"])


class _Scripted:
    """An in-process ChatEndpoint answering each forced turn's first request with its pinned call,
    recording every request's tool_choice and tools."""

    def __init__(self, scenario: Scenario, arguments: Mapping[str, Any] | None = None) -> None:
        self.scenario = scenario
        self.arguments = arguments  # instead of the pinned ones (an out-of-enum call)
        self.requests: list[tuple[Any, list[str], list[Mapping[str, Any]]]] = []

    async def chat(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]],
                   **sampling: Any) -> ChatReply:
        self.requests.append((sampling.get("tool_choice"), [m["role"] for m in messages], list(tools)))
        turn = self.scenario.turns[sum(m["role"] == "user" for m in messages) - 1]
        if messages[-1]["role"] == "user" and sampling.get("tool_choice") == "required":
            ((name, args),) = turn.pinned.items()
            args = self.arguments if self.arguments is not None else args
            call = {"id": "x", "type": "function", "function": {"name": name, "arguments": json.dumps(dict(args))}}
            return ChatReply({"choices": [{"message": {"role": "assistant", "content": "", "tool_calls": [call]},
                                           "finish_reason": "tool_calls"}]})
        return ChatReply({"choices": [{"message": {"role": "assistant", "content": ""}, "finish_reason": "stop"}]})

    async def reset(self) -> str:
        return "erased"

    async def describe(self) -> ServerFacts:
        return ServerFacts()

    async def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> str | None:
        return None


@pytest.mark.anyio
async def test_the_runner_asks_required_on_a_forced_turns_first_request_only() -> None:
    scenario = FORCED_CORRECT[0]
    endpoint = _Scripted(scenario)
    result = await run_scenario(endpoint, scenario)
    assert result.outcome == "pass", result.detail
    # turn 1: required, then auto; turn 2: the same; turn 3 (no-call): auto only
    assert [r[0] for r in endpoint.requests] == ["required", "auto", "required", "auto", "auto"]
    assert endpoint.requests[0][2] == scenario.tool_defs(0)
    assert endpoint.requests[0][2][0]["function"]["parameters"]["properties"]["path"]["enum"] == ["archive/logs"]
    assert [c.name for c in result.calls] == ["make_dir", "move"]


@pytest.mark.anyio
async def test_a_real_scenario_sends_what_it_sent_before() -> None:
    """The mechanism changes nothing for the real packs: every request asks SAMPLING's tool_choice
    and offers the tools' own schemas."""
    scenario = scenarios_for("quick")[0]
    endpoint = _Scripted(scenario)
    await run_scenario(endpoint, scenario)
    assert {r[0] for r in endpoint.requests} == {SAMPLING["tool_choice"]}
    for t, (_, _, tools) in enumerate(endpoint.requests):
        assert tools == [TOOLS[name].openai() for name in scenario.tools_at(0)], t


@pytest.mark.anyio
async def test_a_call_outside_the_pinned_enum_is_an_invalid_call() -> None:
    """The runner checks a call against the schema it offered: a value the pinned enum does not
    admit is an invalid call, answered with a schema error, though the real tool would take it."""
    scenario = FORCED_CORRECT[0]
    assert validate_arguments(TOOLS["make_dir"].parameters, {"path": "archive/log"}) is None
    result = await run_scenario(_Scripted(scenario, arguments={"path": "archive/log"}), scenario)
    assert result.calls[0].problem == "argument 'path' must be one of ['archive/logs'], got 'archive/log'"
    assert result.invalid_calls == len(result.calls) == 2  # the move's pinned arguments are replaced as well
    assert result.outcome == "wrong_state"  # nothing ran: the folder was never made


# ---------------------------------------------------------------- the real llama-server

@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> FixtureInfo:
    return write_tool_call_model(tmp_path_factory.mktemp("models") / "tool-call.gguf", embed_template=True)


class _Recording:
    """HttpChatEndpoint, keeping each reply's cache_n in order (None marks a reset)."""

    def __init__(self, inner: HttpChatEndpoint) -> None:
        self.inner = inner
        self.log: list[int | None] = []

    async def chat(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]],
                   **sampling: Any) -> ChatReply:
        reply = await self.inner.chat(messages, tools, **sampling)
        self.log.append(reply.cache_n)
        return reply

    async def reset(self) -> str:
        self.log.append(None)
        return await self.inner.reset()

    async def describe(self) -> ServerFacts:
        return await self.inner.describe()

    async def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> str | None:
        return await self.inner.render(messages, tools)


async def _grade(url: str, pack: Sequence[Scenario], log: list[int | None] | None = None) -> dict[str, Any]:
    async with HttpChatEndpoint(url) as http:
        endpoint = _Recording(http)
        report = await grade_endpoint(endpoint, endpoint_label=url, tier="full", scenarios=pack)
    if log is not None:
        log.extend(endpoint.log)
    return report


async def _grade_embedded(embedded: FixtureInfo, pack: Sequence[Scenario]) -> dict[str, Any]:
    """Grade ``pack`` on a fresh llama-server (``--jinja``) serving the embedded-template fixture."""
    with llama_server(embedded.path, n_ctx=32768, extra_args=["--jinja"]) as srv:
        return await _grade(srv.base_url, pack)


def _calls(report: Mapping[str, Any]) -> dict[str, list[tuple[str, Any]]]:
    return {s["id"]: [(c["name"], c["arguments"]) for c in s["call_log"]] for s in report["scenarios"]}


def _pinned(pack: Sequence[Scenario]) -> dict[str, list[tuple[str, Any]]]:
    return {s.id: [(c.name, dict(c.args)) for c in _pinned_calls(s)] for s in pack}


def _assert_forced(report: Mapping[str, Any], pack: Sequence[Scenario], outcome: str, verdict: str) -> None:
    """What a forced pack gives whatever the grammar forces: every scenario ends ``outcome``, the verdict is
    ``verdict`` with no stack problem, and the calls are exactly the pinned ones, all valid."""
    assert {s["id"]: s["outcome"] for s in report["scenarios"]} == {s.id: outcome for s in pack}
    assert report["verdict"]["verdict"] == verdict and report["verdict"]["stack_problem"] is None
    assert _calls(report) == _pinned(pack)
    assert report["call_validity"] == 1.0


@pytest.mark.llama
@pytest.mark.anyio
async def test_forced_correct_pack_grades_100_percent_pass(embedded: FixtureInfo) -> None:
    report = await _grade_embedded(embedded, FORCED_CORRECT)
    # exactly the one admissible call per forced turn, no distractor, no call in the no-call turn
    _assert_forced(report, FORCED_CORRECT, "pass", "pass")
    assert report["score"] == {"passed": 4, "total": 4, "fraction": 1.0}
    # a tool refusal went back to the model and the scenario still passed (FORCED-RECOVER)
    recover = next(s for s in report["scenarios"] if s["id"] == "FORCED-RECOVER")
    assert '"code":"not_empty"' in next(m["content"] for m in recover["transcript"] if m["role"] == "tool")
    assert report["fingerprint"]["scenario_pack_sha256"] == pack_hash(FORCED_CORRECT, grade_version=GRADE_VERSION)
    assert report["fingerprint"]["template_roundtrip"] == "ok"


@pytest.mark.llama
@pytest.mark.anyio
async def test_forced_wrong_pack_grades_0_percent_wrong_state_fail(embedded: FixtureInfo) -> None:
    report = await _grade_embedded(embedded, FORCED_WRONG)
    _assert_forced(report, FORCED_WRONG, "wrong_state", "fail")  # the model did what the grammar forced: valid calls
    assert report["score"]["passed"] == 0 and report["score"]["total"] == 4
    shop = next(s for s in report["scenarios"] if s["id"] == "FORCED-SHOP")
    assert "shop.orders[0].items.BAT-AA-4: missing" in shop["detail"]
    assert "shop.orders[0].ship_to: expected '12 Elm Street, Springfield'" in shop["detail"]


@pytest.mark.llama
@pytest.mark.anyio
async def test_forced_pack_without_a_tool_template_is_inconclusive_not_fail(tmp_path: Path) -> None:
    """Without a template llama.cpp falls back to ChatML, which drops the tools: no grammar, so the
    fixture would end every turn and score 0 as if it were the model's fault; the preflight says
    it is the template."""
    plain = write_tool_call_model(tmp_path / "plain.gguf")
    with llama_server(plain.path, n_ctx=32768) as srv:
        report = await _grade(srv.base_url, FORCED_CORRECT)
    assert report["verdict"]["verdict"] == "inconclusive"
    assert report["verdict"]["stack_problem"].startswith("preflight_failed:")
    assert "template" in report["verdict"]["stack_problem"]
    assert report["scenarios"] == []


@pytest.mark.llama
@pytest.mark.anyio
async def test_forced_pack_is_deterministic_and_starts_each_scenario_from_an_erased_slot(
        embedded: FixtureInfo, tmp_path: Path) -> None:
    """Two runs, and a third on a fresh server that refuses the erase, give identical transcript
    hashes. On both runs each scenario's first request has cache_n == 0 while the next one reuses the
    scenario's own prefix. The second run is the case the erase alone did not cover: llama-server's
    RAM prompt cache (``--cache-ram``, on by default) restored the first run's prefix into the erased
    slot (measured: cache_n 1,755-2,025) until the first request went out with cache_prompt:false."""
    log: list[int | None] = []
    with llama_server(embedded.path, n_ctx=32768, extra_args=["--jinja", "--slot-save-path", str(tmp_path)]) as srv:
        first = await _grade(srv.base_url, FORCED_CORRECT, log)
        second = await _grade(srv.base_url, FORCED_CORRECT)
    unerased = await _grade_embedded(embedded, FORCED_CORRECT)
    hashes = [s["transcript_sha256"] for s in first["scenarios"]]
    assert len(set(hashes)) == len(FORCED_CORRECT)
    assert hashes == [s["transcript_sha256"] for s in second["scenarios"]]
    assert hashes == [s["transcript_sha256"] for s in unerased["scenarios"]]
    assert all(s["slot"] == "fresh_prompt" for s in unerased["scenarios"])
    for run in (first, second):
        assert all(s["slot"] == "erased" and s["first_cache_n"] == 0 for s in run["scenarios"])
        assert run["determinism_notes"] == []
    per_scenario: list[list[int | None]] = []
    for cache_n in log:
        if cache_n is None:  # a reset: the next scenario starts
            per_scenario.append([])
        else:
            per_scenario[-1].append(cache_n)
    assert len(per_scenario) == len(FORCED_CORRECT)
    assert all(s[0] == 0 and (s[1] or 0) > 0 for s in per_scenario), log

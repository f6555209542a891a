"""grading.scenarios: the pack is well formed, every reference solution is passable and scores
100 %, and the expected state is the replay of the reference (never written by hand)."""

from __future__ import annotations

import pytest

from hotfit.grading.report import GRADE_VERSION
from hotfit.grading.scenarios import (
    FORBID_ANY_CALL,
    FORBID_WRITES,
    QUICK,
    SCENARIOS,
    comparable_state,
    expected_state,
    inbox_listing,
    pack_hash,
    scenarios_for,
    state_differences,
)
from hotfit.grading.world import TOOLS, WRITE_TOOLS, ToolError, World

TIER = "unit"

# The only reference calls a tool refuses on purpose: the error-recovery scenario's first try.
EXPECTED_REFUSALS = {("FS-2", "delete", "not_empty")}
REQUIRED_CATEGORIES = {"base", "ask", "no_call", "parallel", "missing_function", "long_result", "error_recovery"}


def test_ids_unique_and_categories_covered_in_both_tiers() -> None:
    assert len({s.id for s in SCENARIOS}) == len(SCENARIOS) == 16
    assert {s.category for s in scenarios_for("full")} == REQUIRED_CATEGORIES
    quick = scenarios_for(QUICK)
    assert len(quick) == 6
    assert {s.category for s in quick} >= {"base", "ask", "no_call", "parallel", "missing_function",
                                           "error_recovery"}
    with pytest.raises(ValueError, match="unknown tier"):
        scenarios_for("medium")


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.id)
def test_scenario_shape(scenario) -> None:
    offered = scenario.tools
    assert all(t in TOOLS for i in range(len(scenario.turns)) for t in scenario.tools_at(i))
    assert len(set(offered)) == len(offered)
    # distractors: at least one read and one write tool from an environment the task does not use
    used_env = {c.name for c in scenario.reference_calls()}
    envs = [("list_dir", "read_file", "write_file", "make_dir", "move", "delete"),
            ("list_events", "find_free_slots", "create_event", "update_event", "cancel_event"),
            ("search_products", "get_product", "add_to_cart", "set_quantity", "view_cart", "saved_addresses",
             "checkout")]
    foreign = [t for t in offered if not any(t in env and used_env & set(env) for env in envs)]
    assert any(t in WRITE_TOOLS for t in foreign) and any(t not in WRITE_TOOLS for t in foreign), foreign
    assert len(scenario.turns) >= 2 and scenario.turns[0].forbid != FORBID_ANY_CALL  # scripted-server tests rely on it
    for i, turn in enumerate(scenario.turns):
        for call in (c for step in turn.steps for c in step):
            assert call.name in scenario.tools_at(i), f"reference calls {call.name} before it is offered"
            if turn.forbid == FORBID_WRITES:
                assert call.name not in WRITE_TOOLS
        if turn.forbid == FORBID_ANY_CALL:
            assert turn.steps == ()
        for read in turn.required_reads:
            assert read in [c for step in turn.steps for c in step]
        for fact in turn.must_say:
            assert fact.lower() in turn.reply.lower()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.id)
def test_reference_replays_cleanly_and_changes_state(scenario) -> None:
    world = World.from_state(scenario.initial)
    refusals = set()
    for call in scenario.reference_calls():
        try:
            world.call(call.name, call.args)
        except ToolError as exc:
            refusals.add((scenario.id, call.name, exc.code))
    assert refusals <= EXPECTED_REFUSALS
    assert world.state() == expected_state(scenario)
    # no scenario is passable by doing nothing
    assert state_differences(expected_state(scenario), World.from_state(scenario.initial).state())


def test_fs2_really_exercises_the_error() -> None:
    fs2 = next(s for s in SCENARIOS if s.id == "FS-2")
    with pytest.raises(ToolError, match="not empty"):
        World.from_state(fs2.initial).call("delete", {"path": "old_drafts"})


def test_long_listing_has_exactly_one_march_2026_invoice() -> None:
    names = inbox_listing()
    assert len(names) >= 140
    assert [n for n in names if n.startswith("inbox/invoice-2026-03-")] == ["inbox/invoice-2026-03-14.pdf"]
    assert inbox_listing() == names  # a function of nothing: deterministic


def test_state_comparison_is_loose_only_on_free_text() -> None:
    expected = {"calendar": {"events": [{"title": "Dentist", "start": "10:30"}]},
                "files": {"files": {"a.txt": "Rain on the roof"}}}
    same = {"calendar": {"events": [{"title": "Dentist appointment", "start": "10:30"}]},
            "files": {"files": {"a.txt": "Rain on the roof.\n"}}}
    assert state_differences(expected, same) == []
    wrong_time = {"calendar": {"events": [{"title": "Dentist", "start": "10:31"}]},
                  "files": {"files": {"a.txt": "Rain on the roof"}}}
    assert state_differences(expected, wrong_time) == ["calendar.events[0].start: expected '10:30', found '10:31'"]
    wrong_title = {"calendar": {"events": [{"title": "Doctor", "start": "10:30"}]},
                   "files": {"files": {"a.txt": "Rain"}}}
    assert len(state_differences(expected, wrong_title)) == 2


def test_end_state_check_ignores_ids_but_not_what_the_event_is() -> None:
    cal1 = next(s for s in SCENARIOS if s.id == "CAL-1")
    recreated = World.from_state(cal1.initial)  # a wrong event cancelled, the right one created anew
    recreated.call("create_event", {"title": "Dentist", "date": "2026-03-04", "start": "09:30", "duration_min": 45})
    recreated.call("cancel_event", {"event_id": "evt-0005"})
    recreated.call("create_event", {"title": "Dentist", "date": "2026-03-04", "start": "10:30", "duration_min": 45})
    assert recreated.state() != expected_state(cal1)
    assert state_differences(comparable_state(expected_state(cal1)), comparable_state(recreated.state())) == []
    recreated.call("update_event", {"event_id": "evt-0006", "duration_min": 30})
    assert state_differences(comparable_state(expected_state(cal1)), comparable_state(recreated.state())) == [
        "calendar.events.2026-03-04 10:30.duration_min: expected 45, found 30"]


def test_pack_hash_is_stable_and_covers_the_content() -> None:
    full = scenarios_for("full")
    assert pack_hash(full, grade_version=GRADE_VERSION) == pack_hash(scenarios_for("full"), grade_version=GRADE_VERSION)
    assert pack_hash(full, grade_version=GRADE_VERSION) != pack_hash(scenarios_for(QUICK), grade_version=GRADE_VERSION)
    assert pack_hash(full, grade_version=GRADE_VERSION) != pack_hash(full, grade_version="other")

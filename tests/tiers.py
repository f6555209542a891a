"""The suite's three tiers (CONTRIBUTING.md "Test tiers"): declared by each module, enforced here.

Every test module declares the tier of its tests with a module constant, ``TIER = "unit"``,
``"integration"`` or ``"e2e"``; one test of another tier says so on its function
(``@pytest.mark.integration``, or in ``pytest.param(..., marks=...)``), and a test that carries the
marker of a real part (llama, vulkan, openvino) is integration at least. This plugin (loaded by
tests/conftest.py) marks each test with its tier, so ``-m unit`` selects, and refuses to run — a
usage error naming each offender — when a module declares no tier or an unknown one, or when a tier
marker sits on a module or a class (``-m`` would then select a test by its module's marker as well
as its own).

While a unit test runs (set-up, call and tear-down), an audit hook refuses what a unit test may not
do: start a process or use a socket. The call raises, and the test fails even when the code under
test swallowed the error, naming the call. ``HOTFIT_TIER_SURVEY=FILE`` turns refusing into
recording, for every test: each line of FILE is a test's id, tab, the call it made — how to find
which tests of a module are pure before declaring it.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

TIERS = ("unit", "integration", "e2e")
REAL_PART_MARKERS = ("llama", "vulkan", "openvino")
# CPython's audit events (the "Audit events table" of the Python docs) for starting a process and
# for using a socket; creating a socket pair (asyncio's own wake-up pipe) raises none of them.
NOT_IN_A_UNIT_TEST = frozenset({
    "subprocess.Popen", "os.system", "os.posix_spawn", "os.spawn", "os.exec", "os.fork", "os.forkpty",
    "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
})
SURVEY_ENV = "HOTFIT_TIER_SURVEY"


class UnitTierViolation(RuntimeError):
    """A unit test started a process or used a socket."""


class _Guard:
    """The test now running under the guard, and what it did that a unit test may not."""

    def __init__(self) -> None:
        self.test_id: str | None = None
        self.calls: list[str] = []
        self.survey: Path | None = None


_GUARD = _Guard()
_hook_installed = False


def _describe(event: str, args: tuple[Any, ...]) -> str:
    shown = args[1] if event in ("subprocess.Popen", "socket.connect", "socket.bind", "os.exec") else args[:1]
    return f"{event} {shown!r}"[:200] + f" (thread {threading.current_thread().name})"


def _audit(event: str, args: tuple[Any, ...]) -> None:
    __tracebackhide__ = True  # pytest shows the test's frames, not this hook's
    test_id = _GUARD.test_id
    if test_id is None or event not in NOT_IN_A_UNIT_TEST:
        return
    call = _describe(event, args)
    if _GUARD.survey is not None:
        with _GUARD.survey.open("a", encoding="utf-8") as out:
            out.write(f"{test_id}\t{call}\n")
        return
    _GUARD.calls.append(call)
    raise UnitTierViolation(f"a unit test may start no process and use no socket: {call}")


def tier_problems(item: pytest.Item) -> tuple[str | None, list[str]]:
    """The tier of ``item`` and what is wrong with how it is declared (empty when nothing)."""
    module = getattr(item, "module", None)
    where = item.nodeid.split("::")[0]
    problems = []
    declared = getattr(module, "TIER", None)
    if declared not in TIERS:
        problems.append(f"{where}: declares no tier: add TIER = \"unit\", \"integration\" or \"e2e\" "
                        f"(CONTRIBUTING.md \"Test tiers\")" if declared is None else
                        f"{where}: TIER = {declared!r} is not one of {', '.join(TIERS)}")
    for node in item.listchain()[:-1]:
        if any(mark.name in TIERS for mark in node.own_markers):
            problems.append(f"{node.nodeid}: a tier marker on a module or class: the module's tier is its TIER "
                            "constant, and a test of another tier is marked on its own function")
    own = sorted({mark.name for mark in item.own_markers if mark.name in TIERS})
    if len(own) > 1:
        problems.append(f"{item.nodeid}: marked with more than one tier ({', '.join(own)})")
    needs = [name for name in REAL_PART_MARKERS if item.get_closest_marker(name) is not None]
    if own == ["unit"] and needs:
        problems.append(f"{item.nodeid}: marked unit and {', '.join(needs)} (a real part, so integration at least)")
    tier = own[0] if own else declared if declared in TIERS else None
    if tier == "unit" and needs:  # what needs a real part is integration at least, wherever it is declared
        tier = "integration"
    return tier, problems


def pytest_configure(config: pytest.Config) -> None:
    global _hook_installed
    survey = os.environ.get(SURVEY_ENV)
    _GUARD.survey = Path(survey) if survey else None
    if not _hook_installed:  # an audit hook cannot be removed: one per process, idle outside a unit test
        sys.addaudithook(_audit)
        _hook_installed = True


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    problems: list[str] = []
    for item in items:
        tier, wrong = tier_problems(item)
        problems += wrong
        if tier is not None and item.get_closest_marker(tier) is None:
            item.add_marker(tier)
    if problems:
        raise pytest.UsageError("test tiers (CONTRIBUTING.md \"Test tiers\"):\n  "
                                + "\n  ".join(dict.fromkeys(problems)))


def _guarded(item: pytest.Item) -> bool:
    return _GUARD.survey is not None or item.get_closest_marker("unit") is not None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    return (yield from _phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    return (yield from _phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Any:
    return (yield from _phase(item))


def _phase(item: pytest.Item) -> Any:
    _GUARD.test_id = item.nodeid if _guarded(item) else None
    try:
        return (yield)
    finally:
        _GUARD.test_id = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Any:
    report = yield
    if _GUARD.calls:  # failed even where the code under test caught the UnitTierViolation
        calls, _GUARD.calls = _GUARD.calls, []
        where = f"\n\n{report.longrepr}" if report.failed else ""  # the traceback: where the call was made
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} is a unit test, which may start no process and use no socket "
                           "(CONTRIBUTING.md \"Test tiers\"); it did:\n  " + "\n  ".join(calls)
                           + "\nmark it @pytest.mark.integration, or its module TIER = \"integration\"" + where)
    return report

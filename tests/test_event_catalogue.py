"""The event catalogue (docs/events.md) and the code agree: every event name the code can emit is
catalogued with the fields its calls pass, and every catalogued name is emitted somewhere.

Emitted names are found statically, by walking the AST of every module for calls to the logger
(``log.info("name", ...)`` and the engine's ``self._event(level, "name", ...)``). The first argument
must be a string literal, a conditional between literals, a local name assigned only such values in
the same function, or a call of a ``*_event`` method whose every implementation returns literals;
anything else fails here, so an event name can never be built where this cannot see it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

TIER = "unit"

REPO = Path(__file__).resolve().parent.parent
CATALOGUE = REPO / "docs" / "events.md"
PACKAGES = ("core", "registry", "state", "grading", "download", "backends", "stages", "pipeline")
LEVELS = frozenset({"debug", "info", "warning", "warn", "error", "critical", "exception", "msg"})
LOGGER_NAMES = frozenset({"log", "_log", "logger"})
NAME = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")


@dataclass
class Emitted:
    levels: set[str] = field(default_factory=set)
    fields: set[str] = field(default_factory=set)
    where: list[str] = field(default_factory=list)


def _modules(packages: tuple[str, ...] = PACKAGES) -> Iterator[tuple[str, ast.Module]]:
    for package in packages:
        for path in sorted((REPO / package).rglob("*.py")):
            yield str(path.relative_to(REPO)), ast.parse(path.read_text(encoding="utf-8"), str(path))


def _returned_literals(trees: list[tuple[str, ast.Module]], method: str) -> list[str] | None:
    """The literals every ``def method`` returns (None if one returns anything else)."""
    found: list[str] = []
    for _where, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == method:
                for ret in (n for n in ast.walk(node) if isinstance(n, ast.Return)):
                    values = _literals(ret.value, None, trees) if ret.value is not None else None
                    if values is None:
                        return None
                    found += values
    return found or None


def _literals(arg: ast.expr, scope: ast.AST | None, trees: list[tuple[str, ast.Module]]) -> list[str] | None:
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value]
    if isinstance(arg, ast.IfExp):
        a, b = _literals(arg.body, scope, trees), _literals(arg.orelse, scope, trees)
        return None if a is None or b is None else a + b
    if isinstance(arg, ast.Name) and scope is not None:
        values: list[str] = []
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == arg.id for t in node.targets):
                got = _literals(node.value, scope, trees)
                if got is None:
                    return None
                values += got
        return values or None
    if isinstance(arg, ast.Call) and isinstance(arg.func, (ast.Attribute, ast.Name)):
        name = arg.func.attr if isinstance(arg.func, ast.Attribute) else arg.func.id
        if name.endswith("_event"):
            return _returned_literals(trees, name)
    return None


def emitted_events(trees: list[tuple[str, ast.Module]]) -> tuple[dict[str, Emitted], list[str]]:
    """(event name -> levels, keyword fields, call sites; the call sites whose name is not a literal)."""
    events: dict[str, Emitted] = {}
    unresolved: list[str] = []
    for where, tree in trees:
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            func = node.func
            if func.attr in LEVELS and isinstance(func.value, ast.Name) and func.value.id in LOGGER_NAMES:
                if not node.args:
                    unresolved.append(f"{where}:{node.lineno}")
                    continue
                arg, level = node.args[0], func.attr
            elif func.attr == "_event" and len(node.args) >= 2:  # the engine's recorded-run events
                arg = node.args[1]
                level = str(node.args[0].value) if isinstance(node.args[0], ast.Constant) else "?"
            else:
                continue
            scope = min((f for f in functions if f.lineno <= node.lineno <= (f.end_lineno or f.lineno)),
                        key=lambda f: (f.end_lineno or f.lineno) - f.lineno, default=None)
            names = _literals(arg, scope, trees)
            if names is None:
                unresolved.append(f"{where}:{node.lineno} {ast.unparse(arg)}")
                continue
            keywords = {k.arg for k in node.keywords if k.arg is not None}
            for name in names:
                e = events.setdefault(name, Emitted())
                e.levels.add(level)
                e.fields |= keywords
                e.where.append(f"{where}:{node.lineno}")
    return events, unresolved


@dataclass(frozen=True)
class Catalogued:
    name: str
    levels: frozenset[str]
    fields: frozenset[str]


def catalogue(text: str) -> dict[str, Catalogued]:
    """The rows of docs/events.md's tables: | `name` | level[/level] | `field`, `field` | meaning |."""
    rows: dict[str, Catalogued] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not re.fullmatch(r"`[^`]+`", cells[0]):
            continue
        name = cells[0].strip("`")
        assert name not in rows, f"docs/events.md lists {name} twice"
        rows[name] = Catalogued(name, frozenset(cells[1].split("/")), frozenset(re.findall(r"`([^`]+)`", cells[2])))
    return rows


@pytest.fixture(scope="module")
def scanned() -> tuple[dict[str, Emitted], list[str]]:
    return emitted_events(list(_modules()))


@pytest.fixture(scope="module")
def documented() -> dict[str, Catalogued]:
    return catalogue(CATALOGUE.read_text(encoding="utf-8"))


def test_every_logger_call_names_its_event_where_it_can_be_read(scanned: tuple[dict[str, Emitted], list[str]]) -> None:
    events, unresolved = scanned
    assert not unresolved, "event names not written as literals: " + "; ".join(unresolved)
    assert {"run.start", "run.done", "command.done", "command.failed", "stage.fail", "serve.replanned",
            "recheck.kv_below_estimate"} <= set(events)  # the scanner sees every kind of call site
    bad = sorted(n for n in events if not NAME.match(n))
    assert not bad, f"event names must be dotted lower-case identifiers: {bad}"


def test_every_emitted_event_is_catalogued(scanned: tuple[dict[str, Emitted], list[str]],
                                           documented: dict[str, Catalogued]) -> None:
    events, _ = scanned
    missing = {n: e.where[0] for n, e in events.items() if n not in documented}
    assert not missing, f"emitted but not in docs/events.md: {missing}"


def test_every_catalogued_event_is_emitted(scanned: tuple[dict[str, Emitted], list[str]],
                                           documented: dict[str, Catalogued]) -> None:
    events, _ = scanned
    stale = sorted(set(documented) - set(events))
    assert not stale, f"docs/events.md lists events the code never emits: {stale}"


def test_every_field_a_call_passes_is_catalogued(scanned: tuple[dict[str, Emitted], list[str]],
                                                 documented: dict[str, Catalogued]) -> None:
    events, _ = scanned
    undocumented = {n: sorted(e.fields - documented[n].fields) for n, e in events.items()
                    if n in documented and e.fields - documented[n].fields}
    assert not undocumented, f"fields passed but not in docs/events.md: {undocumented}"
    levels = {n: (sorted(e.levels), sorted(documented[n].levels)) for n, e in events.items()
              if n in documented and documented[n].levels != e.levels}
    assert not levels, f"docs/events.md gives another level than the code: {levels}"


def test_the_checker_fails_on_an_uncatalogued_or_computed_event() -> None:
    source = ast.parse("log = get_logger()\n"
                       "def f(x):\n    log.info('demo.known', a=1)\n    log.warning('demo.' + x)\n"
                       "def g():\n    ev = 'demo.one' if f else 'demo.two'\n    log.info(ev, b=2)\n")
    events, unresolved = emitted_events([("demo.py", source)])
    assert set(events) == {"demo.known", "demo.one", "demo.two"} and events["demo.one"].fields == {"b"}
    assert unresolved == ["demo.py:4 'demo.' + x"]
    rows = catalogue("| `demo.known` | info | `a` | x |\n| `demo.gone` | info | | y |\n")
    assert set(events) - set(rows) == {"demo.one", "demo.two"} and set(rows) - set(events) == {"demo.gone"}


def test_what_commands_really_log_is_catalogued(tmp_path: Path, documented: dict[str, Catalogued]) -> None:
    """The dynamic half: events a few real commands write, each with no field the catalogue lacks."""
    import io
    import json

    from hotfit.planner.probe import Device, ProbeResult
    from hotfit.pipeline.cli import main

    home, probe = tmp_path / "home", tmp_path / "probe.json"
    probe.write_text(json.dumps(ProbeResult(devices=(Device(index=0, kind="cpu", name="host", total_bytes=64 << 30,
                                                            free_bytes=48 << 30),)).to_json()))
    for argv in (["plan", "--probe-file", str(probe)], ["auto", "--dry-run", "--probe-file", str(probe)],
                 ["status"], ["serve"], ["auto", "--bogus"]):
        main(["--home", str(home), "--log-format", "json", "--json", *argv], out=io.StringIO())
    common = {"event", "level", "timestamp", "run_id", "stage", "plan_id"}
    seen = [json.loads(line) for line in (home / "logs" / "hotfit.jsonl").read_text().splitlines()]
    assert {"plan.selected", "command.done", "command.failed"} <= {e["event"] for e in seen}
    for event in seen:
        row = documented.get(event["event"])
        assert row is not None, f"{event['event']} is logged but not catalogued"
        assert set(event) - common <= row.fields, (event["event"], set(event) - common - row.fields)

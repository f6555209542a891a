"""The grade's scenarios: scripted user turns over :mod:`grading.world`, written for hotfit.

Task ideas are modelled on the categories of public evaluations (BFCL multi-turn base /
miss_param / miss_func / long_context, When2Call's call / ask / cannot-answer split, ToolSandbox's
distraction tools); no task text or data is copied.

Each scenario carries a **reference solution**: per user turn, the model steps (each a tuple of
calls, more than one = parallel) and a final reply. The expected end state is never written by
hand: it is the state after replaying the reference calls on a fresh world
(:func:`expected_state`), so a scenario cannot demand a state no tool sequence reaches
(gorilla#1367). Free-text fields are compared by word containment, never equality.

Every scenario offers its environment's tools plus two distractor tools from another one (a read
and a write), and every scenario has at least two user turns and none starts with a no-call
turn (the scripted-server tests rely on both).

Forced packs (test-only; tests/test_grade_forced.py): a turn may narrow what the model is offered
so that the server's tool grammar admits exactly one call — ``only_tools`` (the tools of that turn
alone), ``pinned`` (each argument of a tool offered as a single-value ``enum``) and ``tool_choice``
(``"required"`` on the turn's first request). The scenarios below use none of them, and
:meth:`Turn.to_json` leaves the fields out at their defaults, so the pack hash does not change.

Over 400 lines because it is data: each scenario's script, tools and reference solution.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hotfit.grading.schema import validate_arguments
from hotfit.grading.world import TODAY, TOOLS, WRITE_TOOLS, ToolError, World, default_state

__all__ = [
    "FORBID_ANY_CALL",
    "FORBID_WRITES",
    "SCENARIOS",
    "SYSTEM_PROMPT",
    "TIERS",
    "TOOL_CHOICES",
    "Call",
    "Scenario",
    "Turn",
    "canonical_json",
    "comparable_state",
    "expected_state",
    "pack_hash",
    "pinned_definition",
    "scenarios_for",
    "state_differences",
]

FORBID_ANY_CALL = "any_call"  # no tool fits (irrelevance): any call is a minefield
FORBID_WRITES = "writes"  # a value is missing, or the needed tool is not offered yet: no state change
# Only the string form of tool_choice: the object form ({"type": "function", ...}) is not honoured
# alike by every chat-format handler (llama.cpp#26849).
TOOL_CHOICES = ("auto", "required", "none")

# Says what the assistant is and what "today" is; deliberately nothing like "ask when a value is
# missing", which would hand out the answer.
SYSTEM_PROMPT = (
    "You are an assistant that operates tools on the user's behalf: a workspace of folders and text "
    "files, a calendar, and an online shop. Today is Monday " + TODAY + ". Paths are relative to the "
    "workspace root. Use the tools to do what the user asks, then answer briefly."
)


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class Call:
    name: str
    args: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": dict(self.args)}


@dataclass(frozen=True)
class Turn:
    user: str
    steps: tuple[tuple[Call, ...], ...]  # reference: one entry per model request that calls tools
    reply: str  # reference: the final text answer of the turn
    forbid: str | None = None  # FORBID_ANY_CALL / FORBID_WRITES
    add_tools: tuple[str, ...] = ()  # offered from this turn on (BFCL miss_func)
    required_reads: tuple[Call, ...] = ()  # must appear among this turn's valid calls (args: a subset)
    must_say: tuple[str, ...] = ()  # the turn's final answer contains each (case-insensitive)
    # forced packs only (module docstring); the defaults leave a turn as the real packs have it
    tool_choice: str = "auto"  # of the turn's first request; the later ones keep the sampling's ("auto")
    only_tools: tuple[str, ...] | None = None  # offered in this turn instead of the scenario's tools
    pinned: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # tool -> {argument: the one value}

    def __post_init__(self) -> None:
        if self.tool_choice not in TOOL_CHOICES:
            raise ValueError(f"turn {self.user[:40]!r}: tool_choice {self.tool_choice!r} is not one of "
                             f"{', '.join(TOOL_CHOICES)} (only the string form is sent: llama.cpp#26849)")
        for name, args in self.pinned.items():
            if name not in TOOLS:
                raise ValueError(f"turn {self.user[:40]!r}: pinned tool {name!r} does not exist")
            problem = validate_arguments(TOOLS[name].parameters, dict(args))
            if problem:  # the one call the narrowed schema admits must be a valid call of the real tool
                raise ValueError(f"turn {self.user[:40]!r}: pinned arguments of {name!r}: {problem}")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"user": self.user, "steps": [[c.to_json() for c in s] for s in self.steps], "reply": self.reply,
               "forbid": self.forbid, "add_tools": list(self.add_tools),
               "required_reads": [c.to_json() for c in self.required_reads], "must_say": list(self.must_say)}
        # only when set: the real packs' JSON, hence their pack hash, stays what it was
        if self.tool_choice != "auto":
            out["tool_choice"] = self.tool_choice
        if self.only_tools is not None:
            out["only_tools"] = list(self.only_tools)
        if self.pinned:
            out["pinned"] = {name: dict(args) for name, args in sorted(self.pinned.items())}
        return out


@dataclass(frozen=True)
class Scenario:
    id: str
    category: str
    summary: str
    tools: tuple[str, ...]  # offered from the first turn, in this order
    turns: tuple[Turn, ...]
    initial: Mapping[str, Any]  # the world's initial state
    tiers: frozenset[str]

    def tools_at(self, turn_index: int) -> tuple[str, ...]:
        only = self.turns[turn_index].only_tools
        if only is not None:
            return only
        added = [t for turn in self.turns[: turn_index + 1] for t in turn.add_tools]
        return (*self.tools, *added)

    def tool_defs(self, turn_index: int) -> list[dict[str, Any]]:
        """The OpenAI tool definitions offered in a turn: the tools' own, except that a pinned tool
        offers exactly its pinned arguments, each a required single-value ``enum``, so a
        grammar-constrained server can emit one call of it only."""
        pinned = self.turns[turn_index].pinned
        return [pinned_definition(name, pinned[name]) if name in pinned else TOOLS[name].openai()
                for name in self.tools_at(turn_index)]

    def reference_calls(self) -> Iterable[Call]:
        for turn in self.turns:
            for step in turn.steps:
                yield from step

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "category": self.category, "summary": self.summary, "tools": list(self.tools),
                "turns": [t.to_json() for t in self.turns], "initial": self.initial, "tiers": sorted(self.tiers)}


def pinned_definition(name: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """Tool ``name`` narrowed to one admissible call: ``args`` (validated by :class:`Turn`)."""
    spec = TOOLS[name]
    definition = spec.openai()
    definition["function"]["parameters"] = {
        "type": "object",
        "properties": {k: {**spec.properties[k], "enum": [v]} for k, v in args.items()},
        "required": list(args),
        "additionalProperties": False,
    }
    return definition


def expected_state(scenario: Scenario) -> dict[str, Any]:
    """The end state the reference solution reaches on a fresh world (τ²'s gold replay).
    A reference call that the tool refuses is part of the solution (error-recovery scenarios)."""
    world = World.from_state(scenario.initial)
    for call in scenario.reference_calls():
        try:
            world.call(call.name, call.args)
        except ToolError:
            pass
    return world.state()


# ---------------------------------------------------------------- state comparison

_WORDY_FIELDS = frozenset({"title", "ship_to"})  # free text: the expected words must all appear


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9@.]+", text.lower().replace(",", " ")))


def _text_body(text: str) -> str:
    return text.strip().strip("\"'").rstrip(".").strip()


def comparable_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """What the end-state check compares: ids and id counters dropped (a model that cancels a
    wrong event and creates the right one has done the task; its event just has the next id),
    events keyed by when they are, orders without their ids."""
    s = json.loads(canonical_json(state))
    s["calendar"].pop("next_id", None)
    s["calendar"]["events"] = {f"{e['date']} {e['start']}": {k: v for k, v in e.items() if k != "id"}
                               for e in s["calendar"]["events"]}
    s["shop"].pop("next_order", None)
    s["shop"]["orders"] = [{k: v for k, v in o.items() if k != "id"} for o in s["shop"]["orders"]]
    return s


def _all_ids(items: list[Any]) -> bool:
    return bool(items) and all(isinstance(x, dict) and isinstance(x.get("id"), str) for x in items)


def state_differences(expected: Any, actual: Any, path: str = "") -> list[str]:
    """Pure: where ``actual`` differs from ``expected`` (empty = same end state)."""
    key = path.rsplit(".", 1)[-1]
    if isinstance(expected, dict) and isinstance(actual, dict):
        out: list[str] = []
        for k in sorted(set(expected) | set(actual)):
            sub = f"{path}.{k}" if path else str(k)
            if k not in actual:
                out.append(f"{sub}: missing")
            elif k not in expected:
                out.append(f"{sub}: unexpected {canonical_json(actual[k])[:120]}")
            else:
                out += state_differences(expected[k], actual[k], sub)
        return out
    if isinstance(expected, list) and isinstance(actual, list):
        if _all_ids(expected) and _all_ids(actual):  # records with ids (events): compare by id
            return state_differences({e["id"]: e for e in expected}, {a["id"]: a for a in actual}, path)
        if all(isinstance(x, str) for x in (*expected, *actual)) and path.endswith("dirs"):
            missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
            return ([f"{path}: missing {', '.join(missing)}"] if missing else []) + (
                [f"{path}: unexpected {', '.join(extra)}"] if extra else [])
        if len(expected) != len(actual):
            return [f"{path}: expected {len(expected)} items, found {len(actual)}: {canonical_json(actual)[:200]}"]
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in state_differences(e, a, f"{path}[{i}]")]
    if isinstance(expected, str) and isinstance(actual, str):
        if key in _WORDY_FIELDS:
            ok = _words(expected) <= _words(actual)
        elif path.startswith("files.files."):
            ok = _text_body(expected) == _text_body(actual)
        else:
            ok = expected == actual
        return [] if ok else [f"{path}: expected {expected!r}, found {actual!r}"]
    if isinstance(expected, (int, float)) and isinstance(actual, (int, float)) and not isinstance(actual, bool):
        return [] if abs(expected - actual) < 1e-9 else [f"{path}: expected {expected!r}, found {actual!r}"]
    return [] if expected == actual else [f"{path}: expected {expected!r}, found {actual!r}"]


# ---------------------------------------------------------------- the pack

FILES_TOOLS = ("list_dir", "read_file", "write_file", "make_dir", "move", "delete")
CALENDAR_TOOLS = ("list_events", "find_free_slots", "create_event", "update_event", "cancel_event")
SHOP_TOOLS = ("search_products", "get_product", "add_to_cart", "set_quantity", "view_cart", "saved_addresses",
              "checkout")
# one read and one write from another environment: choosing among tools is part of the task
DISTRACT_FILES = ("list_events", "add_to_cart")
DISTRACT_CALENDAR = ("search_products", "write_file")
DISTRACT_SHOP = ("list_dir", "create_event")
QUICK, FULL = "quick", "full"
TIERS = (QUICK, FULL)
_BOTH = frozenset({QUICK, FULL})
_FULL = frozenset({FULL})


def C(name: str, **args: Any) -> Call:
    return Call(name, args)


def _state(**parts: Any) -> dict[str, Any]:
    """The default world with some parts replaced: _state(files={...}) etc."""
    s = default_state()
    for env, changes in parts.items():
        s[env] = {**s[env], **changes}
    return s


def inbox_listing() -> dict[str, str]:
    """~150 deterministic file names for the long-result scenario, exactly one of them an
    invoice from March 2026 (the one to find)."""
    kinds = ("receipt", "invoice", "statement", "letter", "quote", "scan")
    grid = [f"inbox/{k}-{y}-{m:02d}-{d:02d}.pdf" for y in (2024, 2025, 2026) for m in range(1, 13)
            for d in (3, 9, 14, 21, 27) for k in kinds]
    names = {n: f"(pdf {i})" for i, n in enumerate(grid[::7]) if not n.startswith("inbox/invoice-2026-03-")}
    names["inbox/invoice-2026-03-14.pdf"] = "(pdf invoice march)"
    return names


def _files(**changes: Any) -> dict[str, Any]:
    base = default_state()["files"]
    return {"dirs": [*base["dirs"], *changes.get("add_dirs", [])],
            "files": {**base["files"], **changes.get("add_files", {})}}


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "FS-1", "base", "make a folder, move the log files found by listing, then report what is left",
        (*FILES_TOOLS, *DISTRACT_FILES),
        (
            Turn("Create the folder archive/logs and move the .log files that are in scratch into it.",
                 ((C("list_dir", path="scratch"),), (C("make_dir", path="archive/logs"),),
                  (C("move", src="scratch/app-1.log", dst="archive/logs/app-1.log"),
                   C("move", src="scratch/app-2.log", dst="archive/logs/app-2.log"))),
                 "Done: archive/logs now holds app-1.log and app-2.log."),
            Turn("What is left in scratch now?", ((C("list_dir", path="scratch"),),),
                 "Only todo.txt is left in scratch.", must_say=("todo.txt",)),
        ),
        _state(), _BOTH,
    ),
    Scenario(
        "FS-2", "error_recovery", "delete a folder that is not empty (the tool refuses first), then a file",
        (*FILES_TOOLS, *DISTRACT_FILES),
        (
            Turn("Please get rid of the old_drafts folder.",
                 ((C("delete", path="old_drafts"),), (C("delete", path="old_drafts", recursive=True),)),
                 "Deleted old_drafts and the two files in it."),
            Turn("Also delete notes/scratchpad.txt.", ((C("delete", path="notes/scratchpad.txt"),),),
                 "Deleted notes/scratchpad.txt."),
        ),
        _state(files=_files(add_dirs=["old_drafts"], add_files={
            "old_drafts/draft-a.txt": "first try\n", "old_drafts/draft-b.txt": "second try\n",
            "notes/scratchpad.txt": "temp\n"})),
        _BOTH,
    ),
    Scenario(
        "FS-3", "ask", "an ambiguous file to delete: ask which, then delete only that one",
        (*FILES_TOOLS, *DISTRACT_FILES),
        (
            Turn("Delete the budget spreadsheet in projects.", ((C("list_dir", path="projects"),),),
                 "There are two: budget-2024.xlsx and budget-2025.xlsx. Which one should I delete?",
                 forbid=FORBID_WRITES),
            Turn("The 2025 one.", ((C("delete", path="projects/budget-2025.xlsx"),),),
                 "Deleted projects/budget-2025.xlsx."),
        ),
        _state(), _FULL,
    ),
    Scenario(
        "FS-4", "long_result", "find one file in a listing of ~150 names and move it; then no call",
        (*FILES_TOOLS, *DISTRACT_FILES),
        (
            Turn("In inbox there is exactly one invoice from March 2026. Move it into the finance folder.",
                 ((C("list_dir", path="inbox"),),
                  (C("move", src="inbox/invoice-2026-03-14.pdf", dst="finance/invoice-2026-03-14.pdf"),)),
                 "Moved invoice-2026-03-14.pdf into finance."),
            Turn("Thanks, that's all for now.", (), "You're welcome!", forbid=FORBID_ANY_CALL),
        ),
        _state(files=_files(add_dirs=["inbox", "finance"], add_files=inbox_listing())), _FULL,
    ),
    Scenario(
        "FS-5", "no_call", "a request no tool serves (weather) between two file tasks",
        (*FILES_TOOLS, *DISTRACT_FILES),
        (
            Turn("Create a folder called poems.", ((C("make_dir", path="poems"),),), "Created the folder poems."),
            Turn("What will the weather be in Lisbon tomorrow?", (),
                 "I can't look up the weather with the tools I have.", forbid=FORBID_ANY_CALL),
            Turn('OK. Then save a file poems/rain.txt whose whole content is the line "Rain on the roof".',
                 ((C("write_file", path="poems/rain.txt", content="Rain on the roof"),),),
                 "Saved poems/rain.txt."),
        ),
        _state(), _FULL,
    ),
    Scenario(
        "FS-6", "parallel", "three folders at once, then a file in each",
        (*FILES_TOOLS, *DISTRACT_FILES),
        (
            Turn("Under projects, create three folders: alpha, beta and gamma.",
                 ((C("make_dir", path="projects/alpha"), C("make_dir", path="projects/beta"),
                   C("make_dir", path="projects/gamma")),),
                 "Created projects/alpha, projects/beta and projects/gamma."),
            Turn("Now put an empty file named README.md in each of those three folders.",
                 ((C("write_file", path="projects/alpha/README.md", content=""),
                   C("write_file", path="projects/beta/README.md", content=""),
                   C("write_file", path="projects/gamma/README.md", content="")),),
                 "Added an empty README.md to each folder."),
        ),
        _state(), _FULL,
    ),
    Scenario(
        "CAL-1", "base", "create an event, move it an hour later by its id, then say when it starts",
        (*CALENDAR_TOOLS, *DISTRACT_CALENDAR),
        (
            Turn("Add a 45-minute dentist appointment on Wednesday 4 March at 09:30.",
                 ((C("create_event", title="Dentist", date="2026-03-04", start="09:30", duration_min=45),),),
                 "Added the dentist appointment on 2026-03-04 at 09:30 for 45 minutes."),
            Turn("Move it one hour later.",
                 ((C("update_event", event_id="evt-0005", start="10:30"),),), "Moved it to 10:30."),
            Turn("When does it start now?", (), "It starts at 10:30 on Wednesday 4 March.", must_say=("10:30",)),
        ),
        _state(), _FULL,
    ),
    Scenario(
        "CAL-2", "base", "book the earliest free hour found by a tool, with attendees, then rename it",
        (*CALENDAR_TOOLS, *DISTRACT_CALENDAR),
        (
            Turn("Book a one-hour 'Design review' with lee@example.com and kim@example.com at the earliest "
                 "free time on Thursday 5 March.",
                 ((C("find_free_slots", date="2026-03-05", duration_min=60),),
                  (C("create_event", title="Design review", date="2026-03-05", start="10:00", duration_min=60,
                     attendees=["lee@example.com", "kim@example.com"]),)),
                 "Booked 'Design review' on Thursday 5 March at 10:00 with Lee and Kim."),
            Turn("Rename it to 'Design review v2'.",
                 ((C("update_event", event_id="evt-0005", title="Design review v2"),),), "Renamed it."),
        ),
        _state(), _FULL,
    ),
    Scenario(
        "CAL-3", "ask", "a meeting without day, time, length or title: ask, then create exactly that",
        (*CALENDAR_TOOLS, *DISTRACT_CALENDAR),
        (
            Turn("Set up a call with priya@example.com.", (),
                 "Sure. On which day and at what time, for how long, and what should I call it?",
                 forbid=FORBID_WRITES),
            Turn("Friday 6 March at 14:00, 30 minutes, titled 'Roadmap call'.",
                 ((C("create_event", title="Roadmap call", date="2026-03-06", start="14:00", duration_min=30,
                     attendees=["priya@example.com"]),),),
                 "Booked 'Roadmap call' with Priya on Friday 6 March at 14:00 for 30 minutes."),
        ),
        _state(), _BOTH,
    ),
    Scenario(
        "CAL-4", "parallel", "two days read at once and reported, then the right one cancelled",
        (*CALENDAR_TOOLS, *DISTRACT_CALENDAR),
        (
            Turn("What's on my calendar on Monday 2 March and on Tuesday 3 March?",
                 ((C("list_events", date="2026-03-02"), C("list_events", date="2026-03-03")),),
                 "Monday: Team sync at 14:00. Tuesday: 1:1 with Sam at 10:00.",
                 forbid=FORBID_WRITES,
                 required_reads=(C("list_events", date="2026-03-02"), C("list_events", date="2026-03-03")),
                 must_say=("Team sync", "Sam")),
            Turn("Cancel the Tuesday one.", ((C("cancel_event", event_id="evt-0002"),),),
                 "Cancelled the 1:1 with Sam."),
        ),
        _state(), _FULL,
    ),
    Scenario(
        "CAL-5", "missing_function", "cancelling is impossible until the tool is added; then cancel",
        tuple(t for t in (*CALENDAR_TOOLS, *DISTRACT_CALENDAR) if t != "cancel_event"),
        (
            Turn("Cancel the Team sync on Monday 2 March.", (),
                 "I can't cancel events with the tools I have.", forbid=FORBID_WRITES),
            Turn("I have just given you a tool for cancelling events. Please go ahead and cancel it now.",
                 ((C("list_events", date="2026-03-02"),), (C("cancel_event", event_id="evt-0001"),)),
                 "Cancelled the Team sync.", add_tools=("cancel_event",)),
        ),
        _state(), _BOTH,
    ),
    Scenario(
        "SHOP-1", "base", "add by search, change the quantity, check out to the saved address",
        (*SHOP_TOOLS, *DISTRACT_SHOP),
        (
            Turn("Add two packs of AA batteries to my cart.",
                 ((C("search_products", query="AA batteries"),), (C("add_to_cart", sku="BAT-AA-4", quantity=2),)),
                 "Added two packs of AA batteries."),
            Turn("Make it three.", ((C("set_quantity", sku="BAT-AA-4", quantity=3),),), "Now three packs."),
            Turn("Check out and ship to my saved home address.",
                 ((C("saved_addresses"),), (C("checkout", address_id="addr-1"),)),
                 "Ordered; it ships to 12 Elm Street, Springfield."),
        ),
        _state(), _FULL,
    ),
    Scenario(
        "SHOP-2", "parallel", "two products added at once, then the total read from the cart",
        (*SHOP_TOOLS, *DISTRACT_SHOP),
        (
            Turn("Add one USB-C cable and two A5 notebooks to my cart.",
                 ((C("search_products", query="USB-C cable"), C("search_products", query="A5 notebook")),
                  (C("add_to_cart", sku="CBL-USBC-1M", quantity=1), C("add_to_cart", sku="NTB-A5", quantity=2))),
                 "Added one USB-C cable and two A5 notebooks."),
            Turn("What is my cart total now?", ((C("view_cart"),),), "Your cart total is 13.45.",
                 must_say=("13.45",)),
        ),
        _state(), _BOTH,
    ),
    Scenario(
        "SHOP-3", "ask", "check out with no saved address: ask for one, then ship there",
        (*SHOP_TOOLS, *DISTRACT_SHOP),
        (
            Turn("Please check out my cart.", ((C("saved_addresses"),),),
                 "You have no saved address. Where should I ship the order?", forbid=FORBID_WRITES),
            Turn("Ship it to 4 Harbour Road, Portsmouth.", ((C("checkout", address="4 Harbour Road, Portsmouth"),),),
                 "Ordered; it ships to 4 Harbour Road, Portsmouth."),
        ),
        _state(shop={"addresses": [], "cart": {"KTL-BLUE": 1}}), _FULL,
    ),
    Scenario(
        "SHOP-4", "no_call", "a stock question, a weather question no tool serves, then an add",
        (*SHOP_TOOLS, *DISTRACT_SHOP),
        (
            Turn("Is the blue electric kettle in stock?", ((C("search_products", query="blue kettle"),),),
                 "Yes, the blue electric kettle is in stock."),
            Turn("And what's the weather going to be in Lisbon tomorrow?", (),
                 "I can't look up the weather with the tools I have.", forbid=FORBID_ANY_CALL),
            Turn("Fine. Add the blue kettle to my cart.", ((C("add_to_cart", sku="KTL-BLUE", quantity=1),),),
                 "Added the blue kettle to your cart."),
        ),
        _state(), _BOTH,
    ),
    Scenario(
        "SHOP-5", "base", "a price with odd cents: the answer must come from the tool, then add",
        (*SHOP_TOOLS, *DISTRACT_SHOP),
        (
            Turn("How much would two bags of the house espresso beans cost?",
                 ((C("search_products", query="house espresso"),),), "Two bags would cost 16.74.",
                 must_say=("16.74",)),
            Turn("Add them to my cart.", ((C("add_to_cart", sku="COF-ESP-250", quantity=2),),),
                 "Added two bags of house espresso beans."),
        ),
        _state(), _FULL,
    ),
)


def scenarios_for(tier: str) -> tuple[Scenario, ...]:
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r} (known: {', '.join(TIERS)})")
    return tuple(s for s in SCENARIOS if tier in s.tiers)


def pack_hash(scenarios: Iterable[Scenario], *, grade_version: str) -> str:
    """sha256 over everything a model sees or is judged by: scenarios, tool schemas, system prompt."""
    scenarios = tuple(scenarios)
    tools = sorted({t for s in scenarios for i in range(len(s.turns)) for t in s.tools_at(i)})
    blob = canonical_json({"grade_version": grade_version, "system": SYSTEM_PROMPT,
                           "tools": [TOOLS[t].openai() for t in tools],
                           "scenarios": [s.to_json() for s in scenarios]})
    return hashlib.sha256(blob.encode()).hexdigest()


def is_write(name: str) -> bool:
    return name in WRITE_TOOLS

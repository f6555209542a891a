"""The grade's stateful environments: a virtual file tree, a calendar and a shop (pure Python).

No I/O, no clock, no randomness: "today" is fixed, IDs are counters, results are plain JSON
values, so the same calls on the same initial state always give the same results and the same
end state (what lets a scenario's expected state be derived by replaying its reference solution,
the τ²-bench method, and what makes transcripts hashable).

Tools are dispatched by name to methods with schema-validated keyword arguments, never ``eval``
(BFCL's multi-turn checker evals call strings; that is not copied).
A tool that refuses (a missing file, a conflict) raises :class:`ToolError`; the runner turns it
into a structured result the model can recover from.

Over 400 lines: the environments and their tools, each a few dozen lines, kept together so each
tool table sits beside the state it changes.
"""

from __future__ import annotations

import copy
import datetime as _dt
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hotfit.grading.schema import validate_arguments

__all__ = ["TODAY", "TOOLS", "WRITE_TOOLS", "ToolError", "ToolSpec", "World", "default_state"]

TODAY = "2026-03-02"  # a Monday; the system prompt states it, so relative dates are derivable
WORKDAY_START_MIN = 9 * 60
WORKDAY_END_MIN = 17 * 60
SLOT_STEP_MIN = 30  # free slots start on the hour or half hour


class ToolError(Exception):
    """A tool refused: ``code`` is a stable identifier (not_found, conflict, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    properties: Mapping[str, Mapping[str, Any]]
    required: tuple[str, ...]
    writes: bool  # changes state: forbidden in ask / no-call / missing-function turns

    @property
    def parameters(self) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {k: dict(v) for k, v in self.properties.items()},
            "required": list(self.required),
            "additionalProperties": False,
        }

    def openai(self) -> dict[str, Any]:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def _s(desc: str) -> dict[str, Any]:
    return {"type": "string", "description": desc}


def _i(desc: str, minimum: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "integer", "description": desc}
    if minimum is not None:
        out["minimum"] = minimum
    return out


_PATH = _s("path relative to the workspace root, e.g. notes/todo.txt")
_DATE = _s("date as YYYY-MM-DD")
_TIME = _s("start time as HH:MM (24-hour)")

_SPECS: tuple[ToolSpec, ...] = (
    # files
    ToolSpec("list_dir", "List the entries of a folder (folders end with '/').", {"path": _PATH}, ("path",), False),
    ToolSpec("read_file", "Read a text file.", {"path": _PATH}, ("path",), False),
    ToolSpec("write_file", "Create or overwrite a text file; its folder must exist.",
             {"path": _PATH, "content": _s("the whole text of the file")}, ("path", "content"), True),
    ToolSpec("make_dir", "Create a folder (and any missing parent folders).", {"path": _PATH}, ("path",), True),
    ToolSpec("move", "Move or rename a file or folder; moving onto an existing folder puts it inside.",
             {"src": _PATH, "dst": _PATH}, ("src", "dst"), True),
    ToolSpec("delete", "Delete a file or folder. A folder that is not empty needs recursive=true.",
             {"path": _PATH, "recursive": {"type": "boolean", "description": "also delete what is inside"}},
             ("path",), True),
    # calendar
    ToolSpec("list_events", "List the calendar events on one day.", {"date": _DATE}, ("date",), False),
    ToolSpec("find_free_slots", "Free start times (09:00-17:00, every 30 minutes) for a meeting of a given length.",
             {"date": _DATE, "duration_min": _i("length in minutes", 5)}, ("date", "duration_min"), False),
    ToolSpec("create_event", "Create a calendar event.",
             {"title": _s("event title"), "date": _DATE, "start": _TIME, "duration_min": _i("length in minutes", 5),
              "attendees": {"type": "array", "items": {"type": "string"}, "description": "attendee e-mail addresses"}},
             ("title", "date", "start", "duration_min"), True),
    ToolSpec("update_event", "Change an event's title, date, start or length.",
             {"event_id": _s("event id, e.g. evt-0001"), "title": _s("new title"), "date": _DATE, "start": _TIME,
              "duration_min": _i("new length in minutes", 5)}, ("event_id",), True),
    ToolSpec("cancel_event", "Cancel (delete) a calendar event.", {"event_id": _s("event id, e.g. evt-0001")},
             ("event_id",), True),
    # shop
    ToolSpec("search_products", "Search the catalog by words in the product name.",
             {"query": _s("words to look for"), "max_price": {"type": "number", "description": "highest price"}},
             ("query",), False),
    ToolSpec("get_product", "Details of one product, with its price and stock.", {"sku": _s("product SKU")},
             ("sku",), False),
    ToolSpec("add_to_cart", "Add a quantity of a product to the cart.",
             {"sku": _s("product SKU"), "quantity": _i("how many", 1)}, ("sku", "quantity"), True),
    ToolSpec("set_quantity", "Set how many of a product are in the cart (0 removes it).",
             {"sku": _s("product SKU"), "quantity": _i("new quantity", 0)}, ("sku", "quantity"), True),
    ToolSpec("view_cart", "The cart's items and total.", {}, (), False),
    ToolSpec("saved_addresses", "The user's saved shipping addresses.", {}, (), False),
    ToolSpec("checkout", "Order the cart. Give a saved address_id or a full address, not both.",
             {"address_id": _s("id of a saved address"), "address": _s("full shipping address")}, (), True),
)
TOOLS: dict[str, ToolSpec] = {s.name: s for s in _SPECS}
WRITE_TOOLS = frozenset(s.name for s in _SPECS if s.writes)


def default_state() -> dict[str, Any]:
    """The world every scenario starts from unless it overrides a part (values are invented)."""
    return {
        "files": {
            "dirs": ["notes", "projects", "scratch"],
            "files": {
                "notes/ideas.md": "- a garden shed\n- learn the cello\n",
                "projects/budget-2024.xlsx": "(spreadsheet 2024)",
                "projects/budget-2025.xlsx": "(spreadsheet 2025)",
                "scratch/app-1.log": "started\nstopped\n",
                "scratch/app-2.log": "started\ncrashed\n",
                "scratch/todo.txt": "water the plants\n",
            },
        },
        "calendar": {
            "next_id": 5,
            "events": [
                {"id": "evt-0001", "title": "Team sync", "date": "2026-03-02", "start": "14:00",
                 "duration_min": 30, "attendees": []},
                {"id": "evt-0002", "title": "1:1 with Sam", "date": "2026-03-03", "start": "10:00",
                 "duration_min": 30, "attendees": ["sam@example.com"]},
                {"id": "evt-0003", "title": "Planning", "date": "2026-03-05", "start": "09:00",
                 "duration_min": 60, "attendees": []},
                {"id": "evt-0004", "title": "Lunch with Ana", "date": "2026-03-05", "start": "12:00",
                 "duration_min": 60, "attendees": ["ana@example.com"]},
            ],
        },
        "shop": {
            "catalog": [
                {"sku": "BAT-AA-4", "name": "AA batteries, pack of 4", "price": 4.99, "stock": 10},
                {"sku": "BAT-AAA-4", "name": "AAA batteries, pack of 4", "price": 5.49, "stock": 10},
                {"sku": "CBL-USBC-1M", "name": "USB-C cable, 1 m", "price": 7.25, "stock": 5},
                {"sku": "NTB-A5", "name": "A5 notebook, dotted", "price": 3.10, "stock": 20},
                {"sku": "KTL-BLUE", "name": "Electric kettle, blue", "price": 24.90, "stock": 2},
                {"sku": "KTL-RED", "name": "Electric kettle, red", "price": 24.90, "stock": 0},
                # a deliberately odd price: the total must come from the tool, not from a guess
                {"sku": "COF-ESP-250", "name": "House espresso beans, 250 g bag", "price": 8.37, "stock": 8},
            ],
            "cart": {},
            "addresses": [{"id": "addr-1", "label": "home", "line": "12 Elm Street, Springfield"}],
            "orders": [],
            "next_order": 1,
        },
    }


# ---------------------------------------------------------------- helpers


def _norm_path(path: str) -> str:
    parts = [p for p in path.strip().replace("\\", "/").split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise ToolError("bad_path", f"path {path!r} may not contain '..'")
    return "/".join(parts)


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


def _check_date(value: str) -> str:
    try:
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", value):
            raise ValueError
        _dt.date.fromisoformat(value)
    except ValueError:
        raise ToolError("bad_format", f"date {value!r} is not YYYY-MM-DD") from None
    return value


def _minutes(value: str) -> int:
    m = re.fullmatch(r"([01]\d|2[0-3]):([0-5]\d)", value)
    if not m:
        raise ToolError("bad_format", f"time {value!r} is not HH:MM (24-hour)")
    return int(m.group(1)) * 60 + int(m.group(2))


def _hhmm(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def _cents(price: float) -> int:
    return round(price * 100)


# ---------------------------------------------------------------- the world


@dataclass
class World:
    """All three environments; a scenario offers a subset of the tools. Mutable on purpose
    (tools change it), but a pure function of its initial state and the calls made."""

    state_: dict[str, Any] = field(default_factory=default_state)

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> World:
        return cls(copy.deepcopy(dict(state)))

    def state(self) -> dict[str, Any]:
        """Canonical snapshot: sorted where order carries no meaning."""
        s = copy.deepcopy(self.state_)
        s["files"]["dirs"] = sorted(set(s["files"]["dirs"]))
        s["files"]["files"] = dict(sorted(s["files"]["files"].items()))
        s["calendar"]["events"] = sorted(s["calendar"]["events"], key=lambda e: e["id"])
        for e in s["calendar"]["events"]:
            e["attendees"] = sorted(a.strip().lower() for a in e["attendees"])
        s["shop"]["cart"] = dict(sorted(s["shop"]["cart"].items()))
        return s

    def call(self, name: str, args: Mapping[str, Any]) -> Any:
        """Run tool ``name``; raises KeyError for no such tool, ValueError for bad arguments
        (the runner checks both first), :class:`ToolError` when the tool refuses."""
        spec = TOOLS[name]
        problem = validate_arguments(spec.parameters, dict(args))
        if problem:
            raise ValueError(problem)
        handler: Callable[..., Any] = getattr(self, f"_t_{name}")
        return handler(**args)

    # -- files
    @property
    def _fs(self) -> dict[str, Any]:
        return self.state_["files"]

    def _is_dir(self, p: str) -> bool:
        return p == "" or p in self._fs["dirs"]

    def _t_list_dir(self, path: str) -> Any:
        p = _norm_path(path)
        if p in self._fs["files"]:
            raise ToolError("not_a_directory", f"{path!r} is a file, not a folder")
        if not self._is_dir(p):
            raise ToolError("not_found", f"no folder {path!r}")
        prefix = p + "/" if p else ""
        names = {f[len(prefix):] for f in self._fs["files"] if f.startswith(prefix) and "/" not in f[len(prefix):]}
        names |= {d[len(prefix):] + "/" for d in self._fs["dirs"]
                  if d.startswith(prefix) and d != p and "/" not in d[len(prefix):]}
        return {"path": p or ".", "entries": sorted(names)}

    def _t_read_file(self, path: str) -> Any:
        p = _norm_path(path)
        if self._is_dir(p):
            raise ToolError("is_a_directory", f"{path!r} is a folder")
        if p not in self._fs["files"]:
            raise ToolError("not_found", f"no file {path!r}")
        return {"path": p, "content": self._fs["files"][p]}

    def _t_write_file(self, path: str, content: str) -> Any:
        p = _norm_path(path)
        if not p or self._is_dir(p):
            raise ToolError("is_a_directory", f"{path!r} is a folder")
        if not self._is_dir(_parent(p)):
            raise ToolError("not_found", f"folder {_parent(p)!r} does not exist; create it first")
        self._fs["files"][p] = content
        return {"written": p, "bytes": len(content.encode())}

    def _t_make_dir(self, path: str) -> Any:
        p = _norm_path(path)
        if not p or self._is_dir(p) or p in self._fs["files"]:
            raise ToolError("already_exists", f"{path!r} already exists")
        parts = p.split("/")
        for i in range(len(parts)):
            sub = "/".join(parts[: i + 1])
            if sub in self._fs["files"]:
                raise ToolError("not_a_directory", f"{sub!r} is a file")
            if sub not in self._fs["dirs"]:
                self._fs["dirs"].append(sub)
        return {"created": p}

    def _t_move(self, src: str, dst: str) -> Any:
        s, d = _norm_path(src), _norm_path(dst)
        if not s or (s not in self._fs["files"] and s not in self._fs["dirs"]):
            raise ToolError("not_found", f"no file or folder {src!r}")
        if self._is_dir(d):
            d = f"{d}/{s.rsplit('/', 1)[-1]}" if d else s.rsplit("/", 1)[-1]
        if d in self._fs["files"] or d in self._fs["dirs"]:
            raise ToolError("already_exists", f"{d!r} already exists")
        if not self._is_dir(_parent(d)):
            raise ToolError("not_found", f"folder {_parent(d)!r} does not exist; create it first")
        if d == s or d.startswith(s + "/"):
            raise ToolError("bad_path", f"cannot move {src!r} into itself")
        if s in self._fs["files"]:
            self._fs["files"][d] = self._fs["files"].pop(s)
        else:
            def moved(x: str) -> str:
                return d + x[len(s):] if x == s or x.startswith(s + "/") else x

            self._fs["dirs"] = [moved(x) for x in self._fs["dirs"]]
            self._fs["files"] = {moved(k): v for k, v in self._fs["files"].items()}
        return {"moved": s, "to": d}

    def _t_delete(self, path: str, recursive: bool = False) -> Any:
        p = _norm_path(path)
        if p in self._fs["files"]:
            del self._fs["files"][p]
            return {"deleted": p}
        if not p or p not in self._fs["dirs"]:
            raise ToolError("not_found", f"no file or folder {path!r}")
        inside = [x for x in [*self._fs["dirs"], *self._fs["files"]] if x.startswith(p + "/")]
        if inside and not recursive:
            raise ToolError("not_empty", f"folder {path!r} is not empty ({len(inside)} entries inside); "
                                         "pass recursive=true to delete it with its contents")
        self._fs["dirs"] = [x for x in self._fs["dirs"] if x != p and not x.startswith(p + "/")]
        self._fs["files"] = {k: v for k, v in self._fs["files"].items() if not k.startswith(p + "/")}
        return {"deleted": p, "entries_removed": len(inside)}

    # -- calendar
    @property
    def _cal(self) -> dict[str, Any]:
        return self.state_["calendar"]

    def _event(self, event_id: str) -> dict[str, Any]:
        for e in self._cal["events"]:
            if e["id"] == event_id.strip():
                return e
        raise ToolError("not_found", f"no event {event_id!r}")

    def _conflict(self, date: str, start: int, duration: int, ignore: str | None = None) -> None:
        for e in self._cal["events"]:
            if e["id"] == ignore or e["date"] != date:
                continue
            other = _minutes(e["start"])
            if start < other + e["duration_min"] and other < start + duration:
                raise ToolError("conflict", f"overlaps {e['id']} ({e['title']!r} at {e['start']})")

    def _t_list_events(self, date: str) -> Any:
        _check_date(date)
        day = sorted((e for e in self._cal["events"] if e["date"] == date), key=lambda e: e["start"])
        return {"date": date, "events": copy.deepcopy(day)}

    def _t_find_free_slots(self, date: str, duration_min: int) -> Any:
        _check_date(date)
        busy = [(_minutes(e["start"]), _minutes(e["start"]) + e["duration_min"])
                for e in self._cal["events"] if e["date"] == date]
        slots = [_hhmm(t) for t in range(WORKDAY_START_MIN, WORKDAY_END_MIN - duration_min + 1, SLOT_STEP_MIN)
                 if all(not (t < b_end and b_start < t + duration_min) for b_start, b_end in busy)]
        return {"date": date, "duration_min": duration_min, "free_starts": slots}

    def _t_create_event(self, title: str, date: str, start: str, duration_min: int,
                        attendees: list[str] | None = None) -> Any:
        _check_date(date)
        self._conflict(date, _minutes(start), duration_min)
        event = {"id": f"evt-{self._cal['next_id']:04d}", "title": title.strip(), "date": date, "start": start,
                 "duration_min": duration_min, "attendees": [a.strip().lower() for a in (attendees or [])]}
        self._cal["next_id"] += 1
        self._cal["events"].append(event)
        return {"created": copy.deepcopy(event)}

    def _t_update_event(self, event_id: str, title: str | None = None, date: str | None = None,
                        start: str | None = None, duration_min: int | None = None) -> Any:
        e = self._event(event_id)
        new = {**e, **{k: v for k, v in (("title", title), ("date", date), ("start", start),
                                           ("duration_min", duration_min)) if v is not None}}
        _check_date(new["date"])
        self._conflict(new["date"], _minutes(new["start"]), new["duration_min"], ignore=e["id"])
        new["title"] = new["title"].strip()
        e.update(new)
        return {"updated": copy.deepcopy(e)}

    def _t_cancel_event(self, event_id: str) -> Any:
        e = self._event(event_id)
        self._cal["events"].remove(e)
        return {"cancelled": e["id"]}

    # -- shop
    @property
    def _shop(self) -> dict[str, Any]:
        return self.state_["shop"]

    def _product(self, sku: str) -> dict[str, Any]:
        for p in self._shop["catalog"]:
            if p["sku"] == sku.strip().upper():
                return p
        raise ToolError("not_found", f"no product with SKU {sku!r}")

    def _t_search_products(self, query: str, max_price: float | None = None) -> Any:
        words = re.findall(r"[a-z0-9]+", query.lower())
        hits = []
        for p in self._shop["catalog"]:
            name_words = set(re.findall(r"[a-z0-9]+", p["name"].lower()))
            matches = words and all(w in name_words or w.rstrip("s") in name_words for w in words)
            if matches and (max_price is None or p["price"] <= max_price):
                hits.append({"sku": p["sku"], "name": p["name"], "price": p["price"], "in_stock": p["stock"] > 0})
        return {"query": query, "results": hits}

    def _t_get_product(self, sku: str) -> Any:
        return copy.deepcopy(self._product(sku))

    def _t_add_to_cart(self, sku: str, quantity: int) -> Any:
        p = self._product(sku)
        want = self._shop["cart"].get(p["sku"], 0) + quantity
        if want > p["stock"]:
            raise ToolError("out_of_stock", f"only {p['stock']} of {p['sku']} in stock")
        self._shop["cart"][p["sku"]] = want
        return {"sku": p["sku"], "quantity_in_cart": want}

    def _t_set_quantity(self, sku: str, quantity: int) -> Any:
        p = self._product(sku)
        if p["sku"] not in self._shop["cart"]:
            raise ToolError("not_in_cart", f"{p['sku']} is not in the cart")
        if quantity > p["stock"]:
            raise ToolError("out_of_stock", f"only {p['stock']} of {p['sku']} in stock")
        if quantity == 0:
            del self._shop["cart"][p["sku"]]
        else:
            self._shop["cart"][p["sku"]] = quantity
        return {"sku": p["sku"], "quantity_in_cart": quantity}

    def _cart_view(self) -> dict[str, Any]:
        items, total = [], 0
        for sku, qty in sorted(self._shop["cart"].items()):
            p = self._product(sku)
            items.append({"sku": sku, "name": p["name"], "quantity": qty, "unit_price": p["price"]})
            total += _cents(p["price"]) * qty
        return {"items": items, "total": round(total / 100, 2)}

    def _t_view_cart(self) -> Any:
        return self._cart_view()

    def _t_saved_addresses(self) -> Any:
        return {"addresses": copy.deepcopy(self._shop["addresses"])}

    def _t_checkout(self, address_id: str | None = None, address: str | None = None) -> Any:
        if not self._shop["cart"]:
            raise ToolError("empty_cart", "the cart is empty")
        if (address_id is None) == (address is None):
            raise ToolError("bad_request", "give exactly one of address_id or address")
        if address_id is not None:
            match = [a for a in self._shop["addresses"] if a["id"] == address_id.strip()]
            if not match:
                raise ToolError("not_found", f"no saved address {address_id!r}")
            ship_to = match[0]["line"]
        else:
            ship_to = (address or "").strip()
            if not ship_to:
                raise ToolError("no_address", "the address is empty")
        view = self._cart_view()
        for sku, qty in self._shop["cart"].items():
            self._product(sku)["stock"] -= qty
        order = {"id": f"ord-{self._shop['next_order']:04d}", "items": {i["sku"]: i["quantity"] for i in view["items"]},
                 "total": view["total"], "ship_to": ship_to}
        self._shop["next_order"] += 1
        self._shop["orders"].append(order)
        self._shop["cart"] = {}
        return {"ordered": copy.deepcopy(order)}

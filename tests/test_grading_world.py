"""grading.world and grading.schema: every tool, every error path, canonical state, no eval."""

from __future__ import annotations

from typing import Any

import pytest

from hotfit.grading.schema import validate_arguments
from hotfit.grading.world import TOOLS, WRITE_TOOLS, ToolError, World, default_state

TIER = "unit"


def world() -> World:
    return World.from_state(default_state())


def refuses(w: World, name: str, code: str, **args: Any) -> None:
    before = w.state()
    with pytest.raises(ToolError) as caught:
        w.call(name, args)
    assert caught.value.code == code
    assert w.state() == before, "a refused call must not change state"


# ---------------------------------------------------------------- schema


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        ({"path": "a"}, None),
        ({"path": "a", "recursive": True}, None),
        ({}, "missing required argument 'path'"),
        ({"path": 3}, "must be of type string"),
        ({"path": "a", "recursive": "yes"}, "must be of type boolean"),
        ({"path": "a", "force": True}, "unknown argument 'force'"),
        (["a"], "must be a JSON object"),
    ],
)
def test_validate_delete_arguments(args: Any, problem: str | None) -> None:
    result = validate_arguments(TOOLS["delete"].parameters, args)
    assert (result is None) if problem is None else (problem in (result or ""))


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        ({"sku": "X", "quantity": 2}, None),
        ({"sku": "X", "quantity": True}, "must be of type integer"),  # JSON true is not a number
        ({"sku": "X", "quantity": 2.5}, "must be of type integer"),
        ({"sku": "X", "quantity": 0}, "at least 1"),
    ],
)
def test_validate_integers(args: Any, problem: str | None) -> None:
    result = validate_arguments(TOOLS["add_to_cart"].parameters, args)
    assert (result is None) if problem is None else (problem in (result or ""))


def test_array_items_are_typed() -> None:
    params = TOOLS["create_event"].parameters
    base = {"title": "t", "date": "2026-03-04", "start": "09:00", "duration_min": 30}
    assert validate_arguments(params, {**base, "attendees": ["a@example.com"]}) is None
    assert "every item" in (validate_arguments(params, {**base, "attendees": [1]}) or "")


def test_every_schema_is_closed_and_flat() -> None:
    for spec in TOOLS.values():
        params = spec.parameters
        assert params["additionalProperties"] is False
        assert set(params["required"]) <= set(params["properties"])
        assert all(p["type"] in ("string", "integer", "number", "boolean", "array") for p in params["properties"].values())
        assert spec.openai()["function"]["name"] == spec.name


def test_call_checks_name_and_arguments_before_running() -> None:
    w = world()
    with pytest.raises(KeyError):
        w.call("eval", {"code": "1"})
    with pytest.raises(ValueError, match="unknown argument"):
        w.call("list_dir", {"path": ".", "extra": 1})


# ---------------------------------------------------------------- files


def test_list_dir() -> None:
    w = world()
    assert w.call("list_dir", {"path": "."})["entries"] == ["notes/", "projects/", "scratch/"]
    assert w.call("list_dir", {"path": "/scratch/"})["entries"] == ["app-1.log", "app-2.log", "todo.txt"]
    refuses(w, "list_dir", "not_found", path="nope")
    refuses(w, "list_dir", "not_a_directory", path="scratch/todo.txt")
    refuses(w, "list_dir", "bad_path", path="../etc")


def test_read_file() -> None:
    w = world()
    assert w.call("read_file", {"path": "scratch/todo.txt"}) == {"path": "scratch/todo.txt",
                                                                  "content": "water the plants\n"}
    refuses(w, "read_file", "not_found", path="scratch/none.txt")
    refuses(w, "read_file", "is_a_directory", path="scratch")


def test_write_file() -> None:
    w = world()
    w.call("write_file", {"path": "notes/new.txt", "content": "héllo"})
    assert w.state()["files"]["files"]["notes/new.txt"] == "héllo"
    w.call("write_file", {"path": "notes/new.txt", "content": "again"})  # overwrite
    assert w.state()["files"]["files"]["notes/new.txt"] == "again"
    refuses(w, "write_file", "not_found", path="nodir/x.txt", content="")
    refuses(w, "write_file", "is_a_directory", path="notes", content="")


def test_make_dir() -> None:
    w = world()
    w.call("make_dir", {"path": "a/b/c"})
    assert {"a", "a/b", "a/b/c"} <= set(w.state()["files"]["dirs"])
    refuses(w, "make_dir", "already_exists", path="a/b")
    refuses(w, "make_dir", "already_exists", path="scratch/todo.txt")
    refuses(w, "make_dir", "not_a_directory", path="scratch/todo.txt/sub")


def test_move_file_and_folder() -> None:
    w = world()
    w.call("move", {"src": "scratch/todo.txt", "dst": "notes/todo.txt"})  # rename into another folder
    w.call("move", {"src": "scratch/app-1.log", "dst": "notes"})  # onto a folder: inside it
    files = w.state()["files"]["files"]
    assert "notes/todo.txt" in files and "notes/app-1.log" in files and "scratch/todo.txt" not in files
    w.call("move", {"src": "scratch", "dst": "old"})  # a folder with its contents
    state = w.state()["files"]
    assert "old/app-2.log" in state["files"] and "scratch" not in state["dirs"] and "old" in state["dirs"]
    refuses(w, "move", "not_found", src="scratch/app-2.log", dst="x")
    refuses(w, "move", "already_exists", src="notes/todo.txt", dst="notes/ideas.md")
    refuses(w, "move", "not_found", src="notes/todo.txt", dst="nodir/todo.txt")
    refuses(w, "move", "bad_path", src="notes", dst="notes/inner")


def test_delete() -> None:
    w = world()
    w.call("delete", {"path": "scratch/todo.txt"})
    refuses(w, "delete", "not_empty", path="scratch")
    result = w.call("delete", {"path": "scratch", "recursive": True})
    assert result["entries_removed"] == 2
    assert "scratch" not in w.state()["files"]["dirs"]
    assert not any(k.startswith("scratch/") for k in w.state()["files"]["files"])
    w.call("make_dir", {"path": "empty"})
    w.call("delete", {"path": "empty"})  # an empty folder needs no recursive
    refuses(w, "delete", "not_found", path="empty")
    refuses(w, "delete", "not_found", path=".")


# ---------------------------------------------------------------- calendar


def test_list_events_sorted_and_checked() -> None:
    w = world()
    day = w.call("list_events", {"date": "2026-03-05"})["events"]
    assert [e["start"] for e in day] == ["09:00", "12:00"]
    assert w.call("list_events", {"date": "2026-03-09"})["events"] == []
    refuses(w, "list_events", "bad_format", date="5 March")
    refuses(w, "list_events", "bad_format", date="2026-02-30")


def test_find_free_slots() -> None:
    slots = world().call("find_free_slots", {"date": "2026-03-05", "duration_min": 60})["free_starts"]
    # Planning 09:00-10:00 and Lunch 12:00-13:00 are busy; the last hour starts at 16:00
    assert slots == ["10:00", "10:30", "11:00", "13:00", "13:30", "14:00", "14:30", "15:00", "15:30", "16:00"]


def test_create_update_cancel_event() -> None:
    w = world()
    created = w.call("create_event", {"title": " Dentist ", "date": "2026-03-04", "start": "09:30",
                                      "duration_min": 45, "attendees": ["B@example.com", "a@example.com"]})
    assert created["created"]["id"] == "evt-0005" and created["created"]["title"] == "Dentist"
    assert w.state()["calendar"]["events"][-1]["attendees"] == ["a@example.com", "b@example.com"]
    refuses(w, "create_event", "conflict", title="x", date="2026-03-04", start="10:00", duration_min=30)
    refuses(w, "create_event", "bad_format", title="x", date="2026-03-04", start="9:30", duration_min=30)
    refuses(w, "create_event", "bad_format", title="x", date="2026-03-04", start="24:00", duration_min=30)
    w.call("update_event", {"event_id": "evt-0005", "start": "10:30"})
    assert w.call("list_events", {"date": "2026-03-04"})["events"][0]["start"] == "10:30"
    w.call("update_event", {"event_id": "evt-0005", "start": "10:45"})  # overlapping only itself is fine
    refuses(w, "update_event", "not_found", event_id="evt-9999", title="x")
    refuses(w, "update_event", "conflict", event_id="evt-0004", start="09:30")  # onto Planning
    w.call("cancel_event", {"event_id": "evt-0005"})
    assert "evt-0005" not in [e["id"] for e in w.state()["calendar"]["events"]]
    refuses(w, "cancel_event", "not_found", event_id="evt-0005")
    # ids are counters, never reused
    assert w.call("create_event", {"title": "y", "date": "2026-03-09", "start": "09:00",
                                   "duration_min": 30})["created"]["id"] == "evt-0006"


# ---------------------------------------------------------------- shop


def test_search_and_get_product() -> None:
    w = world()
    assert [r["sku"] for r in w.call("search_products", {"query": "AA batteries"})["results"]] == ["BAT-AA-4"]
    assert [r["sku"] for r in w.call("search_products", {"query": "kettle"})["results"]] == ["KTL-BLUE", "KTL-RED"]
    assert [r["in_stock"] for r in w.call("search_products", {"query": "kettle"})["results"]] == [True, False]
    assert [r["sku"] for r in w.call("search_products", {"query": "notebooks"})["results"]] == ["NTB-A5"]
    assert w.call("search_products", {"query": "batteries", "max_price": 5.0})["results"][0]["sku"] == "BAT-AA-4"
    assert w.call("search_products", {"query": "weather"})["results"] == []
    assert w.call("get_product", {"sku": "cof-esp-250"})["price"] == 8.37
    refuses(w, "get_product", "not_found", sku="NOPE")


def test_cart() -> None:
    w = world()
    w.call("add_to_cart", {"sku": "KTL-BLUE", "quantity": 1})
    w.call("add_to_cart", {"sku": "KTL-BLUE", "quantity": 1})
    refuses(w, "add_to_cart", "out_of_stock", sku="KTL-BLUE", quantity=1)
    refuses(w, "add_to_cart", "out_of_stock", sku="KTL-RED", quantity=1)
    refuses(w, "add_to_cart", "not_found", sku="NOPE", quantity=1)
    refuses(w, "set_quantity", "not_in_cart", sku="NTB-A5", quantity=2)
    refuses(w, "set_quantity", "out_of_stock", sku="KTL-BLUE", quantity=3)
    w.call("add_to_cart", {"sku": "CBL-USBC-1M", "quantity": 1})
    w.call("add_to_cart", {"sku": "NTB-A5", "quantity": 2})
    w.call("set_quantity", {"sku": "KTL-BLUE", "quantity": 0})  # 0 removes
    view = w.call("view_cart", {})
    assert [i["sku"] for i in view["items"]] == ["CBL-USBC-1M", "NTB-A5"]
    assert view["total"] == 13.45  # summed in cents: 7.25 + 2 x 3.10


def test_checkout() -> None:
    w = world()
    refuses(w, "checkout", "empty_cart", address_id="addr-1")
    w.call("add_to_cart", {"sku": "BAT-AA-4", "quantity": 3})
    refuses(w, "checkout", "bad_request")
    refuses(w, "checkout", "bad_request", address_id="addr-1", address="somewhere")
    refuses(w, "checkout", "not_found", address_id="addr-9")
    refuses(w, "checkout", "no_address", address="  ")
    order = w.call("checkout", {"address_id": "addr-1"})["ordered"]
    assert order == {"id": "ord-0001", "items": {"BAT-AA-4": 3}, "total": 14.97,
                     "ship_to": "12 Elm Street, Springfield"}
    shop = w.state()["shop"]
    assert shop["cart"] == {} and shop["catalog"][0]["stock"] == 7 and shop["next_order"] == 2
    assert w.call("saved_addresses", {})["addresses"][0]["id"] == "addr-1"


# ---------------------------------------------------------------- purity


def test_same_calls_same_state_and_the_initial_state_is_not_shared() -> None:
    initial = default_state()
    a, b = World.from_state(initial), World.from_state(initial)
    for w in (a, b):
        w.call("make_dir", {"path": "x"})
        w.call("add_to_cart", {"sku": "NTB-A5", "quantity": 1})
    assert a.state() == b.state()
    assert initial == default_state(), "from_state must copy, not alias, its input"


def test_write_tools_are_exactly_the_state_changing_ones() -> None:
    assert WRITE_TOOLS == {"write_file", "make_dir", "move", "delete", "create_event", "update_event",
                           "cancel_event", "add_to_cart", "set_quantity", "checkout"}

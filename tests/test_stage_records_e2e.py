"""End-to-end: a damaged stage record in a real home's state.db is named and its stage runs again.

The real pipeline (`hotfit auto` as a subprocess, the local Hub, the real llama-server): after a
finished provisioning, verify's record is damaged by hand; `auto --recheck` then reuses the
downloads, logs `stage.stale` with the StageRecordError naming verify, state.db and the field, runs
verify again, and load gets a VerifyResult exactly as after a fresh verify.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from tests.e2e_support import World, write_probe
from tests.hubserver import LocalHub
from tests.test_auto_e2e import ROOMY_FREE_BYTES, auto, events, stage_story

TIER = "e2e"


@pytest.mark.llama
def test_a_damaged_verify_record_is_named_and_verify_runs_again(hub: LocalHub, world: World, tmp_path: Path) -> None:
    home = tmp_path / "home"
    probe = write_probe(tmp_path / "probe.json", ROOMY_FREE_BYTES)
    first = auto(hub, home, world, probe, "--json")
    assert first.returncode == 0, first.stderr[-2000:]
    db = home / "state.db"
    with sqlite3.connect(db) as conn:
        (raw,) = conn.execute("SELECT outputs_json FROM stages WHERE stage='verify'").fetchone()
        record = json.loads(raw)
        record["size_bytes"] = str(record["size_bytes"])  # a field of the wrong kind
        conn.execute("UPDATE stages SET outputs_json=? WHERE stage='verify'", (json.dumps(record),))

    hub.reset_counters()
    again = auto(hub, home, world, probe, "--json", "--recheck")
    assert again.returncode == 0, again.stderr[-3000:]
    run_id = json.loads(again.stdout)["run_id"]
    assert hub.bytes_sent() == 0  # the downloads are reused; only verify's record was untrusted
    assert stage_story(events(home), run_id) == [
        ("stage.start", "probe"), ("stage.done", "probe"), ("stage.start", "plan"), ("stage.done", "plan"),
        ("stage.skip", "fetch-weights"), ("stage.skip", "fetch-template"),
        ("stage.start", "verify"), ("stage.done", "verify"),
        ("stage.start", "load"), ("stage.done", "load"), ("stage.start", "probe-tool-call"),
        ("stage.done", "probe-tool-call"), ("stage.start", "re-check"), ("stage.done", "re-check"),
        ("stage.start", "measure-speed"), ("stage.done", "measure-speed"),
    ]
    stale = [e for e in events(home) if e["event"] == "stage.stale" and e.get("run_id") == run_id]
    assert len(stale) == 1 and stale[0]["stage"] == "verify"
    error = stale[0]["error"]
    assert error["code"] == "stage_record" and error["details"]["field"] == "size_bytes"
    assert error["details"]["stage"] == "verify" and error["details"]["state_db"] == str(db)
    assert json.loads(again.stdout)["model_size_bytes"] == json.loads(first.stdout)["model_size_bytes"]

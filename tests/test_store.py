"""hotfit.state.store: durable, transactional stage records."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from hotfit.state.store import StateStore, SyncStateStore

TIER = "unit"

STAGES = ["probe", "plan", "fetch-weights", "verify"]


def test_database_is_wal_with_full_sync(tmp_path: Path) -> None:
    store = SyncStateStore(tmp_path / "state.db")
    store.create_run(STAGES)
    conn = sqlite3.connect(tmp_path / "state.db")
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    # synchronous is per connection; read it from the store's own connection
    assert store._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_run_lifecycle_records_every_field(tmp_path: Path) -> None:
    store = SyncStateStore(tmp_path / "state.db")
    run = store.create_run(STAGES, {"origin": "us"})
    assert [r.status for r in store.stages(run.run_id)] == ["pending"] * 4
    store.stage_running(run.run_id, "probe", "h-probe", None)
    store.stage_done(run.run_id, "probe", {"free_bytes": 123})
    store.stage_running(run.run_id, "plan", "h-plan", "plan-1")
    store.stage_failed(run.run_id, "plan", {"code": "no_model_qualifies"})
    store.stage_running(run.run_id, "plan", "h-plan", "plan-1")
    store.stage_done(run.run_id, "plan", {"entry": "m"})
    recs = {r.stage: r for r in store.stages(run.run_id)}
    assert recs["probe"].outputs == {"free_bytes": 123} and recs["probe"].attempts == 1
    assert recs["plan"].attempts == 2 and recs["plan"].error is None and recs["plan"].status == "done"
    assert recs["plan"].plan_id == "plan-1" and recs["plan"].inputs_hash == "h-plan"
    assert recs["plan"].started_at <= recs["plan"].finished_at
    assert store.get_run(run.run_id).args == {"origin": "us"}
    store.finish_run(run.run_id, "done")
    assert store.latest_run().status == "done"
    assert store.latest_done_run().run_id == run.run_id


def test_find_done_reaches_across_runs_and_ignores_failed(tmp_path: Path) -> None:
    store = SyncStateStore(tmp_path / "state.db")
    first = store.create_run(STAGES)
    store.stage_running(first.run_id, "verify", "h1", "p")
    store.stage_done(first.run_id, "verify", {"sha256": "aa"})
    second = store.create_run(STAGES)
    store.stage_running(second.run_id, "verify", "h1", "p")
    store.stage_failed(second.run_id, "verify", {"code": "integrity"})
    found = store.find_done("verify", "h1")
    assert found is not None and found.run_id == first.run_id and found.outputs == {"sha256": "aa"}
    assert store.find_done("verify", "other-hash") is None
    # a skip that reused the outputs counts as the newest completed record
    store.stage_skipped(second.run_id, "fetch-weights", "h2", "p", {"path": "x"}, "inputs unchanged")
    assert store.find_done("fetch-weights", "h2").run_id == second.run_id


def test_failed_transaction_leaves_nothing_behind(tmp_path: Path) -> None:
    store = SyncStateStore(tmp_path / "state.db")
    run = store.create_run(STAGES)
    with pytest.raises(sqlite3.IntegrityError):
        # two statements, the second violates the primary key: the first must roll back too
        store._write([
            ("UPDATE stages SET status='done' WHERE run_id=? AND stage='probe'", (run.run_id,)),
            ("INSERT INTO stages(run_id, stage, position, status) VALUES (?, 'plan', 9, 'x')", (run.run_id,)),
        ])
    assert store.get_stage(run.run_id, "probe").status == "pending"


def test_duplicate_run_id_rolls_back_its_stage_rows(tmp_path: Path) -> None:
    store = SyncStateStore(tmp_path / "state.db")
    store.create_run(["a"], run_id="r1")
    with pytest.raises(sqlite3.IntegrityError):
        store.create_run(["a", "b"], run_id="r1")
    assert [s.stage for s in store.stages("r1")] == ["a"]


def test_stale_running_records_become_interrupted(tmp_path: Path) -> None:
    store = SyncStateStore(tmp_path / "state.db")
    run = store.create_run(STAGES)
    store.stage_running(run.run_id, "probe", "h", None)
    assert store.mark_stale_runs_interrupted() == 1
    assert store.get_stage(run.run_id, "probe").status == "interrupted"
    assert store.get_run(run.run_id).status == "interrupted"
    store.reopen_run(run.run_id)
    assert store.get_run(run.run_id).status == "running"


def test_reset_stages_drops_outputs(tmp_path: Path) -> None:
    store = SyncStateStore(tmp_path / "state.db")
    run = store.create_run(STAGES)
    store.stage_running(run.run_id, "verify", "h", "p")
    store.stage_done(run.run_id, "verify", {"ok": True})
    store.reset_stages(run.run_id, ["verify"])
    rec = store.get_stage(run.run_id, "verify")
    assert rec.status == "pending" and rec.outputs is None and rec.inputs_hash is None
    assert store.find_done("verify", "h") is None


@pytest.mark.anyio
async def test_async_facade_runs_off_the_event_loop(tmp_path: Path) -> None:
    store = await StateStore.open(tmp_path / "state.db")
    loop_thread = threading.get_ident()
    seen: list[int] = []
    original = store.sync.stages

    def spy(run_id: str):  # records which thread the blocking call ran on
        seen.append(threading.get_ident())
        return original(run_id)

    store.sync.stages = spy  # type: ignore[method-assign]
    run = await store.create_run(STAGES)
    await store.stage_running(run.run_id, "probe", "h", None)
    await store.stage_done(run.run_id, "probe", {"a": 1})
    records = await store.stages(run.run_id)
    assert records[0].status == "done"
    assert seen and all(t != loop_thread for t in seen)
    await store.aclose()


_WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from hotfit.state.store import SyncStateStore
    store = SyncStateStore(Path(sys.argv[1]))
    run = store.create_run(["s%d" % i for i in range(50)], run_id="crash")
    print("ready", flush=True)
    i = 0
    while True:
        stage = "s%d" % (i % 50)
        store.stage_running("crash", stage, "h%d" % i, "p")
        store.stage_done("crash", stage, {"i": i, "blob": "x" * 2000})
        i += 1
""")


@pytest.mark.integration
def test_kill_9_mid_write_leaves_a_consistent_database(tmp_path: Path) -> None:
    """SIGKILL while committing in a loop: the file passes integrity_check and every record is
    whole (a done record always carries its outputs; no half-written row)."""
    root = Path(__file__).resolve().parent.parent
    for attempt in range(3):
        db = tmp_path / f"state-{attempt}.db"
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(db)], stdout=subprocess.PIPE,
                                cwd=root, text=True)
        assert proc.stdout.readline().strip() == "ready"
        threading.Event().wait(0.05 * (attempt + 1))  # let it commit a few rounds, then kill
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        conn = sqlite3.connect(db)
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        conn.close()
        store = SyncStateStore(db)
        records = store.stages("crash")
        assert len(records) == 50
        for rec in records:
            assert rec.status in ("pending", "running", "done")
            if rec.status == "done":
                assert rec.outputs is not None and rec.outputs["blob"] == "x" * 2000
        store.close()


def test_corrupt_database_is_a_usage_error_naming_the_file(tmp_path: Path) -> None:
    from hotfit.core.errors import UsageError

    path = tmp_path / "state.db"
    path.write_bytes(b"this is not an sqlite database" * 100)
    with pytest.raises(UsageError) as info:
        SyncStateStore(path)
    assert str(path) in info.value.what
    assert info.value.hint and "state.db" in info.value.hint
    assert "-wal" in info.value.hint  # a stale WAL beside a fresh database would be replayed into it


def test_database_from_an_older_schema_is_refused_not_crashed_on(tmp_path: Path) -> None:
    from hotfit.core.errors import UsageError

    path = tmp_path / "state.db"
    conn = sqlite3.connect(path)
    # an earlier layout: no seq / attempts / inputs_hash columns
    conn.executescript("CREATE TABLE runs (run_id TEXT PRIMARY KEY, status TEXT);"
                       "CREATE TABLE stages (run_id TEXT, stage TEXT, status TEXT);")
    conn.close()
    with pytest.raises(UsageError) as info:
        SyncStateStore(path)
    assert str(path) in info.value.what


def test_database_with_a_newer_schema_number_is_refused(tmp_path: Path) -> None:
    from hotfit.core.errors import UsageError

    path = tmp_path / "state.db"
    SyncStateStore(path).close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value='99' WHERE key='schema'")
    conn.commit()
    conn.close()
    with pytest.raises(UsageError):
        SyncStateStore(path)


# A process that holds the home's pipeline lock and a write transaction on state.db until told to stop.
_BUSY_HOLDER = textwrap.dedent("""
    import sqlite3, sys
    from pathlib import Path
    from hotfit.state.locks import FileLock
    home = Path(sys.argv[1])
    lock = FileLock(home / "pipeline.lock")
    lock.acquire()
    conn = sqlite3.connect(home / "state.db", isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    print("ready", flush=True)
    sys.stdin.read()
""")


@pytest.fixture
def busy_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    import hotfit.state.store
    monkeypatch.setattr(hotfit.state.store, "BUSY_TIMEOUT_MS", 200)  # the wait itself is not under test
    home = tmp_path / "home"
    home.mkdir()
    SyncStateStore(home / "state.db").close()
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "-c", _BUSY_HOLDER, str(home)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, cwd=root, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield home, proc.pid
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.integration
def test_a_busy_database_at_open_names_the_holder_not_a_sqlite_traceback(busy_home: Any) -> None:
    from hotfit.core.errors import LockedError

    home, holder_pid = busy_home
    with pytest.raises(LockedError) as info:
        SyncStateStore(home / "state.db", lock_path=home / "pipeline.lock")
    assert f"PID {holder_pid}" in info.value.what and str(home / "state.db") in info.value.what
    assert info.value.details["holder_pid"] == holder_pid
    assert info.value.hint and "--wait" in info.value.hint


@pytest.mark.integration
def test_a_busy_database_on_write_names_the_process_that_has_it_open(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # No pipeline lock this time (another program, e.g. the sqlite3 shell, holds the write lock):
    # the holder is found among the processes that have the file open.
    import hotfit.state.store
    from hotfit.core.errors import LockedError

    monkeypatch.setattr(hotfit.state.store, "BUSY_TIMEOUT_MS", 200)
    db = tmp_path / "state.db"
    store = SyncStateStore(db, lock_path=tmp_path / "pipeline.lock")
    run = store.create_run(STAGES)
    holder = subprocess.Popen([sys.executable, "-c", "import sqlite3, sys\n"
                               "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
                               "c.execute('BEGIN IMMEDIATE'); print('ready', flush=True); sys.stdin.read()",
                               str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        with pytest.raises(LockedError) as info:
            store.stage_running(run.run_id, "probe", "h", None)
        assert f"PID {holder.pid}" in info.value.what
    finally:
        holder.kill()
        holder.wait()
    store.stage_running(run.run_id, "probe", "h", None)  # the store is still usable once it is free
    assert store.get_stage(run.run_id, "probe").status == "running"


@pytest.mark.integration
def test_status_reads_a_database_another_process_holds_a_write_transaction_on(busy_home: Any) -> None:
    """`status` opens state.db read-only (it writes nothing, and must read a read-only home): a
    writer's open transaction does not block a WAL reader, so it answers instead of exiting 6."""
    import io
    import json

    from hotfit.pipeline.cli import main

    home, holder_pid = busy_home
    out = io.StringIO()
    assert main(["--home", str(home), "--json", "status"], out=out) == 0
    data = json.loads(out.getvalue())
    assert data["lock"]["held"] is True and data["lock"]["holder_pid"] == holder_pid


def test_prune_keeps_the_newest_runs_the_protected_and_the_running(tmp_path: Path) -> None:
    store = SyncStateStore(tmp_path / "state.db")
    runs = []
    for i in range(30):
        run = store.create_run(["probe", "plan"])
        store.stage_running(run.run_id, "probe", f"h{i}", None)
        store.stage_done(run.run_id, "probe", {"i": i})
        store.finish_run(run.run_id, "done")
        runs.append(run.run_id)
    running = runs[1]
    store.reopen_run(running)  # a run another process is still in (never pruned)
    pruned = store.prune_runs(20, protect=[runs[0]])
    assert pruned == runs[2:10]
    left = {r["run_id"] for r in store._read("SELECT run_id FROM runs")}
    assert left == {runs[0], running, *runs[10:]}
    assert not store._read("SELECT 1 FROM stages WHERE run_id IN (%s)" % ",".join("?" * len(pruned)), tuple(pruned))
    assert store.find_done("probe", "h29") is not None
    assert store.prune_runs(20, protect=[runs[0]]) == []  # nothing more to do
    store.close()

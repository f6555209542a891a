"""Durable stage state: SQLite in WAL mode, one record per (run, stage).

Why SQLite/WAL: every write is one transaction, a crash or power cut rolls an
unfinished transaction back, and WAL lets ``hotfit status`` read while ``hotfit auto`` writes.
``synchronous=FULL`` makes a commit durable before it returns, so the order "stage files fsynced
and renamed into place, then the record says done" holds across a power cut: a record never
claims more than what is on disk (the stages own the fsync of their files; the runner only marks
a stage done after the stage function has returned).

The stdlib ``sqlite3`` module blocks, so the async API runs every call in a worker thread
(``anyio.to_thread``); one connection, serialised by a lock, is shared by those threads.

Damage (docs/faults-state.md): a field that does not read back is flagged on its record
(``damaged``) and logged, never trusted, so the engine runs that stage again; a garbled page, found
by ``quick_check`` at open or by any later statement, is a UsageError (exit 2) naming the file and
how to move it aside.

Nothing secret is stored: outputs and errors are the stages' ``to_json()`` dictionaries, which
carry paths, sizes, hashes and verdicts, never tokens or API keys.

Over 400 lines: the schema, its migrations and the sync and async faces of one SQLite store are
one job; split, the transaction rules would live in two places.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence

import anyio.to_thread

from hotfit.core.diskspace import disk_full_error, is_disk_full, refused_errno, unwritable_error
from hotfit.core.errors import DiskSpaceError, DiskWriteError, LockedError, UsageError
from hotfit.core.log import get_logger
from hotfit.core.records import field_dict
from hotfit.state.files import rehome_paths, same_directory
from hotfit.state.locks import current_holder

log = get_logger()
# sqlite's name for a private in-memory database (an ephemeral run's store): it has no home
IN_MEMORY_PATH = Path(":memory:")

StageStatus = Literal["pending", "running", "done", "failed", "skipped", "interrupted"]
RunStatus = Literal["running", "done", "failed", "interrupted"]
STAGE_STATUSES: tuple[str, ...] = ("pending", "running", "done", "failed", "skipped", "interrupted")
RUN_STATUSES: tuple[str, ...] = ("running", "done", "failed", "interrupted")

SCHEMA_VERSION = 1
# How long a writer waits for another process's transaction before giving up (the pipeline lock
# keeps writers to one; readers such as `hotfit status` only ever wait this long).
BUSY_TIMEOUT_MS = 10_000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    run_id      TEXT PRIMARY KEY,
    seq         INTEGER NOT NULL,
    status      TEXT NOT NULL,
    started_at  REAL NOT NULL,
    finished_at REAL,
    plan_id     TEXT,
    args_json   TEXT NOT NULL DEFAULT '{}',
    error_json  TEXT
);
CREATE TABLE IF NOT EXISTS stages (
    run_id      TEXT NOT NULL REFERENCES runs(run_id),
    stage       TEXT NOT NULL,
    position    INTEGER NOT NULL,
    status      TEXT NOT NULL,
    inputs_hash TEXT,
    plan_id     TEXT,
    outputs_json TEXT,
    error_json  TEXT,
    started_at  REAL,
    finished_at REAL,
    attempts    INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (run_id, stage)
);
CREATE INDEX IF NOT EXISTS stages_by_hash ON stages (stage, inputs_hash, status);
"""
# What this version reads; a table from an older layout (CREATE TABLE IF NOT EXISTS keeps it)
# lacking one of these is refused at open, not met as "no such column" in the middle of a run.
_COLUMNS: dict[str, frozenset[str]] = {
    "runs": frozenset({"run_id", "seq", "status", "started_at", "finished_at", "plan_id", "args_json",
                       "error_json"}),
    "stages": frozenset({"run_id", "stage", "position", "status", "inputs_hash", "plan_id", "outputs_json",
                         "error_json", "started_at", "finished_at", "attempts"}),
}


@dataclass(frozen=True)
class StageRecord:
    run_id: str
    stage: str
    position: int
    status: StageStatus
    inputs_hash: str | None
    plan_id: str | None
    outputs: dict[str, Any] | None
    error: dict[str, Any] | None
    started_at: float | None
    finished_at: float | None
    attempts: int
    damaged: tuple[str, ...] = ()  # columns that did not read back (_Fields); their values are defaults

    def to_json(self) -> dict[str, Any]:
        # listed under its run, in stage order; "damaged" only when something is
        return field_dict(self, omit=("run_id", "position") + (() if self.damaged else ("damaged",)))


@dataclass(frozen=True)
class RunRecord:
    run_id: str
    seq: int
    status: RunStatus
    started_at: float | None  # None only when the stored value is damaged
    finished_at: float | None
    plan_id: str | None
    args: dict[str, Any]
    error: dict[str, Any] | None
    damaged: tuple[str, ...] = ()  # columns that did not read back (_Fields)

    def to_json(self) -> dict[str, Any]:
        # seq: the store's row order, not a fact of the run; "damaged" only when something is
        return field_dict(self, omit=("seq",) + (() if self.damaged else ("damaged",)))


def _dumps(value: Any) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True, default=str)


def new_run_id() -> str:
    # Sortable by time for a person reading logs, unique without coordination.
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:8]


def _is_full(exc: BaseException) -> bool:
    """SQLite's SQLITE_FULL ("database or disk is full"): the disk filled under a write."""
    return isinstance(exc, sqlite3.OperationalError) and (
        getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "disk is full" in str(exc))


def _is_refused(exc: BaseException) -> bool:
    """SQLite's SQLITE_READONLY ("attempt to write a readonly database") / SQLITE_IOERR ("disk I/O
    error"): the filesystem refused a write — turned read-only under the run, or failing."""
    name = getattr(exc, "sqlite_errorname", "") or ""
    return isinstance(exc, sqlite3.OperationalError) and (
        name.startswith(("SQLITE_READONLY", "SQLITE_IOERR")) or "readonly database" in str(exc)
        or "disk I/O error" in str(exc))


def _is_damage(exc: BaseException) -> bool:
    """SQLite's "database disk image is malformed" / "file is not a database" (a garbled page)."""
    name = getattr(exc, "sqlite_errorname", "") or ""
    return name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")) or "malformed" in str(exc)


def _is_busy(exc: BaseException) -> bool:
    """SQLite's "database is locked" / "database is busy": another connection kept the write lock
    past the busy timeout."""
    return isinstance(exc, sqlite3.OperationalError) and any(w in str(exc) for w in ("locked", "busy"))


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return " ".join(" ".join(a.decode("utf-8", "replace").split()) for a in raw.split(b"\0") if a)[:200]


def processes_with_open(paths: Sequence[Path]) -> list[int]:
    """PIDs (other than this one) with any of ``paths`` open, from ``/proc/*/fd`` (Linux; best effort:
    another user's processes are not visible to a non-root caller)."""
    wanted = {str(p) for p in paths}
    found: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}") in wanted:
                    found.append(int(entry))
                    break
            except OSError:
                continue
    return sorted(found)


class SyncStateStore:
    """The blocking core. Every public method is one transaction.

    ``lock_path`` is the home's pipeline lock: when the database stays busy past the wait, the
    error names that lock's holder (or else the processes that have the file open)."""

    def __init__(self, path: Path, *, lock_path: Path | None = None, read_only: bool = False) -> None:
        self.path = Path(path)
        self.lock_path = lock_path
        self._lock = threading.Lock()
        started = time.monotonic()
        if not read_only:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: we issue BEGIN IMMEDIATE ourselves, so a transaction takes the
        # write lock up front instead of failing half-way on an upgrade.
        self._conn = sqlite3.connect(
            self._read_only_uri() if read_only else str(self.path), uri=read_only,
            timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
        )
        self._conn.row_factory = sqlite3.Row
        try:
            if read_only:  # a reader (``hotfit status``): the same checks, nothing created or written
                with self._lock:
                    self._check_layout()
                    self._check_pages()
            else:
                self._init_schema()
        except sqlite3.DatabaseError as exc:
            # A damaged file or one from another hotfit version: say which file and what to do,
            # instead of a traceback (or a "no such column" half-way through a run).
            self._conn.close()
            if _is_full(exc) or is_disk_full(exc.__cause__ or exc.__context__ or exc):
                raise self._full_error(exc) from None
            if _is_refused(exc):
                raise self._refused_error(exc) from None
            if _is_busy(exc):
                raise self._busy_error(exc, time.monotonic() - started) from None
            raise self._unusable(exc) from None
        except BaseException:
            self._conn.close()
            raise

    def _read_only_uri(self) -> str:
        """``mode=ro``; on a filesystem mounted read-only with no write-ahead log beside the database
        (hotfit's last connection checkpointed it away), ``immutable=1`` — SQLite cannot create the
        ``-shm`` index a WAL reader needs there, and nothing can change the file under the reader."""
        wal = self.path.with_name(self.path.name + "-wal")
        try:
            read_only_fs = bool(os.statvfs(self.path.parent).f_flag & os.ST_RDONLY)
            wal_bytes = wal.stat().st_size if wal.exists() else 0
        except OSError:
            read_only_fs, wal_bytes = False, 0
        mode = "immutable=1" if read_only_fs and wal_bytes == 0 else "mode=ro"
        return f"file:{urllib.parse.quote(str(self.path))}?{mode}"

    def _unusable(self, exc: BaseException) -> UsageError:
        """Exit 2 naming the file and the fix (move it aside), for a database that cannot be read."""
        aside = self.path.parent / f"{self.path.stem}-unusable"
        return UsageError(
            f"state database {self.path} cannot be used: {exc}",
            # with its -wal/-shm: a stale WAL left beside a fresh database would be replayed into it
            hint=f"move it and its -wal/-shm files aside (mkdir {aside} && mv {self.path}* {aside}/) and "
                 "rerun; stage records are rebuilt and completed downloads on disk are reused",
            state_db=str(self.path),
        )

    def _busy_error(self, exc: BaseException, waited_s: float) -> LockedError:
        """What a person needs when the database stayed busy: who holds it, and what to do."""
        holder = current_holder(self.lock_path) if self.lock_path is not None else None
        pipeline_pid = holder.pid if holder is not None else None
        open_by = [p for p in processes_with_open([self.path, self.path.with_name(self.path.name + "-wal"),
                                                   self.path.with_name(self.path.name + "-shm")])
                   if p != pipeline_pid]
        if pipeline_pid is not None and holder is not None:
            who = f"hotfit PID {pipeline_pid} ({holder.command}) holds this home's pipeline lock"
        elif open_by:
            who = "held open by " + ", ".join(f"PID {p} ({_cmdline(p) or '?'})" for p in open_by)
        else:
            who = "the holder could not be identified (another user's process, or on another host)"
        holder_pid = pipeline_pid if pipeline_pid is not None else (open_by[0] if open_by else None)
        return LockedError(
            f"state database {self.path} stayed busy (waited {waited_s:.1f} s) "
            f"(another process kept a write transaction open): {who}",
            hint="let it finish and rerun (`hotfit auto --wait` queues behind a running pipeline); if the "
                 "holder is not a hotfit pipeline, end what holds the database open",
            state_db=str(self.path), holder_pid=holder_pid, open_by_pids=open_by, waited_s=round(waited_s, 3),
            sqlite_error=str(exc))

    def _full_error(self, exc: BaseException) -> DiskSpaceError:
        """The disk filled under a write: exit 4 naming the database and the bytes (nothing was
        committed; the rerun resumes from the last committed stage)."""
        page = 4096  # one page: the least a journal or a row needs
        with contextlib.suppress(sqlite3.Error):
            page = int(self._conn.execute("PRAGMA page_size").fetchone()[0])
        return disk_full_error(self.path, needed_bytes=page, what="the state database", sqlite_error=str(exc))

    def _refused_error(self, exc: BaseException) -> DiskWriteError:
        """The filesystem refused a write (read-only, or an I/O error): exit 4 naming the database and
        the mount; the last committed transaction stands, so the rerun resumes from it."""
        return unwritable_error(self.path, what="the state database", errno_=refused_errno(self.path),
                                sqlite_error=str(exc))

    @contextlib.contextmanager
    def _mapped_errors(self) -> Iterator[None]:
        """A busy database is LockedError (exit 6, naming the holder); a damaged one (a garbled page
        met by this statement) is the exit-2 error naming the file and the fix, not a traceback."""
        started = time.monotonic()
        try:
            yield
        except sqlite3.DatabaseError as exc:
            if _is_busy(exc):
                raise self._busy_error(exc, time.monotonic() - started) from None
            if _is_full(exc):
                raise self._full_error(exc) from None
            if _is_refused(exc):
                raise self._refused_error(exc) from None
            if _is_damage(exc):
                raise self._unusable(exc) from None
            raise

    def _rollback(self) -> None:
        # SQLite rolls back by itself on some errors (a corrupt page, a full disk): a ROLLBACK then
        # raises "no transaction is active" and would hide the error that caused it.
        if self._conn.in_transaction:
            self._conn.execute("ROLLBACK")

    def _init_schema(self) -> None:
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.execute("PRAGMA foreign_keys=ON")
            self._conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in filter(None, (s.strip() for s in _SCHEMA.split(";"))):
                    self._conn.execute(statement)
                self._conn.execute(
                    "INSERT OR IGNORE INTO meta(key, value) VALUES ('schema', ?)", (str(SCHEMA_VERSION),)
                )
                self._check_layout()
                moved = self._rehome()
                self._conn.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise
            self._check_pages()
        if moved is not None:
            log.info("home.copied", from_home=moved[0], home=str(self.path.parent), file=str(self.path),
                     records=moved[1])

    def _rehome(self) -> tuple[str, int] | None:
        """A database copied (``cp -a``) or moved with its home: its stage records name the original
        home's files, and a reused record would load them from there. Each is re-rooted here, once, in
        the open's transaction (docs/faults-state.md, "A copied home"); the home is recorded in
        ``meta`` for the next open. Returns (the original home, records changed) when it moved."""
        if self.path == IN_MEMORY_PATH:
            return None
        here = os.path.abspath(self.path.parent)
        row = self._conn.execute("SELECT value FROM meta WHERE key='home'").fetchone()
        if row is None:
            self._conn.execute("INSERT INTO meta(key, value) VALUES ('home', ?)", (here,))
            return None
        if same_directory(row[0], here):
            return None
        changed = 0
        for record in list(self._conn.execute("SELECT run_id, stage, outputs_json FROM stages "
                                              "WHERE outputs_json IS NOT NULL")):
            try:
                outputs = json.loads(record[2])
            except (TypeError, ValueError):  # a damaged record stays as it is: never trusted (state.record_damaged)
                continue
            moved = rehome_paths(outputs, row[0], here)
            if moved != outputs:
                self._conn.execute("UPDATE stages SET outputs_json=? WHERE run_id=? AND stage=?",
                                   (json.dumps(moved), record[0], record[1]))
                changed += 1
        self._conn.execute("UPDATE meta SET value=? WHERE key='home'", (here,))
        return row[0], changed

    def _check_layout(self) -> None:
        row = self._conn.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
        found = row[0] if row is not None else None
        if found != str(SCHEMA_VERSION):
            raise sqlite3.DatabaseError(f"schema version {found}, this hotfit reads {SCHEMA_VERSION}")
        for table, wanted in _COLUMNS.items():
            have = {r[1] for r in self._conn.execute(f"PRAGMA table_info({table})")}
            if not wanted <= have:
                raise sqlite3.DatabaseError(
                    f"table {table} lacks {', '.join(sorted(wanted - have))} (an older layout)")

    def _check_pages(self) -> None:
        # A garbled page is found here, before a run starts, not by a write half-way through it
        # (milliseconds: the database holds a few rows per run).
        problems = [r[0] for r in self._conn.execute("PRAGMA quick_check(3)")]
        if problems != ["ok"]:
            raise sqlite3.DatabaseError("damaged: " + "; ".join(str(p) for p in problems))

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # -- transactions ---------------------------------------------------------------------------

    def _write(self, statements: Sequence[tuple[str, tuple[Any, ...]]]) -> None:
        with self._lock, self._mapped_errors():
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                for sql, params in statements:
                    self._conn.execute(sql, params)
                self._conn.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise

    def _read(self, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock, self._mapped_errors():
            return list(self._conn.execute(sql, params))

    # -- runs -----------------------------------------------------------------------------------

    def create_run(self, stages: Sequence[str], args: dict[str, Any] | None = None,
                   run_id: str | None = None) -> RunRecord:
        """A new run with every stage pending, in one transaction."""
        run_id = run_id or new_run_id()
        now = time.time()
        with self._lock, self._mapped_errors():
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                seq = self._conn.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM runs").fetchone()[0]
                self._conn.execute(
                    "INSERT INTO runs(run_id, seq, status, started_at, args_json) VALUES (?,?,?,?,?)",
                    (run_id, seq, "running", now, _dumps(args or {})),
                )
                for position, stage in enumerate(stages):
                    self._conn.execute(
                        "INSERT INTO stages(run_id, stage, position, status) VALUES (?,?,?,'pending')",
                        (run_id, stage, position),
                    )
                self._conn.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise
        run = self.get_run(run_id)
        assert run is not None
        return run

    def reopen_run(self, run_id: str) -> None:
        """Continue an unfinished run (a rerun after a crash, a signal or a failure)."""
        self._write([("UPDATE runs SET status='running', finished_at=NULL, error_json=NULL WHERE run_id=?",
                      (run_id,))])

    def finish_run(self, run_id: str, status: RunStatus, error: dict[str, Any] | None = None) -> None:
        self._write([("UPDATE runs SET status=?, finished_at=?, error_json=? WHERE run_id=?",
                      (status, time.time(), _dumps(error), run_id))])

    def set_run_plan(self, run_id: str, plan_id: str) -> None:
        self._write([("UPDATE runs SET plan_id=? WHERE run_id=?", (plan_id, run_id))])

    def _runs(self, rows: Sequence[sqlite3.Row]) -> list[RunRecord]:
        runs = [_run(r) for r in rows]
        for r in runs:
            if r.damaged:
                log.warning("state.record_damaged", state_db=str(self.path), table="runs", run_id=r.run_id,
                            stage=None, columns=list(r.damaged))
        return runs

    def _stages(self, rows: Sequence[sqlite3.Row]) -> list[StageRecord]:
        stages = [_stage(r) for r in rows]
        for s in stages:
            if s.damaged:
                log.warning("state.record_damaged", state_db=str(self.path), table="stages", run_id=s.run_id,
                            stage=s.stage, columns=list(s.damaged))
        return stages

    def get_run(self, run_id: str) -> RunRecord | None:
        rows = self._read("SELECT * FROM runs WHERE run_id=?", (run_id,))
        return self._runs(rows)[0] if rows else None

    def latest_run(self) -> RunRecord | None:
        rows = self._read("SELECT * FROM runs ORDER BY seq DESC LIMIT 1")
        return self._runs(rows)[0] if rows else None

    def latest_done_run(self) -> RunRecord | None:
        rows = self._read("SELECT * FROM runs WHERE status='done' ORDER BY seq DESC LIMIT 1")
        return self._runs(rows)[0] if rows else None

    def prune_runs(self, keep: int, protect: Sequence[str] = ()) -> list[str]:
        """Delete every run (and its stage records) older than the newest ``keep``, except those in
        ``protect`` and any still 'running'; the run ids deleted, oldest first. One transaction.

        The newest runs are the ones a rerun resumes or reuses stages from (a reused stage is copied
        into the run that reuses it), so an old record is never needed; SQLite reuses the freed pages,
        so the file stops growing instead of shrinking (no VACUUM: it would rewrite the whole file)."""
        with self._lock, self._mapped_errors():
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                marks = ",".join("?" * len(protect))
                rows = self._conn.execute(
                    "SELECT run_id FROM runs WHERE status != 'running' AND seq <= "
                    "(SELECT COALESCE(MAX(seq), 0) FROM runs) - ?"
                    + (f" AND run_id NOT IN ({marks})" if protect else "") + " ORDER BY seq",
                    (keep, *protect)).fetchall()
                doomed = [r[0] for r in rows]
                for run_id in doomed:
                    self._conn.execute("DELETE FROM stages WHERE run_id=?", (run_id,))
                    self._conn.execute("DELETE FROM runs WHERE run_id=?", (run_id,))
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
        return doomed

    def mark_stale_runs_interrupted(self) -> int:
        """A run still 'running' when the pipeline lock is free was killed (kill -9, power cut)."""
        with self._lock, self._mapped_errors():
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                now = time.time()
                cur = self._conn.execute(
                    "UPDATE stages SET status='interrupted', finished_at=? WHERE status='running'", (now,))
                count = cur.rowcount
                self._conn.execute(
                    "UPDATE runs SET status='interrupted', finished_at=? WHERE status='running'", (now,))
                self._conn.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise
        return count

    # -- stages ---------------------------------------------------------------------------------

    def stage_running(self, run_id: str, stage: str, inputs_hash: str | None, plan_id: str | None) -> None:
        self._write([(
            "UPDATE stages SET status='running', inputs_hash=?, plan_id=?, error_json=NULL, "
            "outputs_json=NULL, started_at=?, finished_at=NULL, attempts=attempts+1 "
            "WHERE run_id=? AND stage=?",
            (inputs_hash, plan_id, time.time(), run_id, stage),
        )])

    def stage_done(self, run_id: str, stage: str, outputs: dict[str, Any] | None) -> None:
        """Call only after the stage's files are durably in place (fsynced, renamed)."""
        self._write([(
            "UPDATE stages SET status='done', outputs_json=?, error_json=NULL, finished_at=? "
            "WHERE run_id=? AND stage=?",
            (_dumps(outputs), time.time(), run_id, stage),
        )])

    def stage_skipped(self, run_id: str, stage: str, inputs_hash: str | None, plan_id: str | None,
                      outputs: dict[str, Any] | None, reason: str) -> None:
        now = time.time()
        self._write([(
            "UPDATE stages SET status='skipped', inputs_hash=?, plan_id=?, outputs_json=?, "
            "error_json=?, started_at=?, finished_at=? WHERE run_id=? AND stage=?",
            (inputs_hash, plan_id, _dumps(outputs), _dumps({"skip_reason": reason}), now, now, run_id, stage),
        )])

    def stage_failed(self, run_id: str, stage: str, error: dict[str, Any],
                     status: StageStatus = "failed") -> None:
        self._write([(
            "UPDATE stages SET status=?, error_json=?, finished_at=? WHERE run_id=? AND stage=?",
            (status, _dumps(error), time.time(), run_id, stage),
        )])

    def reset_stages(self, run_id: str, stages: Sequence[str]) -> None:
        """Downstream of a changed plan: back to pending, outputs dropped (one transaction)."""
        self._write([(
            "UPDATE stages SET status='pending', outputs_json=NULL, error_json=NULL, inputs_hash=NULL "
            "WHERE run_id=? AND stage=?", (run_id, s)) for s in stages])

    def stages(self, run_id: str) -> list[StageRecord]:
        rows = self._read("SELECT * FROM stages WHERE run_id=? ORDER BY position", (run_id,))
        return self._stages(rows)

    def get_stage(self, run_id: str, stage: str) -> StageRecord | None:
        rows = self._read("SELECT * FROM stages WHERE run_id=? AND stage=?", (run_id, stage))
        return self._stages(rows)[0] if rows else None

    def find_done(self, stage: str, inputs_hash: str) -> StageRecord | None:
        """The newest completed record of ``stage`` with these inputs, in any run.

        A 'skipped' record carries the outputs it reused, so it counts as done here too."""
        rows = self._read(
            "SELECT s.* FROM stages s JOIN runs r ON r.run_id = s.run_id "
            "WHERE s.stage=? AND s.inputs_hash=? AND s.status IN ('done','skipped') "
            "AND s.outputs_json IS NOT NULL ORDER BY r.seq DESC, s.finished_at DESC LIMIT 1",
            (stage, inputs_hash),
        )
        return self._stages(rows)[0] if rows else None


class _Fields:
    """One row's columns read back with their expected kinds. A value of the wrong kind (text that is
    not JSON, JSON that is not an object, a number stored as words, an unknown status) is replaced by
    a safe default and its column noted, so a damaged record is shown as damaged and never trusted
    (its stage runs again) instead of crashing ``status`` or ``auto``."""

    def __init__(self, row: sqlite3.Row) -> None:
        self.row = row
        self.damaged: list[str] = []

    def _bad(self, column: str, default: Any) -> Any:
        self.damaged.append(column)
        return default

    def json_object(self, column: str, *, empty: Any = None) -> Any:
        text = self.row[column]
        if text is None:
            return empty
        try:
            value = json.loads(text) if isinstance(text, str) else None
        except ValueError:
            value = None
        return value if isinstance(value, dict) else self._bad(column, empty)

    def number(self, column: str, kind: type, default: Any) -> Any:
        value = self.row[column]
        if value is None and default is None:
            return None
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) and (
            kind is float or isinstance(value, int)) else self._bad(column, default)

    def text(self, column: str) -> str | None:
        value = self.row[column]
        return value if value is None or isinstance(value, str) else self._bad(column, None)

    def status(self, allowed: Sequence[str]) -> Any:
        # unknown: the record cannot say how it ended, so it counts as interrupted (the rerun redoes it)
        value = self.row["status"]
        return value if value in allowed else self._bad("status", "interrupted")


def _run(row: sqlite3.Row) -> RunRecord:
    f = _Fields(row)
    return RunRecord(
        run_id=row["run_id"], seq=f.number("seq", int, 0), status=f.status(RUN_STATUSES),
        started_at=f.number("started_at", float, None), finished_at=f.number("finished_at", float, None),
        plan_id=f.text("plan_id"), args=f.json_object("args_json", empty={}),
        error=f.json_object("error_json"), damaged=tuple(f.damaged))


def _stage(row: sqlite3.Row) -> StageRecord:
    f = _Fields(row)
    return StageRecord(
        run_id=row["run_id"], stage=row["stage"], position=f.number("position", int, 0),
        status=f.status(STAGE_STATUSES), inputs_hash=f.text("inputs_hash"), plan_id=f.text("plan_id"),
        outputs=f.json_object("outputs_json"), error=f.json_object("error_json"),
        started_at=f.number("started_at", float, None), finished_at=f.number("finished_at", float, None),
        attempts=f.number("attempts", int, 0), damaged=tuple(f.damaged))


class StateStore:
    """Async facade: each call runs the blocking core in a worker thread, off the event loop."""

    def __init__(self, sync: SyncStateStore) -> None:
        self.sync = sync

    @classmethod
    async def open(cls, path: Path, *, lock_path: Path | None = None) -> "StateStore":
        return cls(await anyio.to_thread.run_sync(lambda: SyncStateStore(path, lock_path=lock_path)))

    async def aclose(self) -> None:
        await anyio.to_thread.run_sync(self.sync.close)

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # abandon_on_cancel=False (the default): a cancelled caller still waits for the commit or
        # rollback, so a transaction is never left half-done by a signal.
        return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))

    async def create_run(self, stages: Sequence[str], args: dict[str, Any] | None = None) -> RunRecord:
        return await self._call(self.sync.create_run, stages, args)

    async def reopen_run(self, run_id: str) -> None:
        await self._call(self.sync.reopen_run, run_id)

    async def finish_run(self, run_id: str, status: RunStatus, error: dict[str, Any] | None = None) -> None:
        await self._call(self.sync.finish_run, run_id, status, error)

    async def set_run_plan(self, run_id: str, plan_id: str) -> None:
        await self._call(self.sync.set_run_plan, run_id, plan_id)

    async def latest_run(self) -> RunRecord | None:
        return await self._call(self.sync.latest_run)

    async def get_run(self, run_id: str) -> RunRecord | None:
        return await self._call(self.sync.get_run, run_id)

    async def mark_stale_runs_interrupted(self) -> int:
        return await self._call(self.sync.mark_stale_runs_interrupted)

    async def prune_runs(self, keep: int, protect: Sequence[str] = ()) -> list[str]:
        return await self._call(self.sync.prune_runs, keep, protect)

    async def stage_running(self, run_id: str, stage: str, inputs_hash: str | None, plan_id: str | None) -> None:
        await self._call(self.sync.stage_running, run_id, stage, inputs_hash, plan_id)

    async def stage_done(self, run_id: str, stage: str, outputs: dict[str, Any] | None) -> None:
        await self._call(self.sync.stage_done, run_id, stage, outputs)

    async def stage_skipped(self, run_id: str, stage: str, inputs_hash: str | None, plan_id: str | None,
                            outputs: dict[str, Any] | None, reason: str) -> None:
        await self._call(self.sync.stage_skipped, run_id, stage, inputs_hash, plan_id, outputs, reason)

    async def stage_failed(self, run_id: str, stage: str, error: dict[str, Any],
                           status: StageStatus = "failed") -> None:
        await self._call(self.sync.stage_failed, run_id, stage, error, status)

    async def reset_stages(self, run_id: str, stages: Sequence[str]) -> None:
        await self._call(self.sync.reset_stages, run_id, stages)

    async def stages(self, run_id: str) -> list[StageRecord]:
        return await self._call(self.sync.stages, run_id)

    async def get_stage(self, run_id: str, stage: str) -> StageRecord | None:
        return await self._call(self.sync.get_stage, run_id, stage)

    async def find_done(self, stage: str, inputs_hash: str) -> StageRecord | None:
        return await self._call(self.sync.find_done, stage, inputs_hash)

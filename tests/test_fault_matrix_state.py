"""Faults of the home's state and of the environment, as tables: fault × command → exit code, message,
what is on disk, what the rerun does (docs/faults-state.md).

Damaged ``state.db`` records and pages, a malformed ``HF_ENDPOINT``, SIGTERM to every command, the
failure event every failing command leaves in ``logs/hotfit.jsonl``, and a killed run's recorded PID.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from hotfit.pipeline.cli import main
from hotfit.pipeline.cli.status import LAST_RUN_FAILED
from hotfit.pipeline.manifest import Manifest, write_manifest
from hotfit.state.store import SyncStateStore
from tests.conftest import REPO_ROOT
from tests.e2e_support import GiB, World, write_probe
from tests.gguf_fixtures import write_standin_llama_server
from tests.hubserver import LocalHub


def log_events(home: Path) -> list[dict]:
    path = home / "logs" / "hotfit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# --------------------------------------------------------------------------- malformed HF_ENDPOINT

ENDPOINTS = ["http://[::1", "http://127.0.0.1:99999", "127.0.0.1:8080", "http://"]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("argv", [["pull", "qwen3.5-0.8b"], ["auto"], ["auto", "--dry-run"]], ids=" ".join)
def test_a_malformed_hf_endpoint_is_exit_2_naming_the_variable(
        endpoint: str, argv: list[str], hotfit_home: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    out = io.StringIO()
    assert main(["--json", *argv], out=out) == 2
    err = json.loads(out.getvalue())["error"]
    assert "HF_ENDPOINT" in err["message"] and err["details"] == {"variable": "HF_ENDPOINT", "value": endpoint}
    assert "Traceback" not in capsys.readouterr().err


# --------------------------------------------------------------------------- a killed run's recorded PID

STAGES = ["probe", "plan", "fetch-weights", "fetch-template", "verify", "load", "probe-tool-call", "re-check"]

# A pipeline that holds the home's lock with a run whose `load` is running, then waits to be killed.
_RUNNING_PIPELINE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from hotfit.state.locks import FileLock
    from hotfit.state.store import SyncStateStore
    home = Path(sys.argv[1])
    with FileLock(home / "pipeline.lock"):
        store = SyncStateStore(home / "state.db")
        run = store.create_run(sys.argv[2:])
        for stage in sys.argv[2:7]:
            store.stage_running(run.run_id, stage, "h-" + stage, "plan-x")
            store.stage_done(run.run_id, stage, {"ok": True})
        store.stage_running(run.run_id, "load", "h-load", "plan-x")
        print("loading", flush=True)
        time.sleep(120)
""")


def status_json(home: Path, rc: int = 0) -> dict:
    out = io.StringIO()
    assert main(["--home", str(home), "--log-format", "json", "status", "--json"], out=out) == rc
    return json.loads(out.getvalue())


def status_text(home: Path, rc: int = 0) -> str:
    out = io.StringIO()
    assert main(["--home", str(home), "--log-format", "json", "status"], out=out) == rc
    return out.getvalue()


def test_after_kill_9_status_says_interrupted_everywhere_and_never_it_is_running(tmp_path: Path) -> None:
    home = tmp_path / "home"
    proc = subprocess.Popen([sys.executable, "-c", _RUNNING_PIPELINE, str(home), *STAGES], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "loading"
        alive = status_json(home)  # while it runs: held, and the rerun would wait for it
        assert alive["lock"]["held"] and alive["lock"]["holder_pid"] == proc.pid
        assert alive["run"]["status"] == "running"
    finally:
        proc.kill()  # kill -9: the lock file still names the dead PID, the record still says running
        proc.wait()
    # killed: the last run ended interrupted, which status answers with LAST_RUN_FAILED (an alert)
    data = status_json(home, LAST_RUN_FAILED)
    assert data["lock"] == {"held": False} and data["run"]["status"] == "interrupted"
    assert "at load (it is interrupted)" in data["rerun"] and "running" not in data["rerun"]
    text = status_text(home, LAST_RUN_FAILED)
    assert "load             interrupted" in text and "it is running" not in text


def test_a_recorded_pid_now_used_by_another_process_is_not_the_holder(tmp_path: Path) -> None:
    # The dead pipeline's PID reused by an unrelated process (it holds no lock): not "running".
    home = tmp_path / "home"
    store = SyncStateStore(home / "state.db")
    run = store.create_run(STAGES)
    store.stage_running(run.run_id, "probe", "h", None)
    store.close()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (home / "pipeline.lock").write_text(f"{other.pid} hotfit auto\n")
        data = status_json(home, LAST_RUN_FAILED)
        assert data["lock"] == {"held": False}
        assert data["run"]["status"] == "interrupted" and "(it is interrupted)" in data["rerun"]
    finally:
        other.kill()
        other.wait()


# --------------------------------------------------------------------------- damaged state.db
# A real state.db from a real run: `hotfit auto` on the local Hub with the stand-in llama-server runs
# probe → verify and fails at load (exit 5), leaving done, failed and run records to damage. Each row
# damages one table's field (or a whole data page) of a copy of that home, then `status` and a rerun
# of `auto` are run: exit codes, what is said, what the rerun runs again.

BAD_JSON = "{not json"


@dataclass(frozen=True)
class Damage:
    name: str
    sql: str | None  # an UPDATE on the real records; None: garble a page (``page_of``)
    status_rc: int
    auto_rc: int  # 5: the rerun went past the damage to the stand-in's load failure
    damaged: tuple[str, str, str] | None = None  # (table, stage or "", column) `status --json` flags
    reruns: str | None = None  # a stage the rerun runs again instead of reusing its record
    page_of: str | None = None  # the table whose first page gets random bytes


DAMAGES = [
    Damage("stages.outputs_json not JSON",
           f"UPDATE stages SET outputs_json='{BAD_JSON}' WHERE stage='fetch-template'", 0, 5,
           damaged=("stages", "fetch-template", "outputs_json"), reruns="fetch-template"),
    Damage("stages.outputs_json a list", "UPDATE stages SET outputs_json='[1, 2]' WHERE stage='verify'", 0, 5,
           damaged=("stages", "verify", "outputs_json"), reruns="verify"),
    Damage("stages.error_json not JSON", f"UPDATE stages SET error_json='{BAD_JSON}' WHERE stage='load'", 0, 5,
           damaged=("stages", "load", "error_json")),
    Damage("stages.error_json a string", "UPDATE stages SET error_json='\"boom\"' WHERE stage='load'", 0, 5,
           damaged=("stages", "load", "error_json")),
    Damage("stages.status unknown", "UPDATE stages SET status='exploded' WHERE stage='verify'", 0, 5,
           damaged=("stages", "verify", "status"), reruns="verify"),
    Damage("stages.attempts text", "UPDATE stages SET attempts='many' WHERE stage='load'", 0, 5,
           damaged=("stages", "load", "attempts")),
    Damage("stages.started_at text", "UPDATE stages SET started_at='noon' WHERE stage='probe'", 0, 5,
           damaged=("stages", "probe", "started_at")),
    Damage("stages.inputs_hash a blob", "UPDATE stages SET inputs_hash=X'00ff' WHERE stage='fetch-weights'", 0, 5,
           damaged=("stages", "fetch-weights", "inputs_hash"), reruns="fetch-weights"),
    Damage("stages.finished_at text", "UPDATE stages SET finished_at='later' WHERE stage='load'", 0, 5,
           damaged=("stages", "load", "finished_at")),
    Damage("stages.plan_id a blob", "UPDATE stages SET plan_id=X'ff' WHERE stage='plan'", 0, 5,
           damaged=("stages", "plan", "plan_id")),
    Damage("stages.position text", "UPDATE stages SET position='first' WHERE stage='probe'", 0, 5,
           damaged=("stages", "probe", "position")),
    Damage("runs.args_json not JSON", f"UPDATE runs SET args_json='{BAD_JSON}'", 0, 5,
           damaged=("runs", "", "args_json")),
    Damage("runs.error_json not JSON", f"UPDATE runs SET error_json='{BAD_JSON}'", 0, 5,
           damaged=("runs", "", "error_json")),
    Damage("runs.status unknown", "UPDATE runs SET status='exploded'", 0, 5, damaged=("runs", "", "status")),
    Damage("runs.started_at text", "UPDATE runs SET started_at='noon'", 0, 5, damaged=("runs", "", "started_at")),
    Damage("runs.finished_at text", "UPDATE runs SET finished_at='later'", 0, 5, damaged=("runs", "", "finished_at")),
    Damage("runs.plan_id a blob", "UPDATE runs SET plan_id=X'ff'", 0, 5, damaged=("runs", "", "plan_id")),
    Damage("runs.seq text", "UPDATE runs SET seq='first'", 0, 5, damaged=("runs", "", "seq")),
    Damage("meta.schema garbled", "UPDATE meta SET value='zz' WHERE key='schema'", 2, 2),
    Damage("stages data page random bytes", None, 2, 2, page_of="stages"),
    Damage("runs data page random bytes", None, 2, 2, page_of="runs"),
]


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_standin_llama_server(tmp_path_factory.mktemp("standin") / "llama-server")


@pytest.fixture(scope="module")
def real_home(hub: LocalHub, plain_world: World, standin: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A home after a real `hotfit auto` that ran probe → verify and failed at load."""
    root = tmp_path_factory.mktemp("real-run")
    hub.clear_faults()
    done = run_auto(hub, root / "home", plain_world, write_probe(root / "probe.json", 8 * GiB), standin)
    assert done.returncode == 5, done.stderr[-3000:]
    return root / "home"


def run_auto(hub: LocalHub, home: Path, world: World, probe: Path, server: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HOTFIT_HOME", "HF_TOKEN", "CONTENOX_LLAMA_KV_CACHE_TYPE")}
    env.update(hub.env(), HOTFIT_LLAMA_SERVER=str(server))
    return subprocess.run([sys.executable, "-m", "hotfit", "--home", str(home), "--log-format", "json", "auto",
                           "--registry", str(world.registry_path), "--probe-file", str(probe), "--json"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)


def garble_page(db: Path, table: str) -> None:
    """Random bytes (seeded) over the cell area of ``table``'s root page, the header left whole."""
    with sqlite3.connect(db) as conn:
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name=?", (table,)).fetchone()
    rnd = random.Random(table)
    with open(db, "r+b") as fh:
        fh.seek((root - 1) * page_size + 8)  # past the 8-byte b-tree leaf header
        fh.write(bytes(rnd.randrange(256) for _ in range(page_size - 8)))


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda d: d.name)
def test_damaged_state_db_is_exit_2_naming_the_file_or_the_unreadable_stage_reruns(
        damage: Damage, real_home: Path, hub: LocalHub, plain_world: World, standin: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    shutil.copytree(real_home, home)
    db = home / "state.db"
    assert not db.with_name("state.db-wal").exists() or db.with_name("state.db-wal").stat().st_size == 0
    if damage.sql is not None:
        with sqlite3.connect(db) as conn:
            conn.execute(damage.sql)
    else:
        assert damage.page_of is not None
        garble_page(db, damage.page_of)

    out = io.StringIO()
    rc = main(["--home", str(home), "--log-format", "json", "status", "--json"], out=out)
    # The home's last auto failed at load, so where status reads the records it answers
    # LAST_RUN_FAILED (docs/operations.md); a database it cannot read stays exit 2.
    expected_rc = LAST_RUN_FAILED if damage.status_rc == 0 else damage.status_rc
    assert rc == expected_rc, out.getvalue()[-2000:]
    answer = json.loads(out.getvalue())
    if rc == 2:
        err = answer["error"]
        assert str(db) in err["message"] and f"mv {db}*" in err["hint"]
        assert err["details"]["state_db"] == str(db)
    else:
        flagged = {(t, s, c) for t, s, c in _damaged(answer)}
        assert damage.damaged in flagged
        status_text = io.StringIO()
        assert main(["--home", str(home), "status"], out=status_text) == LAST_RUN_FAILED
        assert f"[damaged record: {damage.damaged[2]}" in status_text.getvalue()

    lines_before = len(log_events(home))
    rerun = run_auto(hub, home, plain_world, write_probe(tmp_path / "probe.json", 8 * GiB), standin)
    assert rerun.returncode == damage.auto_rc, rerun.stderr[-3000:]
    assert "Traceback" not in rerun.stderr
    if rerun.returncode == 2:
        err = json.loads(rerun.stdout)["error"]
        assert str(db) in err["message"] and f"mv {db}*" in err["hint"]
        # the fix the message names, then a rerun: the downloads on disk are reused
        aside = home / "state-unusable"
        aside.mkdir()
        for p in home.glob("state.db*"):
            p.rename(aside / p.name)
        hub.reset_counters()
        again = run_auto(hub, home, plain_world, write_probe(tmp_path / "probe.json", 8 * GiB), standin)
        assert again.returncode == 5, again.stderr[-3000:]
        assert hub.bytes_sent() == 0
    events = log_events(home)[lines_before:]
    if damage.reruns:
        story = [(e["event"], e.get("stage")) for e in events if e["event"].startswith("stage.")]
        assert ("stage.start", damage.reruns) in story and ("stage.skip", damage.reruns) not in story
    assert any(e["event"] == "state.record_damaged" for e in events) or damage.auto_rc == 2 or not damage.damaged


def _damaged(status: dict) -> list[tuple[str, str, str]]:
    found = [("runs", "", c) for c in (status["run"] or {}).get("damaged", [])]
    for s in status["stages"]:
        found += [("stages", s["stage"], c) for c in s.get("damaged", [])]
    return found


# --------------------------------------------------------------------------- SIGTERM to every command
# Each command is held at a real blocking point (a throttled download, a llama-server that never
# answers --list-devices, a Hub API answer paced to a trickle, a grade endpoint that never answers),
# then its process group gets SIGTERM as a supervisor (systemd's control group) sends it.

MiB = 1 << 20


def hotfit_env(hub: LocalHub, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HOTFIT_HOME", "HF_TOKEN", "CONTENOX_LLAMA_KV_CACHE_TYPE")}
    env.update(hub.env(), **extra)
    return env


def silent_server() -> tuple[socket.socket, str]:
    """A TCP listener that accepts connections and never answers: a hung endpoint."""
    sock = socket.create_server(("127.0.0.1", 0))
    sock.listen(16)
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def sleeping_server(path: Path, started: Path) -> Path:
    """A llama-server stand-in whose `--list-devices` never returns (a wedged driver call); it
    creates ``started`` when called."""
    path.write_text(f"#!/bin/sh\ntouch '{started}'\nexec sleep 600\n")
    path.chmod(0o755)
    return path


def _wait_until(predicate, proc: subprocess.Popen[str], what: str, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s  # a hang guard, not a timing assertion
    while not predicate():
        assert proc.poll() is None, f"exited {proc.returncode} before {what}: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def _log_has(home: Path, event: str) -> bool:
    try:
        return any(e.get("event") == event for e in log_events(home))
    except ValueError:  # a line being written
        return False


SIGTERM_CASES = ["pull", "auto", "auto on a provisioned home", "probe", "plan", "registry lock", "grade"]


def provisioned(home: Path, entry: str) -> None:
    """A manifest as a finished run leaves it: `auto` then checks it still holds (probe, plan) first."""
    write_manifest(home / "manifest.json", Manifest(
        run_id="r1", plan_id="p1", written_at="2026-11-29T00:00:00Z", entry_name=entry,
        model_path=str(home / "models" / entry / "m.gguf"), model_size_bytes=10, model_sha256=None,
        template_path=None, projector_path=None, kv_cache_type="f16", planned_hot_context_tokens=40000,
        measured={"opened_context_tokens": 40192}, probe_verdict={"passed": True}, backend_build={}, device={},
        plan={}))


@pytest.mark.parametrize("command", SIGTERM_CASES)
def test_sigterm_is_exit_130_with_a_message_and_a_logged_failure_for_every_command(
        command: str, hub: LocalHub, plain_world: World, tmp_path: Path) -> None:
    home = tmp_path / "home"
    hub.clear_faults()
    base = [sys.executable, "-m", "hotfit", "--home", str(home), "--log-format", "json"]
    env = hotfit_env(hub)
    listener = None
    large = plain_world.entry("fx-agent-large")
    if command in ("pull", "auto"):
        (tmp_path / "standin").mkdir()
        env["HOTFIT_LLAMA_SERVER"] = str(write_standin_llama_server(tmp_path / "standin" / "llama-server"))
        hub.inject(file="*.gguf", throughput_bps=200_000, times=None)
        argv = (["pull", large.name] if command == "pull" else ["auto", "--probe-file",
                str(write_probe(tmp_path / "probe.json", 8 * GiB))]) + ["--registry", str(plain_world.registry_path)]
        ready = lambda: any((home / "models" / large.name / ".partial").glob("*.json"))  # noqa: E731
    elif command in ("probe", "plan", "auto on a provisioned home"):
        started = tmp_path / "list-devices-called"
        env["HOTFIT_LLAMA_SERVER"] = str(sleeping_server(tmp_path / "llama-server", started))
        argv = [command]
        if command.startswith("auto"):  # the probe of the check that the provisioning still holds
            provisioned(home, large.name)
            argv = ["auto", "--registry", str(plain_world.registry_path)]
        ready = started.exists
    elif command == "registry lock":
        hub.inject(url="/api/models/*", throughput_bps=1, times=None)
        unpinned = tmp_path / "unpinned.json"
        data = json.loads(plain_world.registry_path.read_text())
        entry = data["entries"][0]
        entry["artifact"]["revision"] = None  # not yet pinned: lock asks the Hub
        entry.update(auto_eligible=False, ineligible_reason="not yet pinned", ineligible_cause="unverified")
        unpinned.write_text(json.dumps(data))
        argv = ["registry", "lock", "--registry", str(unpinned)]
        ready = lambda: _log_has(home, "registry.lock.query")  # noqa: E731
    else:
        listener, url = silent_server()
        argv = ["grade", "--endpoint", url, "--tier", "quick"]
        ready = lambda: _log_has(home, "grade.start")  # noqa: E731
    proc = subprocess.Popen([*base, *argv, "--json"], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_until(ready, proc, f"{command} to reach its blocking point")
        time.sleep(0.3)  # into the blocking call itself (either side of it must give 130 too)
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if listener is not None:
            listener.close()
        hub.clear_faults()
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted by SIGTERM" in err and "Traceback" not in err
    assert json.loads(out)["error"]["code"] == "interrupted"
    failed = [e for e in log_events(home) if e["event"] == "command.failed"]
    assert len(failed) == 1 and failed[0]["exit_code"] == 130 and failed[0]["signal"] == "SIGTERM"
    assert failed[0]["command"] == " ".join(argv[:2] if argv[0] == "registry" else argv[:1])
    assert failed[0]["error"]["code"] == "interrupted"


# --------------------------------------------------------------------------- every failure is logged

def _missing_repo_registry(world: World, path: Path) -> Path:
    data = json.loads(world.registry_path.read_text())
    data["entries"][0]["artifact"]["repo"] = "hotfit-fixtures/no-such-repo"
    path.write_text(json.dumps(data))
    return path


FAILURES = [  # (argv, exit code, error code): each must leave one command.failed in the home's log
    (["pull", "no-such-model"], 2, "usage"),
    (["pull", "fx-agent-large", "--registry", "{missing_repo}"], 4, "hub"),
    (["plan", "--probe-file", "{tmp}/absent.json"], 2, "usage"),
    (["auto", "--grade-tier", "quick"], 2, "usage"),
    (["grade", "--endpoint", "localhost:8080"], 2, "usage"),
    (["registry", "lock", "--registry", "{tmp}/absent.json"], 2, "usage"),
    (["status"], 2, "usage"),  # with a state.db that is not a database
    (["serve"], None, None),  # nothing provisioned: whatever code, it is logged
]


@pytest.mark.parametrize("argv, exit_code, code", FAILURES, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_every_failing_command_leaves_command_fail_with_its_exit_code_in_the_log(
        argv: list[str], exit_code: int | None, code: str | None, hub: LocalHub, plain_world: World,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    hub.clear_faults()
    if argv == ["status"]:
        home.mkdir()
        (home / "state.db").write_bytes(b"not a database" * 100)
    fill = {"tmp": str(tmp_path), "missing_repo": str(_missing_repo_registry(plain_world, tmp_path / "r.json"))}
    argv = [a.format(**fill) for a in argv]
    if argv[0] == "pull" and "--registry" not in argv:
        argv += ["--registry", str(plain_world.registry_path)]
    out = io.StringIO()
    rc = main(["--home", str(home), "--log-format", "json", *argv, "--json"], out=out)
    assert rc != 0
    if exit_code is not None:
        assert rc == exit_code and json.loads(out.getvalue())["error"]["code"] == code
    failed = [e for e in log_events(home) if e["event"] == "command.failed"]
    assert len(failed) == 1, log_events(home)[-5:]
    assert failed[0]["exit_code"] == rc and failed[0]["command"] == " ".join(argv[:2] if argv[0] == "registry"
                                                                             else argv[:1])
    assert failed[0]["error"]["exit_code"] == rc and failed[0]["level"] == "error"


def test_a_bad_setting_is_logged_in_an_existing_home_and_creates_no_home(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://[::1")
    existing = tmp_path / "existing"
    (existing / "logs").mkdir(parents=True)
    assert main(["--home", str(existing), "status"], out=io.StringIO()) == 2
    (failed,) = [e for e in log_events(existing) if e["event"] == "command.failed"]
    assert failed["exit_code"] == 2 and "HF_ENDPOINT" in failed["error"]["message"]
    fresh = tmp_path / "fresh"
    assert main(["--home", str(fresh), "status"], out=io.StringIO()) == 2
    assert not fresh.exists()


# --------------------------------------------------------------------------- a server that makes no progress

def test_pull_from_a_server_sending_one_byte_per_connection_gives_up_with_exit_11_and_the_rerun_resumes(
        hub: LocalHub, plain_world: World, tmp_path: Path) -> None:
    home = tmp_path / "home"
    large = plain_world.entry("fx-agent-large")
    argv = [sys.executable, "-m", "hotfit", "--home", str(home), "--log-format", "json", "pull", large.name,
            "--registry", str(plain_world.registry_path), "--json"]
    hub.clear_faults()
    hub.inject(method="GET", file="*.gguf", close_after_bytes=1, times=None)
    try:
        # the default policy: 6 attempts, waits 0.5 + 1 + 2 + 4 + 8 s (+ jitter); before: never ended
        failed = subprocess.run(argv, cwd=REPO_ROOT, env=hotfit_env(hub), capture_output=True, text=True, timeout=120)
    finally:
        hub.clear_faults()
    assert failed.returncode == 11, failed.stderr[-3000:]  # a passing fault (core.errors)
    err = json.loads(failed.stdout)["error"]
    assert "gave up (6 attempts in a row brought less than 1048576 bytes)" in err["message"]
    assert err["details"]["gave_up"].startswith("6 attempts") and "rerun" in err["hint"]
    (logged,) = [e for e in log_events(home) if e["event"] == "command.failed"]
    assert logged["exit_code"] == 11 and logged["command"] == "pull"
    hub.reset_counters()
    again = subprocess.run(argv, cwd=REPO_ROOT, env=hotfit_env(hub), capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    weights = json.loads(again.stdout)["fetch"]["weights"]
    assert weights["resumed_from_bytes"] == err["details"]["done_bytes"] > 0  # the bytes that trickled in are kept
    assert hub.bytes_sent(large.artifact.file) == large.artifact.size_bytes - weights["resumed_from_bytes"]

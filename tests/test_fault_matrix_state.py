"""Faults of the home's state and of the environment, as tables: fault × command → exit code, message,
what is on disk, what the rerun does (docs/faults-state.md).

Damaged ``state.db`` records and pages, a malformed ``HF_ENDPOINT``, SIGTERM to every command, the
failure event every failing command leaves in ``logs/hotfit.jsonl``, and a killed run's recorded PID.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.cli import main
from state.store import SyncStateStore
from tests.conftest import REPO_ROOT


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
    from state.locks import FileLock
    from state.store import SyncStateStore
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


def status_json(home: Path) -> dict:
    out = io.StringIO()
    assert main(["--home", str(home), "--log-format", "json", "status", "--json"], out=out) == 0
    return json.loads(out.getvalue())


def status_text(home: Path) -> str:
    out = io.StringIO()
    assert main(["--home", str(home), "--log-format", "json", "status"], out=out) == 0
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
    data = status_json(home)
    assert data["lock"] == {"held": False} and data["run"]["status"] == "interrupted"
    assert "at load (it is interrupted)" in data["rerun"] and "running" not in data["rerun"]
    text = status_text(home)
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
        data = status_json(home)
        assert data["lock"] == {"held": False}
        assert data["run"]["status"] == "interrupted" and "(it is interrupted)" in data["rerun"]
    finally:
        other.kill()
        other.wait()

"""hotfit status: stage state of the current run, the provisioned model, what a rerun would do."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hotfit.pipeline.cli import main
from hotfit.pipeline.manifest import Manifest, write_manifest
from hotfit.state.store import SyncStateStore

TIER = "unit"

STAGES = ["probe", "plan", "fetch-weights", "fetch-template", "verify", "load", "probe-tool-call", "re-check"]
REPO = Path(__file__).resolve().parent.parent


def status(home: Path, *extra: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(["--home", str(home), "--log-format", "json", "status", *extra], out=out)
    return code, out.getvalue()


def test_empty_home_says_a_fresh_run(tmp_path: Path) -> None:
    code, text = status(tmp_path / "home", "--json")
    data = json.loads(text)
    assert code == 0
    assert data["run"] is None and data["stages"] == [] and data["provisioned"] is None
    assert data["rerun"].startswith("a fresh run")


def test_killed_run_shows_interrupted_and_where_a_rerun_resumes(tmp_path: Path) -> None:
    home = tmp_path / "home"
    store = SyncStateStore(home / "state.db")
    run = store.create_run(STAGES)
    for stage in ("probe", "plan", "fetch-weights"):
        store.stage_running(run.run_id, stage, f"h-{stage}", "plan-x")
        store.stage_done(run.run_id, stage, {"ok": True})
    store.stage_running(run.run_id, "fetch-template", "h-t", "plan-x")  # then kill -9
    store.close()

    code, text = status(home, "--json")
    data = json.loads(text)
    assert code == 10  # a killed run is a failed last run, for an alerting check (docs/operations.md)
    assert data["last_auto_failed"] is True
    assert data["run"]["run_id"] == run.run_id and data["run"]["status"] == "interrupted"
    by_stage = {s["stage"]: s for s in data["stages"]}
    assert by_stage["fetch-weights"]["status"] == "done"
    assert by_stage["fetch-template"]["status"] == "running"  # raw record; the run says interrupted
    assert f"resume run {run.run_id} at fetch-template" in data["rerun"]
    assert "fetch-weights" in data["rerun"]

    code, human = status(home)
    assert "fetch-template   interrupted" in human
    assert "a rerun would: resume run" in human


def test_failed_stage_shows_its_error(tmp_path: Path) -> None:
    home = tmp_path / "home"
    store = SyncStateStore(home / "state.db")
    run = store.create_run(STAGES)
    store.stage_running(run.run_id, "probe", "h", None)
    store.stage_failed(run.run_id, "probe", {"code": "hardware_probe", "message": "NVML failed: driver gone"})
    store.finish_run(run.run_id, "failed", {"code": "hardware_probe"})
    store.close()
    code, human = status(home)
    assert code == 10
    assert "probe            failed — NVML failed: driver gone" in human


def test_provisioned_model_and_missing_file_are_reported(tmp_path: Path) -> None:
    home = tmp_path / "home"
    model = home / "models" / "m" / "m.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(b"x" * 10)
    manifest = Manifest(
        run_id="r1", plan_id="p1", written_at="2026-11-29T00:00:00Z", entry_name="m", model_path=str(model),
        model_size_bytes=10, model_sha256=None, template_path=None, projector_path=None, kv_cache_type="q8_0",
        planned_hot_context_tokens=40000, measured={"opened_context_tokens": 40192}, probe_verdict={"passed": True},
        backend_build={}, device={}, plan={},
    )
    write_manifest(home / "manifest.json", manifest)
    store = SyncStateStore(home / "state.db")
    run = store.create_run(STAGES)
    store.finish_run(run.run_id, "done")
    store.close()

    data = json.loads(status(home, "--json")[1])
    assert data["provisioned"]["entry_name"] == "m" and data["provisioned_problems"] == []
    assert data["rerun"].startswith("nothing")
    assert "40192 tokens opened" in status(home)[1]

    model.write_bytes(b"x" * 5)  # truncated behind hotfit's back
    data = json.loads(status(home, "--json")[1])
    assert data["provisioned_problems"] == [f"model file has 5 bytes, expected 10"]
    assert not data["rerun"].startswith("nothing")


_HOLDER = textwrap.dedent("""
    import sys, time
    from hotfit.state.locks import FileLock
    with FileLock(sys.argv[1]):
        print("held", flush=True)
        time.sleep(60)
""")


@pytest.mark.integration
def test_lock_holder_is_named(tmp_path: Path) -> None:
    home = tmp_path / "home"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(home / "pipeline.lock")], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        data = json.loads(status(home, "--json")[1])
        assert data["lock"]["held"] and data["lock"]["holder_pid"] == holder.pid
        assert f"PID {holder.pid}" in data["rerun"]
    finally:
        holder.kill()
        holder.wait()
    data = json.loads(status(home, "--json")[1])
    assert data["lock"] == {"held": False}  # the dead holder's text does not count


def test_corrupt_state_db_is_a_clear_error_with_exit_2(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "state.db").write_bytes(b"garbage" * 200)
    code, text = status(home, "--json")
    assert code == 2
    error = json.loads(text)["error"]
    assert "state.db" in error["message"] and error["hint"]  # (a traceback would have raised from main)


def test_unreadable_manifest_is_reported_not_crashed_on(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "manifest.json").write_text("[]")
    code, text = status(home, "--json")
    assert code == 0
    data = json.loads(text)
    assert data["provisioned"] is None
    assert any("manifest.json" in p and "unreadable" in p for p in data["provisioned_problems"])
    assert "unreadable" in status(home)[1]

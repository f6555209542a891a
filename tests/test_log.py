"""Structured logging: JSON lines to stderr and the log file; secrets never rendered."""

from __future__ import annotations

import io
import json
from pathlib import Path

from hotfit.core import log

TIER = "unit"


def test_json_events_go_to_stream_and_file_with_bound_context(tmp_path: Path) -> None:
    stream = io.StringIO()
    log_file = tmp_path / "logs" / "hotfit.jsonl"
    log.configure("json", 0, log_file, stream=stream)
    log.bind(run_id="r1", stage="plan")
    try:
        log.get_logger().info("plan.selected", model="m", hot_context_tokens=40000, hf_token="hf_secret")
        log.get_logger().debug("hidden.at.info")
    finally:
        log.unbind("run_id", "stage")
    lines = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert len(lines) == 1
    event = lines[0]
    assert event["event"] == "plan.selected" and event["run_id"] == "r1" and event["stage"] == "plan"
    assert event["hot_context_tokens"] == 40000 and event["hf_token"] == "***"
    assert "hf_secret" not in log_file.read_text()
    assert json.loads(log_file.read_text().splitlines()[0])["event"] == "plan.selected"


def test_console_renderer_still_writes_json_to_file(tmp_path: Path) -> None:
    stream = io.StringIO()
    log_file = tmp_path / "hotfit.jsonl"
    log.configure("console", 1, log_file, stream=stream)
    log.get_logger().debug("stage.start", stage="probe")
    assert "stage.start" in stream.getvalue()
    assert not stream.getvalue().lstrip().startswith("{")
    assert json.loads(log_file.read_text())["stage"] == "probe"


def test_quiet_keeps_info_events_in_the_file_but_not_on_the_stream(tmp_path: Path) -> None:
    # README: the log file is always appended; -q/-v choose what the stream shows, not what is kept.
    stream = io.StringIO()
    log_file = tmp_path / "hotfit.jsonl"
    log.configure("json", -1, log_file, stream=stream)
    log.get_logger().info("stage.done", stage="plan")
    log.get_logger().warning("download.partial_short", file="m.gguf")
    shown = [json.loads(x)["event"] for x in stream.getvalue().splitlines()]
    kept = [json.loads(x)["event"] for x in log_file.read_text().splitlines()]
    assert shown == ["download.partial_short"]
    assert kept == ["stage.done", "download.partial_short"]


def test_debug_events_reach_the_file_at_default_verbosity(tmp_path: Path) -> None:
    stream = io.StringIO()
    log_file = tmp_path / "hotfit.jsonl"
    log.configure("console", 0, log_file, stream=stream)
    log.get_logger().debug("download.preallocate_skipped", errno=95)
    assert "preallocate_skipped" not in stream.getvalue()
    event = json.loads(log_file.read_text())
    assert event["event"] == "download.preallocate_skipped" and event["level"] == "debug"


def test_cli_quiet_run_still_appends_its_info_events_to_the_home_log(tmp_path: Path) -> None:
    from hotfit.pipeline.cli import main
    from hotfit.planner.probe import Device, ProbeResult

    home = tmp_path / "home"
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps(ProbeResult(devices=(Device(index=0, kind="cpu", name="host", total_bytes=64 << 30,
                                                                free_bytes=48 << 30),)).to_json()))
    rc = main(["--home", str(home), "-q", "--log-format", "json", "plan", "--probe-file", str(probe)],
              out=io.StringIO())
    assert rc == 0
    kept = [json.loads(x)["event"] for x in (home / "logs" / "hotfit.jsonl").read_text().splitlines()]
    assert "plan.selected" in kept


def test_rotation_happens_only_at_the_size_and_keep_zero_deletes(tmp_path: Path) -> None:
    log_file = tmp_path / "hotfit.jsonl"
    assert log.rotate_if_full(log_file, 100, 2) is False  # no file yet
    log_file.write_text("x" * 99)
    assert log.rotate_if_full(log_file, 100, 2) is False and log_file.read_text() == "x" * 99
    for marker in "abc":
        log_file.write_text(marker * 100)
        assert log.rotate_if_full(log_file, 100, 2) is True and not log_file.exists()
    assert (tmp_path / "hotfit.jsonl.1").read_text() == "c" * 100
    assert (tmp_path / "hotfit.jsonl.2").read_text() == "b" * 100  # "a" fell off the end
    assert not (tmp_path / "hotfit.jsonl.3").exists()
    log_file.write_text("d" * 100)
    assert log.rotate_if_full(log_file, 100, 0) is True and not log_file.exists()
    assert (tmp_path / "hotfit.jsonl.1").read_text() == "c" * 100  # keep 0: the full file is dropped

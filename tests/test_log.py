"""Structured logging: JSON lines to stderr and the log file; secrets never rendered."""

from __future__ import annotations

import io
import json
from pathlib import Path

from pipeline import log


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

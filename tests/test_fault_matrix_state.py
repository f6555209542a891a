"""Faults of the home's state and of the environment, as tables: fault × command → exit code, message,
what is on disk, what the rerun does (docs/faults-state.md).

Damaged ``state.db`` records and pages, a malformed ``HF_ENDPOINT``, SIGTERM to every command, the
failure event every failing command leaves in ``logs/hotfit.jsonl``, and a killed run's recorded PID.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from pipeline.cli import main


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

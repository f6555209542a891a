"""The CLI surface: every command has --help and --json; errors map to documented exit codes."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from pipeline import errors
from pipeline.cli import EXIT_CODES_HELP, build_parser, main

COMMANDS = [["probe"], ["plan"], ["registry", "list"], ["registry", "lock"], ["pull", "x"], ["auto"], ["status"], ["serve"]]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a))
def test_every_command_has_help_and_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv[:-1], argv[-1], "--help"] if argv[-1] != "x" else ["pull", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--json" in text
    # --json parses both before and after the sub-command.
    parser = build_parser()
    assert parser.parse_args(["--json", *argv]).json is True
    assert parser.parse_args([*argv, "--json"]).json is True


def test_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_exit_codes_documented_in_help_match_error_classes() -> None:
    classes = [errors.UsageError, errors.NoModelQualifies, errors.TransferError, errors.BackendError,
               errors.LockedError, errors.HardwareProbeError, errors.Interrupted]
    for cls in classes:
        assert f"\n  {cls.exit_code} " in EXIT_CODES_HELP, cls.__name__
    # Every leaf maps to its branch's code.
    assert errors.PinMismatch.exit_code == errors.TransferError.exit_code == 4
    assert errors.RegistryError.exit_code == errors.UsageError.exit_code == 2
    assert errors.AllocationMismatch.exit_code == 5


def test_error_json_carries_code_message_hint_and_details() -> None:
    exc = errors.PinMismatch("X-Repo-Commit differs", hint="re-pin with hotfit registry lock", expected="a" * 40)
    data = exc.to_json()
    assert data == {"code": "pin_mismatch", "message": "X-Repo-Commit differs", "exit_code": 4,
                    "hint": "re-pin with hotfit registry lock", "details": {"expected": "a" * 40}}
    assert "→ re-pin" in str(exc)


def test_bad_env_is_reported_as_usage_error_with_json(monkeypatch: pytest.MonkeyPatch, hotfit_home) -> None:
    monkeypatch.setenv("HOTFIT_DOWNLOAD_CONNECTIONS", "many")
    out = io.StringIO()
    rc = main(["--json", "status"], out=out)
    assert rc == 2
    err = json.loads(out.getvalue())["error"]
    assert err["code"] == "usage" and "HOTFIT_DOWNLOAD_CONNECTIONS" in err["message"]


def test_console_script_runs_as_module() -> None:
    proc = subprocess.run([sys.executable, "-m", "pipeline", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "exit codes" in proc.stdout

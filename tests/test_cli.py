"""The CLI surface: every command has --help and --json; errors map to documented exit codes."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hotfit.core import errors
from hotfit.pipeline.cli import EXIT_CODES_HELP, build_parser, main

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
               errors.LockedError, errors.HardwareProbeError, errors.Interrupted, errors.TransientTransferError]
    for cls in classes:
        assert f"\n  {cls.exit_code} " in EXIT_CODES_HELP, cls.__name__
    # Every leaf maps to its branch's code.
    assert errors.PinMismatch.exit_code == errors.TransferError.exit_code == 4
    assert errors.RegistryError.exit_code == errors.UsageError.exit_code == 2
    assert errors.AllocationMismatch.exit_code == 5
    # a passing fault is still a TransferError to catch, with its own code; every code is distinct
    assert errors.HubUnreachable.exit_code == errors.TransientTransferError.exit_code == 11
    assert issubclass(errors.HubUnreachable, errors.HubError)
    assert len({cls.exit_code for cls in classes}) == len(classes)


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
    proc = subprocess.run([sys.executable, "-m", "hotfit", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "exit codes" in proc.stdout


# One argv per command, each as an operator would type it; none of them may reach a traceback.
EVERY_COMMAND = [["probe"], ["plan"], ["registry", "list"], ["pull", "qwen3-4b"], ["auto"], ["status"],
                 ["serve", "--print-command"]]


def _unusable_homes(tmp_path: Path) -> dict[str, Path]:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory\n")
    if os.geteuid() == 0:
        # root writes through a chmod 0555 directory; sysfs refuses new entries even to root
        read_only_parent = Path("/sys/hotfit-test-home")
    else:
        ro = tmp_path / "read-only"
        ro.mkdir()
        ro.chmod(0o555)
        read_only_parent = ro / "home"
    return {"regular file": a_file, "parent is a file": a_file / "sub" / "home",
            "read-only parent": read_only_parent, "under /proc": Path("/proc/hotfit-test-home")}


@pytest.mark.parametrize("case", ["regular file", "parent is a file", "read-only parent", "under /proc"])
@pytest.mark.parametrize("argv", EVERY_COMMAND, ids=lambda a: a[0] if a[0] != "registry" else "registry-list")
def test_an_unusable_home_is_a_usage_error_for_every_command(argv: list[str], case: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    home = _unusable_homes(tmp_path)[case]
    out = io.StringIO()
    rc = main(["--home", str(home), "--json", *argv], out=out)
    assert rc == 2
    err = json.loads(out.getvalue())["error"]
    assert err["code"] == "usage" and str(home) in err["message"] and "--home" in err["message"]
    assert "HOTFIT_HOME" in err["hint"]
    assert err["details"]["home"] == str(home)
    assert "Traceback" not in capsys.readouterr().err


def test_an_unusable_home_from_the_environment_names_the_variable(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "a-file"
    home.write_text("x")
    monkeypatch.setenv("HOTFIT_HOME", str(home))
    out = io.StringIO()
    assert main(["--json", "probe"], out=out) == 2
    assert f"HOTFIT_HOME={home}" in json.loads(out.getvalue())["error"]["message"]


def test_an_unusable_home_exits_2_without_a_traceback_in_a_real_process(tmp_path: Path) -> None:
    home = tmp_path / "a-file"
    home.write_text("x")
    proc = subprocess.run([sys.executable, "-m", "hotfit", "--home", str(home), "probe"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and f"--home {home}" in proc.stderr

"""The type checker runs in CI: mypy, configured under ``[tool.mypy]`` in pyproject.toml, passes on
the configured tree, strict on the pure layers (core/, registry/). CONTRIBUTING.md, "Set-up and tests"."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

TIER = "integration"

ROOT = Path(__file__).resolve().parent.parent
# What ``mypy --strict`` turns on that is settable per module (``strict`` itself is global only).
STRICT_FLAGS = ("disallow_any_generics", "disallow_subclassing_any", "disallow_untyped_calls",
                "disallow_untyped_defs", "disallow_incomplete_defs", "check_untyped_defs",
                "disallow_untyped_decorators", "warn_return_any", "no_implicit_reexport", "strict_equality",
                "extra_checks")


def _mypy(*args: str) -> subprocess.CompletedProcess[str]:
    # The venv's own mypy (the test extra); its cache is .mypy_cache at the root (git-ignored).
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def _config() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_the_configured_tree_type_checks() -> None:
    result = _mypy()
    assert result.returncode == 0, f"mypy failed:\n{result.stdout}{result.stderr}"
    assert "Success: no issues found" in result.stdout, result.stdout


def test_the_checker_reports_a_type_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def width(n: int) -> str:\n    return n\n", encoding="utf-8")
    result = _mypy("--config-file", str(ROOT / "pyproject.toml"), str(bad))
    assert result.returncode == 1 and "[return-value]" in result.stdout, result.stdout + result.stderr


def test_every_package_is_checked_and_the_pure_layers_strictly() -> None:
    config = _config()
    checked = set(config["tool"]["mypy"]["files"])
    packages = set(config["tool"]["importlinter"]["root_packages"])
    assert packages | {"tests"} <= checked, f"not type-checked: {sorted(packages | {'tests'} - checked)}"
    strict = [o for o in config["tool"]["mypy"]["overrides"] if {"hotfit.core.*", "hotfit.registry.*"} <= set(o["module"])]
    assert strict and all(strict[0].get(flag) is True for flag in STRICT_FLAGS), strict

"""The suite's tiers (tests/tiers.py, CONTRIBUTING.md "Test tiers") cannot silently misclassify: a
module without a tier stops the run, and a unit test that starts a process or opens a socket fails —
even when the code under test swallows the refusal. Each case runs a small suite of its own in a
pytest subprocess with only the tiers plugin, so what is shown is the plugin, not this suite."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from tests.tiers import TIERS

TIER = "integration"

REPO = Path(__file__).resolve().parent.parent


def run_suite(tmp_path: Path, modules: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """pytest over ``modules`` (name → source) in ``tmp_path``, with this repository's markers and
    the tiers plugin alone."""
    markers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n" + "".join(f"    {m}\n" for m in markers))
    for name, source in modules.items():
        (tmp_path / name).write_text(textwrap.dedent(source))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.tiers", "-p", "no:cacheprovider",
                           "--strict-markers", "-q", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})


PURE = '''
    TIER = "unit"

    def test_pure():
        assert sum([1, 2]) == 3
'''


def test_a_module_that_declares_no_tier_stops_the_run_naming_it(tmp_path: Path) -> None:
    out = run_suite(tmp_path, {"test_pure.py": PURE, "test_undeclared.py": "def test_x():\n    pass\n"})
    assert out.returncode == pytest.ExitCode.USAGE_ERROR, out.stdout + out.stderr
    assert "test_undeclared.py: declares no tier" in out.stderr and "test_pure" not in out.stderr


def test_an_unknown_tier_and_a_tier_marker_on_a_module_stop_the_run(tmp_path: Path) -> None:
    out = run_suite(tmp_path, {
        "test_typo.py": 'TIER = "units"\n\ndef test_x():\n    pass\n',
        "test_module_marker.py": ('import pytest\n\nTIER = "unit"\npytestmark = pytest.mark.integration\n\n'
                                  'def test_x():\n    pass\n'),
    })
    assert out.returncode == pytest.ExitCode.USAGE_ERROR, out.stdout + out.stderr
    assert "TIER = 'units' is not one of unit, integration, e2e" in out.stderr
    assert "test_module_marker.py: a tier marker on a module or class" in out.stderr


IMPURE = '''
    import socket
    import subprocess

    import pytest

    TIER = "unit"

    def test_starts_a_process():
        subprocess.run(["true"], check=True)

    def test_swallows_the_refusal_of_a_socket():
        try:
            socket.create_connection(("127.0.0.1", 9), timeout=1)
        except Exception:
            pass

    @pytest.mark.integration
    def test_declared_integration_may_start_a_process():
        subprocess.run(["true"], check=True)

    @pytest.mark.llama
    def test_needs_llama_server():
        subprocess.run(["true"], check=True)
'''


def test_a_unit_test_that_starts_a_process_or_opens_a_socket_fails_naming_the_call(tmp_path: Path) -> None:
    out = run_suite(tmp_path, {"test_impure.py": IMPURE}, "-rf")
    assert out.returncode == pytest.ExitCode.TESTS_FAILED, out.stdout + out.stderr
    assert "2 failed, 2 passed" in out.stdout, out.stdout
    assert "FAILED test_impure.py::test_starts_a_process" in out.stdout
    assert "FAILED test_impure.py::test_swallows_the_refusal_of_a_socket" in out.stdout
    assert "subprocess.Popen ['true']" in out.stdout and "socket.connect ('127.0.0.1', 9)" in out.stdout


def test_minus_m_unit_selects_by_the_tier_each_test_ends_up_with(tmp_path: Path) -> None:
    out = run_suite(tmp_path, {"test_impure.py": IMPURE, "test_pure.py": PURE}, "-m", "unit", "--co")
    assert out.returncode == 0, out.stdout + out.stderr
    selected = sorted(line for line in out.stdout.splitlines() if "::" in line)
    # a test marked integration, or marked with a real part (llama), is not in the unit tier
    assert selected == ["test_impure.py::test_starts_a_process", "test_impure.py::test_swallows_the_refusal_of_a_socket",
                        "test_pure.py::test_pure"]


def declared_tier(source: str) -> str | None:
    """The value of a module's top-level ``TIER = "..."`` (None when it has none)."""
    for node in ast.parse(source).body:
        if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["TIER"]
                and isinstance(node.value, ast.Constant)):
            return str(node.value.value)
    return None


@pytest.mark.unit
def test_every_test_module_of_this_suite_declares_its_tier() -> None:
    # also what -k or a file argument leaves uncollected
    undeclared = {p.name: declared_tier(p.read_text(encoding="utf-8"))
                  for p in sorted((REPO / "tests").glob("test_*.py"))}
    assert len(undeclared) > 80
    assert {name: tier for name, tier in undeclared.items() if tier not in TIERS} == {}

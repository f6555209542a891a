"""Faults of the home and its surroundings (docs/faults.md, docs/faults-state.md): the metrics that
cannot be written after a run, a home the kernel turns read-only mid-run, a hang-up, a copied home,
a certificate the Hub's client cannot trust.

Real filesystems where the fault is a filesystem's: a tmpfs the test mounts (root), filled, or
remounted read-only under a running ``hotfit`` — what the kernel does to a filesystem after a disk
error. A refused mount skips, and fails under ``HOTFIT_REQUIRE_TOOLS`` (tests/test_fault_matrix_disk.py).
"""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hotfit.core.plan import ProbeResult
from hotfit.pipeline.cli import main
from tests.e2e_support import GiB, World, write_probe, write_provisioned_home, write_registry
from tests.gguf_fixtures import tool_template_text
from tests.test_auto_e2e import env_for, events
from tests.test_fault_matrix_disk import MiB, fill, tmpfs

REPO = Path(__file__).resolve().parent.parent


def hotfit(home: Path, *args: str, env: dict[str, str] | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``hotfit --home HOME ARGS`` as a subprocess (what an operator's cron runs)."""
    return subprocess.run([sys.executable, "-m", "hotfit", "--home", str(home), "--log-format", "json", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def named(evs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in evs if e.get("event") == name]


# --------------------------------------------------------------------------- metrics that cannot be written


@dataclasses.dataclass(frozen=True)
class NoopHome:
    """A provisioned home whose ``auto --model`` is a no-op (exit 0, no llama-server needed)."""

    home: Path
    argv: tuple[str, ...]


def noop_home(root: Path) -> NoopHome:
    probe = write_probe(root / "probe.json", 8 * GiB)
    made = write_provisioned_home(root / "home", ProbeResult.decode(json.loads(probe.read_text())),
                                  template_text=tool_template_text())
    registry = root / "registry.json"
    write_registry(registry, [dataclasses.replace(made.entry, auto_eligible=False, ineligible_cause="tool-parser",
                                                  ineligible_reason="test: provisioned by name")])
    return NoopHome(made.home, ("auto", "--registry", str(registry), "--probe-file", str(probe),
                                "--model", made.entry.name))


def test_a_full_home_when_auto_ends_keeps_exit_4_and_its_message(plain_world: World, hub: Any,
                                                                   tmp_path: Path) -> None:
    """The home's disk full: `auto` fails with the documented exit 4 and message; last-run.json and
    the textfile cannot be written either, which is one `metrics.unwritable` warning — not a second
    DiskSpaceError, a traceback and exit 1."""
    probe = write_probe(tmp_path / "probe.json", 8 * GiB)
    with tmpfs(tmp_path / "fs", 2 * MiB) as fs:
        home = fs / "home"
        (home / "logs").mkdir(parents=True)
        fill(fs)
        done = hotfit(home, "auto", "--registry", str(plain_world.registry_path), "--probe-file", str(probe),
                      env=env_for(hub))
        assert done.returncode == 4, done.stderr[-3000:]
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        assert "hotfit: error: disk full writing" in done.stderr
        warnings = [json.loads(line) for line in done.stderr.splitlines()
                    if line.startswith("{") and '"metrics.unwritable"' in line]
        assert len(warnings) == 1, done.stderr[-3000:]
        assert str(home / "metrics" / "last-run.json") in warnings[0]["paths"]
        assert warnings[0]["exit_code"] == 4 and "disk full" in warnings[0]["error"]


@pytest.mark.parametrize("textfile_dir", ["a file", "a full filesystem"])
def test_an_unwritable_textfile_dir_after_a_successful_run_keeps_exit_0(textfile_dir: str, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """HOTFIT_TEXTFILE_DIR a regular file, or on a full filesystem: the run's exit code stands
    (docs/operations.md), the home's metrics are written, and one `metrics.unwritable` names the
    path that was not."""
    made = noop_home(tmp_path)
    with tmpfs(tmp_path / "node-exporter", 1 * MiB) as collector:
        if textfile_dir == "a file":
            target = collector / "textfile"
            target.write_text("not a directory\n")
        else:
            target = collector
            fill(collector)
        monkeypatch.setenv("HOTFIT_TEXTFILE_DIR", str(target))
        out = io.StringIO()
        assert main(["--home", str(made.home), "--log-format", "json", "--json", *made.argv], out=out) == 0
        assert json.loads(out.getvalue())["noop"] is True
        warnings = named(events(made.home), "metrics.unwritable")
        assert [w["paths"] for w in warnings] == [[str(target / "hotfit.prom")]], warnings
        assert warnings[0]["exit_code"] == 0 and warnings[0]["error"]
        assert "hotfit_last_run_exit_code 0\n" in (made.home / "metrics" / "hotfit.prom").read_text()
        last = json.loads((made.home / "metrics" / "last-run.json").read_text())
        assert last["exit_code"] == 0 and last["outcome"] == "noop"
        assert [p.name for p in collector.iterdir() if p.name.endswith(".tmp")] == []  # no temp file left

"""scripts/provision-demo runs wherever the main job can (docs/faults.md, "Set-up scripts"): on a
machine that installed its llama-server with `install-llama-server --from` there is no pinned
llama.cpp source tree in the cache, and a production virtualenv has no pytest. The demo serves the
Qwen3 template shipped in tests/data/templates (byte for byte the pinned tree's) and imports
nothing of pytest.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from hotfit.core.settings import LLAMA_SDIST_VERSION
from tests.conftest import REPO_ROOT
from tests.gguf_fixtures import QWEN3_TEMPLATE_NAME, SHIPPED_QWEN3_TEMPLATE, pinned_source_tree
from tests.gguf_fixtures import SHIPPED_QWEN3_TEMPLATE_SHA256
from tests.test_build_archive import _script, exported  # noqa: F401 - a fixture

TIER = "e2e"


def test_the_shipped_template_is_the_pinned_trees() -> None:
    data = SHIPPED_QWEN3_TEMPLATE.read_bytes()
    assert hashlib.sha256(data).hexdigest() == SHIPPED_QWEN3_TEMPLATE_SHA256
    assert SHIPPED_QWEN3_TEMPLATE_SHA256 in (SHIPPED_QWEN3_TEMPLATE.parent / "SOURCE.md").read_text()
    pinned = pinned_source_tree() / "models" / "templates" / QWEN3_TEMPLATE_NAME
    if pinned.is_file():  # where the pinned tree is cached, the copy is its bytes
        assert pinned.read_bytes() == data


def _no_pytest(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python cannot import pytest (as a production virtualenv), with an
    empty llama.cpp cache (no pinned source tree)."""
    shadow = tmp_path / "shadow"
    (shadow / "pytest").mkdir(parents=True)
    (shadow / "pytest" / "__init__.py").write_text(
        "raise ImportError('pytest is not installed where the demo runs (tests/test_provision_demo.py)')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), str(REPO_ROOT)]),
            "HOTFIT_LLAMA_CACHE": str(tmp_path / "llama.cpp"), "TMPDIR": str(tmp_path)}


def test_the_demo_world_starts_without_the_source_tree_or_pytest(tmp_path: Path) -> None:
    """The demo's local Hub and registry (python -m tests.e2e_support), as the demo starts them."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.e2e_support", str(tmp_path / "world")], cwd=REPO_ROOT,
                            env=_no_pytest(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once the world is served, or nothing if it died
        if not line:
            raise AssertionError(proc.stderr.read() if proc.stderr else "no output")
        world = json.loads(line)
        assert world["models"] == ["fx-agent-large", "fx-agent-small"]
        assert Path(world["registry"]).is_file()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


def test_the_demo_runs_on_a_machine_that_installed_its_build_with_from(exported: Path, tmp_path: Path) -> None:
    """Seen: a traceback ending in pytest's `Skipped: pinned llama.cpp template ... not found`."""
    env = _no_pytest(tmp_path)
    installed = _script("--from", str(exported), cache=Path(env["HOTFIT_LLAMA_CACHE"]))
    assert installed.returncode == 0, installed.stderr
    assert sorted(p.name for p in (Path(env["HOTFIT_LLAMA_CACHE"]) / LLAMA_SDIST_VERSION).iterdir()) == ["cpu"]
    env.pop("HOTFIT_LLAMA_SERVER", None)
    proc = subprocess.run([str(REPO_ROOT / "scripts" / "provision-demo")], env={**env, "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "hotfit auto again" in proc.stdout and "fx-agent-large" in proc.stdout

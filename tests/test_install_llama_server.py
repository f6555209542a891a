"""scripts/install-llama-server: built once from the pinned sdist, a second run is a no-op."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from pipeline.settings import LLAMA_SDIST_VERSION, default_llama_cache
from tests.conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "install-llama-server"


def _bin_dir():
    return default_llama_cache(os.environ) / LLAMA_SDIST_VERSION / "bin"


@pytest.fixture
def built() -> None:
    if not (_bin_dir() / "llama-server").exists():
        if os.environ.get("HOTFIT_REQUIRE_LLAMA"):
            pytest.fail("llama-server is not built; run scripts/install-llama-server")
        pytest.skip("llama-server not built (set HOTFIT_REQUIRE_LLAMA=1 to make this a failure)")


def test_script_pins_the_same_version_as_settings() -> None:
    text = SCRIPT.read_text()
    assert f'SDIST_VERSION="{LLAMA_SDIST_VERSION}"' in text
    assert re.search(r'SDIST_SHA256="[0-9a-f]{64}"', text)
    for flag in ("-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                 "--target llama-server llama-fit-params"):
        assert flag in text


def test_second_run_is_a_noop_and_build_info_is_recorded(built: None) -> None:
    server = _bin_dir() / "llama-server"
    mtime = server.stat().st_mtime_ns
    proc = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "no-op" in proc.stderr
    assert proc.stdout.strip() == str(server)
    assert server.stat().st_mtime_ns == mtime
    info = json.loads((_bin_dir() / "build-info.json").read_text())
    sha = re.search(r'SDIST_SHA256="([0-9a-f]{64})"', SCRIPT.read_text()).group(1)
    assert info["sdist_sha256"] == sha and info["sdist_version"] == LLAMA_SDIST_VERSION
    assert "llama-server" in info["targets"] and "llama-fit-params" in info["targets"]
    assert (_bin_dir() / "llama-fit-params").exists()
    version = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=30)
    assert "version" in (version.stdout + version.stderr)

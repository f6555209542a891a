"""`hotfit auto` checks the binary that will serve the plan before it fetches a single weight byte
: missing, not executable, not answering --version, built for ISA
features this CPU lacks, of a backend that cannot serve the plan's device, or a CUDA build without
code for the planned GPU's compute capability. Each is a clear
error naming the fix, with the Hub's byte counter at zero."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hotfit.planner.probe import Device, ProbeResult
from tests.e2e_support import GiB, SMALL, World, write_probe
from tests.hubserver import LocalHub

TIER = "integration"

REPO = Path(__file__).resolve().parent.parent


def _auto(hub: LocalHub, world: World, home: Path, probe: Path, binary: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HOTFIT_HOME", "HF_TOKEN", "HOTFIT_LLAMA_SERVER")}
    env.update(hub.env())
    return subprocess.run(
        [sys.executable, "-m", "hotfit", "--home", str(home), "--llama-server", str(binary), "--json", "auto",
         "--registry", str(world.registry_path), "--probe-file", str(probe), "--model", SMALL],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def _binary(directory: Path, script: str, record: dict[str, Any] | None = None, mode: int = 0o755) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "llama-server"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(mode)
    if record is not None:
        (directory / "build-info.json").write_text(json.dumps(
            {"llama_cpp_version": "version: 0.5.0-dev (build 1, commit 0c1e570)", **record}))
    return path


ANSWERS = 'echo "version: 0.5.0-dev (build 1, commit 0c1e570)" >&2\n'


def _nvidia_probe(path: Path) -> Path:
    probe = ProbeResult(devices=(Device(index=0, kind="nvidia", name="NVIDIA RTX 4060", total_bytes=8 * GiB,
                                        free_bytes=7 * GiB, uuid="GPU-1234", compute_capability="8.9"),
                                 Device(index=1, kind="cpu", name="host", total_bytes=16 * GiB,
                                        free_bytes=12 * GiB)))
    path.write_text(json.dumps(probe.to_json()))
    return path


@pytest.mark.parametrize(
    ("case", "script", "record", "mode", "probe_kind", "expect"),
    [
        ("missing", None, None, 0o755, "cpu", "does not exist"),
        ("not executable", ANSWERS, None, 0o644, "cpu", "not executable"),
        ("crashes on --version", "kill -SEGV $$\n", None, 0o755, "cpu", "SIGSEGV"),
        ("other ISA", ANSWERS, {"backend": "cpu", "cpu_features": ["avx2", "hotfit_no_such_feature"]}, 0o755,
         "cpu", "hotfit_no_such_feature"),
        ("cpu build for a GPU plan", ANSWERS, {"backend": "cpu", "cpu_features": []}, 0o755, "nvidia",
         "scripts/install-llama-server --backend cuda"),
        ("GPU build for a host plan", ANSWERS, {"backend": "vulkan", "cpu_features": []}, 0o755, "cpu",
         "scripts/install-llama-server --backend cpu"),
        ("CUDA build without code for the GPU", ANSWERS,
         {"backend": "cuda", "cpu_features": [], "cuda_architectures": ["90"]}, 0o755, "nvidia",
         "this GPU has compute capability 8.9"),
    ],
)
def test_an_unusable_binary_stops_auto_before_any_weight_is_fetched(
        hub: LocalHub, plain_world: World, tmp_path: Path, case: str, script: str | None, record: dict[str, Any] | None,
        mode: int, probe_kind: str, expect: str) -> None:
    hub.reset_counters()
    directory = tmp_path / "bin"
    binary = directory / "llama-server" if script is None else _binary(directory, script, record, mode)
    probe = (_nvidia_probe(tmp_path / "probe.json") if probe_kind == "nvidia"
             else write_probe(tmp_path / "probe.json", 12 * GiB))
    proc = _auto(hub, plain_world, tmp_path / "home", probe, binary)
    assert proc.returncode == 5, (case, proc.stdout, proc.stderr[-2000:])
    assert expect in proc.stdout + proc.stderr, case
    sent = hub.bytes_sent()
    assert sent == 0, f"{case}: {sent} bytes were downloaded before the check"
    assert not (tmp_path / "home" / "models" / SMALL).exists() or not any(
        (tmp_path / "home" / "models" / SMALL).rglob("*.gguf*"))

"""End-to-end: `hotfit auto` whose llama-server dies by SIGSEGV at load.

The run stops at load with exit 5 and an error naming the signal, the binary's backend and ISA
build against this CPU and the known causes; the downloaded, verified weights stay in place, and
the next run (with a binary that works) resumes at load without downloading a byte again.

The crashing binary is a stand-in (tests/test_load.py ``write_crashing_stand_in``): no binary on
this machine really crashes. The crash this guards against is ggml's AMX kernels on Intel CPUs
with AMX (llama.cpp#20824), and the pinned CPU build compiles them out. The stand-in runs the real
pinned llama-server for ``--version``/``--help`` (so hotfit finds and checks it as the real one,
with the real build's ``build-info.json`` beside it) and really dies by SIGSEGV on a load.
Everything else is real: the local Hub, the fixture models, hotfit as a subprocess, the real
llama-server on the rerun.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.e2e_support import LARGE, GiB, World, sha256_of, write_probe
from tests.hubserver import LocalHub
from tests.test_auto_e2e import REPO, cmd, env_for, events, stage_story
from tests.test_load import real_build_info, write_crashing_stand_in

TIER = "e2e"

pytestmark = pytest.mark.llama


def run_auto(hub: LocalHub, home: Path, world: World, probe: Path,
             server: Path | None) -> subprocess.CompletedProcess[str]:
    env = env_for(hub)
    env.pop("HOTFIT_LLAMA_SERVER", None)
    if server is not None:
        env["HOTFIT_LLAMA_SERVER"] = str(server)
    return subprocess.run(cmd(home, world, probe, "--json"), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)


def weight_files(home: Path) -> dict[Path, tuple[int, int]]:
    """Every GGUF under ``home`` with its (inode, mtime_ns): a re-download would change them."""
    return {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in home.rglob("*.gguf")}


def test_segfault_at_load_is_diagnosed_keeps_the_weights_and_the_rerun_downloads_nothing(
    hub: LocalHub, world: World, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    probe = write_probe(tmp_path / "probe.json", 8 * GiB)
    crashing = write_crashing_stand_in(tmp_path / "bin", "SEGV", real_build_info())

    failed = run_auto(hub, home, world, probe, crashing)
    assert failed.returncode == 5, failed.stderr[-3000:]
    error = json.loads(failed.stdout)["error"]
    assert error["code"] == "load"
    d = error["details"]
    assert d["cause"] == "killed_by_signal" and d["signal"] == "SIGSEGV" and d["returncode"] == -11
    assert d["binary"] == str(crashing) and d["backend"] == "cpu" and d["variant"] == real_build_info()["variant"]
    assert d["missing_cpu_features"] == [] and d["build_cpu_features"]
    assert "killed by SIGSEGV" in error["message"] and str(crashing) in error["message"]
    assert "known causes of SIGSEGV" in error["message"]
    assert "--backend cpu --force" in error["hint"] and "gdb -batch" in error["hint"]
    assert "load.killed_by_signal" in [e["event"] for e in events(home)]

    # the verified weights are in place, whole, with the registry's hash
    large = world.entry(LARGE)
    kept = weight_files(home)
    assert len(kept) == 1, kept
    model = next(iter(kept))
    assert model.name == large.artifact.file and sha256_of(model) == large.artifact.sha256
    # locks stay, empty (fetch-template keeps its own in .partial/template/)
    partial = [p for p in home.rglob(".partial/**/*") if p.is_file() and not p.name.endswith(".lock")]
    assert partial == [], "no download left half-done"

    # a rerun with the same crashing binary fails the same way and downloads nothing
    hub.reset_counters()
    again = run_auto(hub, home, world, probe, crashing)
    assert again.returncode == 5 and json.loads(again.stdout)["error"]["details"]["signal"] == "SIGSEGV"
    assert hub.bytes_sent() == 0
    assert weight_files(home) == kept

    # with a binary that works (the real pinned build, from the cache), the rerun resumes at load
    hub.reset_counters()
    fixed = run_auto(hub, home, world, probe, None)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    manifest = json.loads(fixed.stdout)
    assert hub.bytes_sent() == 0
    assert Path(manifest["model_path"]) == model and weight_files(home) == kept
    assert manifest["probe_verdict"]["passed"] is True
    story = dict((stage, ev) for ev, stage in stage_story(events(home), manifest["run_id"]) if ev != "stage.start")
    assert story["fetch-weights"] == story["fetch-template"] == story["verify"] == "stage.skip", story
    assert story["load"] == story["re-check"] == "stage.done", story

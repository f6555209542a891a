"""End to end: `hotfit auto` rerun while `hotfit serve` serves the provisioned model.

Real parts: the local Hub with the fixture models, the real llama-server started by `hotfit serve`,
`hotfit auto` as a subprocess. The saved probe given to the rerun shows the memory the worker
holds as used — what a probe taken while it serves sees — so, judged blindly, the large model
"no longer qualifies" and the small one would be downloaded and loaded beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.e2e_support import LARGE, SMALL, GiB, World, write_probe
from tests.gguf_fixtures import free_port
from tests.hubserver import LocalHub
from tests.polling import wait_until
from tests.serve_support import stop

TIER = "e2e"

pytestmark = pytest.mark.llama
REPO = Path(__file__).resolve().parent.parent
ROOMY_FREE_BYTES = 8 * GiB


def env_for(hub: LocalHub) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HOTFIT_HOME", "HF_TOKEN", "CONTENOX_LLAMA_KV_CACHE_TYPE")}
    env.update(hub.env())
    return env


def hotfit(hub: LocalHub, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hotfit", "--home", str(home), "--log-format", "json", *args],
                          cwd=REPO, env=env_for(hub), capture_output=True, text=True, timeout=240)


def auto_args(world: World, probe: Path, *args: str) -> list[str]:
    return ["auto", "--registry", str(world.registry_path), "--probe-file", str(probe), *args]


def events(home: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (home / "logs" / "hotfit.jsonl").read_text().splitlines()]


def llama_servers_of(home: Path) -> set[int]:
    """PIDs of every llama-server whose command line names a file under ``home`` (read from /proc)."""
    pids = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and b"llama-server" in Path(argv[0].decode(errors="replace")).name.encode() and any(
                str(home).encode() in a for a in argv[1:]):
            pids.add(int(proc.name))
    return pids


def health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return resp.status
    except OSError:
        return 0


def test_rerun_while_serving_keeps_the_served_model_and_changes_nothing(hub: LocalHub, world: World,
                                                                      tmp_path: Path) -> None:
    home = tmp_path / "home"
    roomy = write_probe(tmp_path / "roomy.json", ROOMY_FREE_BYTES)
    first = hotfit(hub, home, *auto_args(world, roomy, "--json"))
    assert first.returncode == 0, first.stderr[-2000:]
    assert json.loads(first.stdout)["entry_name"] == LARGE

    # What a probe sees while the worker serves: the large model's floor no longer free, the small one's is.
    busy_free = world.floor_free_bytes(SMALL)
    assert busy_free < world.floor_free_bytes(LARGE)
    busy = write_probe(tmp_path / "busy.json", busy_free)
    blind = json.loads(hotfit(hub, home, *auto_args(world, busy, "--dry-run")).stdout)
    assert blind["model"] == SMALL and blind["would"] == "provision"  # the defect, with no worker running

    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "hotfit", "--home", str(home), "--log-format", "json", "serve",
                              "--port", str(port), "--probe-file", str(roomy)],
                             cwd=REPO, env=env_for(hub), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: health(port) == 200, "llama-server to come up", proc=serve)
        assert llama_servers_of(home) == {serve.pid}  # serve exec'd llama-server: same pid
        record = json.loads((home / "serve.pid").read_text())
        assert record["pid"] == serve.pid and record["port"] == port

        hub.reset_counters()
        models_before = sorted(p.name for p in (home / "models").iterdir())
        log_from = len(events(home))
        rerun = hotfit(hub, home, *auto_args(world, busy, "--json"))
        assert rerun.returncode == 0, rerun.stderr[-2000:]
        assert json.loads(rerun.stdout)["noop"] is True and json.loads(rerun.stdout)["entry_name"] == LARGE
        new = events(home)[log_from:]
        names = [e["event"] for e in new]
        assert "run.noop" in names and "worker.found" in names
        assert not {"run.start", "stage.start", "download.progress", "load.start"} & set(names)
        found = next(e for e in new if e["event"] == "worker.found")
        assert found["pid"] == serve.pid and found["source"] == "props"
        assert found["opened_context_tokens"] == json.loads(first.stdout)["measured"]["opened_context_tokens"]
        assert hub.requests == []  # nothing fetched, not even metadata
        assert sorted(p.name for p in (home / "models").iterdir()) == models_before
        assert llama_servers_of(home) == {serve.pid}  # no second llama-server
        assert health(port) == 200 and serve.poll() is None  # serve's server still answering
        dry = json.loads(hotfit(hub, home, *auto_args(world, busy, "--dry-run")).stdout)
        assert dry["model"] == LARGE and dry["reused"] is True and dry["would"].startswith("nothing")

        # A run that must provision while the worker serves (--recheck) says so and leaves it alone.
        log_from = len(events(home))
        recheck = hotfit(hub, home, *auto_args(world, roomy, "--recheck", "--json"))
        assert recheck.returncode == 0, recheck.stderr[-2000:]
        assert json.loads(recheck.stdout)["serving_worker"] == {"pid": serve.pid, "port": port, "model": LARGE,
                                                                "replaced": False}
        warned = [e for e in events(home)[log_from:] if e["event"] == "run.beside_worker"]
        assert len(warned) == 1 and warned[0]["pid"] == serve.pid and warned[0]["level"] == "warning"
        assert "restart `hotfit serve`" in warned[0]["detail"]
        assert llama_servers_of(home) == {serve.pid}  # the run's own llama-server is gone again
        assert health(port) == 200 and serve.poll() is None
    finally:
        stop(serve)

    # The worker is gone; its pid file is stale and no longer trusted.
    assert (home / "serve.pid").exists()
    after = json.loads(hotfit(hub, home, *auto_args(world, busy, "--dry-run")).stdout)
    assert after["model"] == SMALL and after["would"] == "provision"

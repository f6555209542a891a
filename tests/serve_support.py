"""A real `hotfit serve` for tests: started as a subprocess, ready when llama-server's /health says
so (polled, with a hang guard), stopped with SIGTERM (tests/test_serve_clients.py,
tests/test_fleet_endpoints_litellm.py)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests.polling import wait_until

REPO = Path(__file__).resolve().parent.parent
READY_LIMIT_S = 90.0  # a hang guard, not a timing assertion


def healthy(base: str, route: str = "/health") -> bool:
    """Whether the server at ``base`` answers ``route`` with 200 (llama-server's /health)."""
    try:
        with urllib.request.urlopen(f"{base}{route}", timeout=2) as resp:
            return resp.status == 200
    except (OSError, urllib.error.HTTPError):
        return False


def wait_healthy(proc: subprocess.Popen[bytes], base: str, limit_s: float = READY_LIMIT_S) -> None:
    wait_until(lambda: healthy(base), f"{base} to come up", timeout_s=limit_s, proc=proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def hotfit_serve(home: Path, port: int, probe: Path, key_file: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`hotfit serve --port PORT` on ``home`` behind the key in ``key_file``, healthy on entry."""
    proc = subprocess.Popen([sys.executable, "-m", "hotfit", "--home", str(home), "--log-format", "json",
                             "serve", "--port", str(port), "--probe-file", str(probe), "--api-key-file",
                             str(key_file)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        yield proc
    finally:
        stop(proc)

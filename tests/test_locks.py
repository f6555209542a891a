"""state.locks.FileLock: exclusive, names its holder, waits or refuses, freed by the kernel on death."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import anyio
import pytest
import structlog.testing

from hotfit.core.errors import LockedError
from hotfit.state.locks import FileLock, read_holder
from tests.polling import wait_until

TIER = "integration"


def _hold_in_subprocess(path: Path) -> subprocess.Popen[str]:
    """A separate process that takes the lock, says so on stdout, then sleeps until killed."""
    code = textwrap.dedent(f"""
        import sys, time
        from hotfit.state.locks import FileLock
        lock = FileLock({str(path)!r}).acquire()
        print("held", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parent.parent)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_second_holder_gets_locked_error_naming_pid_and_command(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "x.lock"
    holder = _hold_in_subprocess(path)
    try:
        with pytest.raises(LockedError) as exc:
            FileLock(path, what="model dir X").acquire()
        err = exc.value
        assert err.exit_code == 6
        assert err.details["holder_pid"] == holder.pid
        assert f"PID {holder.pid}" in str(err) and "model dir X" in str(err)
        assert read_holder(path).pid == holder.pid
    finally:
        holder.kill()
        holder.wait()


def test_kill_9_of_the_holder_frees_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    holder = _hold_in_subprocess(path)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    with FileLock(path) as lock:  # the stale text does not block: flock died with the process
        assert lock.held and read_holder(path).pid == os.getpid()
    assert read_holder(path).pid is None  # released: emptied


def test_wait_true_queues_until_the_holder_releases(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    first = FileLock(path).acquire()
    got: list[int] = []

    def second() -> None:
        with FileLock(path, wait=True):
            got.append(read_holder(path).pid or 0)

    with structlog.testing.capture_logs() as events:
        t = threading.Thread(target=second)
        t.start()
        wait_until(lambda: any(e["event"] == "lock.wait" for e in events), "the waiter to find the lock held")
    assert got == [] and read_holder(path).pid == os.getpid()  # it waits, not holds
    first.release()
    t.join(timeout=10)
    assert got == [os.getpid()]


def test_wait_with_timeout_gives_up_with_locked_error(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    with FileLock(path):
        with pytest.raises(LockedError):
            FileLock(path, wait=True, timeout_s=0.2).acquire()


@pytest.mark.anyio
async def test_async_wait_can_be_cancelled(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    with FileLock(path):
        with anyio.move_on_after(0.3) as scope:
            async with FileLock(path, wait=True).async_held():
                raise AssertionError("must not get the lock")
        assert scope.cancelled_caught
    async with FileLock(path).async_held() as lock:  # free again, and nothing leaked
        assert lock.held


def test_not_reentrant_within_one_object(tmp_path: Path) -> None:
    lock = FileLock(tmp_path / "x.lock").acquire()
    with pytest.raises(RuntimeError):
        lock.acquire()
    lock.release()
    lock.release()  # idempotent


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_while_auto_waits_for_the_home_lock_is_a_clean_interrupt(tmp_path: Path, signum: int) -> None:
    """`hotfit auto --wait` queued behind another run: SIGTERM/SIGINT ends it with exit 130, the
    logged reason and no state written (it never held the lock), not a bare kill or a traceback."""
    import json

    home = tmp_path / "home"
    home.mkdir()
    with FileLock(home / "pipeline.lock"):
        proc = subprocess.Popen(
            [sys.executable, "-m", "hotfit", "--home", str(home), "--log-format", "json", "auto", "--wait",
             "--probe-file", str(tmp_path / "probe.json")],
            cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        log_file = home / "logs" / "hotfit.jsonl"
        try:
            wait_until(lambda: log_file.exists() and '"lock.wait"' in log_file.read_text(),
                       "auto --wait to log lock.wait while the lock is held", proc=proc)
            os.kill(proc.pid, signum)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err
    events = [json.loads(line)["event"] for line in log_file.read_text().splitlines()]
    assert events[-3:] == ["lock.wait", "lock.wait_interrupted", "command.failed"]  # every failure is logged
    assert not (home / "state.db").exists()


def test_auto_without_wait_on_a_held_home_exits_6_naming_the_holder(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    with FileLock(home / "pipeline.lock"):
        proc = subprocess.run(
            [sys.executable, "-m", "hotfit", "--home", str(home), "--log-format", "json", "auto",
             "--probe-file", str(tmp_path / "probe.json")],
            cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 6, proc.stderr
    assert f"PID {os.getpid()}" in proc.stderr and "Traceback" not in proc.stderr

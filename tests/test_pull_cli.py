"""``hotfit pull NAME`` as a subprocess against the local Hub.

kill -9 at several points then a rerun, disk full through RLIMIT_FSIZE, two concurrent pulls, an
unknown name. The Hub's per-connection throughput cap makes the kill points reachable with a file of
a few MiB; the server's byte counter says what was re-sent.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hotfit.core.entry import Entry, TemplateSource
from hotfit.download import partial_paths
from tests.conftest import REPO_ROOT
from tests.hubserver import LocalHub
from tests.test_fetch_weights import make_entry, make_gguf, sha256_of

MiB = 1 << 20
BLOCK = 1 * MiB  # the engine's smallest block: what one connection has in flight at most
TOOL_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}<tool_call>{% endif %}"


def entry_json(entry: Entry) -> dict[str, Any]:
    return dataclasses.asdict(entry)


def write_registry(path: Path, *entries: Entry) -> Path:
    path.write_text(json.dumps({"schema": 1, "description": "test", "entries": [entry_json(e) for e in entries]}))
    return path


def pull_cmd(home: Path, registry: Path, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "hotfit", "--home", str(home), "--log-format", "json", "pull", name,
            "--registry", str(registry), "--json", *extra]


def env_for(hub: LocalHub) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HOTFIT_HOME", "HF_HUB_OFFLINE")}
    env.update(hub.env())
    return env


@pytest.fixture
def model(local_hub: LocalHub, tmp_path: Path) -> dict[str, Any]:
    src = tmp_path / "src"
    src.mkdir()
    weights = make_gguf(src / "model.gguf", pad_bytes=8 * MiB, seed=11)
    commit = local_hub.create_repo("org/model-GGUF", {"model.gguf": weights}, lfs=["model.gguf"])
    tpl_commit = local_hub.create_repo("org/model", {"tokenizer_config.json": json.dumps(
        {"chat_template": [{"name": "default", "template": "{{ messages }}"},
                           {"name": "tool_use", "template": TOOL_TEMPLATE}]})})
    entry = make_entry("test-model", "org/model-GGUF", commit, "model.gguf", weights.stat().st_size,
                       sha256_of(weights),
                       template=TemplateSource("org/model", tpl_commit, "tokenizer_config.json"))
    registry = write_registry(tmp_path / "registry.json", entry)
    home = tmp_path / "home"
    part, sidecar, lock = partial_paths(home / "models" / "test-model" / ".partial", "org/model-GGUF", "model.gguf")
    return {"weights": weights, "entry": entry, "registry": registry, "home": home, "sidecar": sidecar,
            "final": home / "models" / "test-model" / "model.gguf", "size": weights.stat().st_size}


def _done(sidecar: Path) -> int:
    try:
        return int(json.loads(sidecar.read_text())["done_bytes"])
    except (OSError, ValueError, KeyError):
        return 0


def _wait_for(predicate: Any, proc: subprocess.Popen[bytes], what: str, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s  # a hang guard, not a timing assertion
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before {what}: {proc.stderr.read().decode()[-2000:]}"
                                 if proc.stderr else f"process exited before {what}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.02)


def test_pull_end_to_end_json(local_hub: LocalHub, model: dict[str, Any]) -> None:
    out = subprocess.run(pull_cmd(model["home"], model["registry"], "test-model"), env=env_for(local_hub),
                         cwd=REPO_ROOT, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    result = json.loads(out.stdout)
    assert result["fetch"]["weights"]["sha256"] == sha256_of(model["weights"])
    assert result["template"]["variant"] == "tokenizer_config:tool_use"
    assert result["verify"]["vision"] is False
    assert model["final"].read_bytes() == model["weights"].read_bytes()
    tpl = model["home"] / "models" / "test-model" / "chat_template.jinja"
    assert tpl.read_text() == TOOL_TEMPLATE
    # not a TTY: throttled progress events on stderr, not one per chunk
    events = [json.loads(line) for line in out.stderr.decode().splitlines() if line.startswith("{")]
    progress = [e for e in events if e.get("event") == "download.progress"]
    assert progress and len(progress) <= 101


def test_an_outage_exits_11_and_a_bad_file_exits_4(local_hub: LocalHub, model: dict[str, Any]) -> None:
    """A fleet's scheduler retries a passing fault and stops on a bad file, so the two exit apart
    (core.errors): a mirror that asks for an hour's pause (HTTP 503, Retry-After beyond the cap) is
    11; a body that differs from the pinned sha256 is 4. Before, both were 4."""
    local_hub.inject(method="HEAD", file="model.gguf", status=503, retry_after=3600, times=None)
    out = subprocess.run(pull_cmd(model["home"], model["registry"], "test-model"), env=env_for(local_hub),
                         cwd=REPO_ROOT, capture_output=True, timeout=120)
    assert out.returncode == 11, out.stderr.decode()[-3000:]
    err = json.loads(out.stdout)["error"]
    assert err["code"] == "transfer_transient" and err["exit_code"] == 11 and "rerun" in err["hint"]
    local_hub.clear_faults()
    local_hub.inject(method="GET", file="model.gguf", corrupt=True, times=None)
    out = subprocess.run(pull_cmd(model["home"], model["registry"], "test-model"), env=env_for(local_hub),
                         cwd=REPO_ROOT, capture_output=True, timeout=120)
    assert out.returncode == 4, out.stderr.decode()[-3000:]
    assert json.loads(out.stdout)["error"]["code"] == "integrity"


def test_unknown_name_is_a_usage_error_without_fallback(local_hub: LocalHub, model: dict[str, Any]) -> None:
    out = subprocess.run(pull_cmd(model["home"], model["registry"], "test-modle"), env=env_for(local_hub),
                         cwd=REPO_ROOT, capture_output=True, timeout=120)
    assert out.returncode == 2
    err = json.loads(out.stdout)["error"]
    assert "test-modle" in err["message"] and "test-model" in err["message"]  # names it, suggests, never substitutes
    assert local_hub.requests == []


def test_kill_9_at_several_points_then_rerun_completes(local_hub: LocalHub, model: dict[str, Any]) -> None:
    size, connections = model["size"], 2
    local_hub.inject(file="model.gguf", method="GET", throughput_bps=1_500_000, times=None)
    kills = 0
    for fraction in (0.25, 0.6):
        proc = subprocess.Popen(pull_cmd(model["home"], model["registry"], "test-model",
                                         "--connections", str(connections)),
                                env=env_for(local_hub), cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        _wait_for(lambda: _done(model["sidecar"]) >= fraction * size, proc, f"{fraction:.0%} on disk")
        proc.kill()  # SIGKILL: no handler, no cleanup
        proc.wait()
        kills += 1
        assert not model["final"].exists()  # never a partial file at the final path
    before_rerun = _done(model["sidecar"])
    out = subprocess.run(pull_cmd(model["home"], model["registry"], "test-model", "--connections",
                                  str(connections)), env=env_for(local_hub), cwd=REPO_ROOT,
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    weights = json.loads(out.stdout)["fetch"]["weights"]
    assert model["final"].read_bytes() == model["weights"].read_bytes()
    assert weights["resumed_from_bytes"] == before_rerun > 0
    assert weights["bytes_transferred"] == size - before_rerun
    # at most one in-flight range per connection re-sent per kill
    resent = local_hub.bytes_sent("model.gguf") - size
    assert 0 <= resent <= kills * connections * BLOCK
    # ranged requests only, each starting where the sidecar said
    assert all(r.range for r in local_hub.requests_for(file="model.gguf", method="GET", where="cdn"))


def test_disk_full_keeps_the_partial_and_a_rerun_resumes(local_hub: LocalHub, model: dict[str, Any]) -> None:
    size, limit = model["size"], 3 * MiB

    def small_files() -> None:  # the subprocess may not write any file beyond 3 MiB
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    out = subprocess.run(pull_cmd(model["home"], model["registry"], "test-model", "--connections", "2"),
                         env=env_for(local_hub), cwd=REPO_ROOT, capture_output=True, timeout=120,
                         preexec_fn=small_files)
    assert out.returncode == 4, out.stderr.decode()[-3000:]
    err = json.loads(out.stdout)["error"]
    assert err["code"] == "disk_space" and "resume" in err["hint"]
    kept = _done(model["sidecar"])
    assert 0 < kept <= limit
    assert not model["final"].exists()
    sent_before = local_hub.bytes_sent("model.gguf")

    out = subprocess.run(pull_cmd(model["home"], model["registry"], "test-model", "--connections", "2"),
                         env=env_for(local_hub), cwd=REPO_ROOT, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    assert json.loads(out.stdout)["fetch"]["weights"]["resumed_from_bytes"] == kept
    assert model["final"].read_bytes() == model["weights"].read_bytes()
    assert local_hub.bytes_sent("model.gguf") - sent_before == size - kept


def test_two_concurrent_pulls(local_hub: LocalHub, model: dict[str, Any]) -> None:
    # The first pull is held at its first HEAD (an event, released below) while it holds the lock.
    released = threading.Event()
    local_hub.inject(file="model.gguf", method="HEAD", hold_until=released, times=1)
    env = env_for(local_hub)
    first = subprocess.Popen(pull_cmd(model["home"], model["registry"], "test-model"), env=env, cwd=REPO_ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        lock = model["home"] / "models" / "test-model" / ".partial" / "pull.lock"
        _wait_for(lambda: lock.exists() and lock.read_text().startswith(f"{first.pid} "), first, "the first to lock")
        second = subprocess.run(pull_cmd(model["home"], model["registry"], "test-model"), env=env, cwd=REPO_ROOT,
                                capture_output=True, timeout=120)
        assert second.returncode == 6
        err = json.loads(second.stdout)["error"]
        assert err["details"]["holder_pid"] == first.pid and f"PID {first.pid}" in err["message"]
        waiter = subprocess.Popen(pull_cmd(model["home"], model["registry"], "test-model", "--wait"), env=env,
                                  cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    finally:
        released.set()
    assert first.wait(timeout=120) == 0
    out, err_text = waiter.communicate(timeout=120)
    assert waiter.returncode == 0, err_text.decode()[-3000:]
    assert json.loads(out)["fetch"]["weights"]["already_present"] is True
    assert local_hub.bytes_sent("model.gguf") == model["size"]  # fetched once
    assert model["final"].read_bytes() == model["weights"].read_bytes()


def test_gated_repo_then_token_from_the_huggingface_store(local_hub: LocalHub, model: dict[str, Any],
                                                          tmp_path: Path) -> None:
    local_hub.set_gated("org/model-GGUF", "hf_from_store")
    env = {**env_for(local_hub), "HF_HOME": str(tmp_path / "hf-home")}
    out = subprocess.run(pull_cmd(model["home"], model["registry"], "test-model"), env=env, cwd=REPO_ROOT,
                         capture_output=True, timeout=120)
    assert out.returncode == 4
    err = json.loads(out.stdout)["error"]
    assert err["code"] == "hub" and "licence" in err["message"] and "HF_TOKEN" in err["hint"]
    (tmp_path / "hf-home").mkdir()
    (tmp_path / "hf-home" / "token").write_text("hf_from_store\n")  # what `hf auth login` writes
    out = subprocess.run(pull_cmd(model["home"], model["registry"], "test-model"), env=env, cwd=REPO_ROOT,
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    assert "hf_from_store" not in out.stdout.decode() + out.stderr.decode()  # never logged


def test_human_output(local_hub: LocalHub, model: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from hotfit.pipeline.cli import main

    monkeypatch.setenv("HF_ENDPOINT", local_hub.endpoint)
    out = io.StringIO()
    rc = main(["--home", str(model["home"]), "--log-format", "json", "pull", "test-model",
               "--registry", str(model["registry"])], out=out)
    text = out.getvalue()
    assert rc == 0, text
    assert text.startswith("pulled test-model into ") and "verified against registry+hub_lfs" in text
    assert "tokenizer_config:tool_use" in text and "vision    no" in text

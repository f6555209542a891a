"""Pinned files from the Hugging Face cache (download.hf_cache, docs/network.md): filled by
huggingface_hub's own ``hf_hub_download`` from the local Hub, then taken by hotfit — checked, linked
or copied — with no byte fetched; a damaged one is warned about and downloaded."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import structlog
from huggingface_hub import hf_hub_download

from hotfit.core.settings import default_hf_hub_cache, load_settings
from hotfit.download import CacheHit, CacheMiss, take_from_cache, take_into_partial
from tests.conftest import REPO_ROOT
from tests.e2e_support import SMALL, World, write_probe
from tests.hubserver import LocalHub
from tests.test_auto_e2e import ROOMY_FREE_BYTES
from tests.test_auto_e2e import cmd as auto_cmd
from tests.test_auto_e2e import env_for as auto_env
from tests.test_fetch_weights import fetch_m, sha256_of
from tests.test_pull_cli import env_for, model, pull_cmd  # noqa: F401 - `model` is a fixture

TIER = "integration"


def fill_cache(hub: LocalHub, cache: Path, repo: str, file: str, commit: str | None) -> Path:
    """``hf_hub_download`` from the local Hub into ``cache``; the Hub's counters are reset after."""
    path = Path(hf_hub_download(repo, file, revision=commit, cache_dir=cache, endpoint=hub.endpoint, token=False))
    hub.reset_counters()
    return path


def flip_a_byte(path: Path, offset: int = 100) -> None:
    with open(os.path.realpath(path), "r+b") as fh:  # the blob behind the snapshot's symlink
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0xFF]))


def test_the_cache_directory_is_huggingface_hubs() -> None:
    assert default_hf_hub_cache({"HF_HUB_CACHE": "/c/hub", "HF_HOME": "/h"}) == Path("/c/hub")
    assert default_hf_hub_cache({"HF_HOME": "/h"}) == Path("/h/hub")
    assert default_hf_hub_cache({"XDG_CACHE_HOME": "/x", "HOME": "/home/u"}) == Path("/x/huggingface/hub")
    assert default_hf_hub_cache({"HOME": "/home/u"}) == Path("/home/u/.cache/huggingface/hub")


# --------------------------------------------------------------------------- the one function


@pytest.fixture
def cached(local_hub: LocalHub, tmp_path: Path) -> dict[str, Any]:
    data = os.urandom(300_000)
    commit = local_hub.create_repo("org/m", {"w.bin": data, "small.json": b'{"a": 1}'}, lfs=["w.bin"])
    cache = tmp_path / "hf"
    fill_cache(local_hub, cache, "org/m", "w.bin", commit)
    fill_cache(local_hub, cache, "org/m", "small.json", commit)
    return {"cache": cache, "commit": commit, "data": data, "sha": sha256_of_bytes(data)}


def sha256_of_bytes(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def test_a_pinned_file_is_hard_linked_when_it_can_be(cached: dict[str, Any], tmp_path: Path) -> None:
    dest = tmp_path / "home" / "x.part"
    hit = take_from_cache(cached["cache"], repo="org/m", commit=cached["commit"], file="w.bin", dest=dest,
                          size_bytes=len(cached["data"]), sha256=cached["sha"])
    assert isinstance(hit, CacheHit) and hit.how == "hardlink" and hit.sha256 == cached["sha"]
    blob = os.path.realpath(Path(hit.source))
    assert os.stat(blob).st_ino == os.stat(dest).st_ino and dest.read_bytes() == cached["data"]


def test_a_file_others_can_write_is_copied_not_linked(cached: dict[str, Any], tmp_path: Path) -> None:
    blob = Path(os.path.realpath(cached["cache"] / "models--org--m" / "snapshots" / cached["commit"] / "w.bin"))
    blob.chmod(0o666)  # a shared cache: linking would let others change the verified model
    dest = tmp_path / "home" / "x.part"
    hit = take_from_cache(cached["cache"], repo="org/m", commit=cached["commit"], file="w.bin", dest=dest,
                          size_bytes=len(cached["data"]), sha256=cached["sha"])
    assert isinstance(hit, CacheHit) and hit.how == "copy"
    assert os.stat(blob).st_ino != os.stat(dest).st_ino and dest.read_bytes() == cached["data"]


@pytest.mark.parametrize(("size_delta", "sha", "reason"), [
    (1, None, "size"), (0, "0" * 64, "sha256"),
])
def test_a_file_that_fails_a_check_is_refused_and_nothing_is_left(cached: dict[str, Any], tmp_path: Path,
                                                                 size_delta: int, sha: str | None,
                                                                 reason: str) -> None:
    dest = tmp_path / "x.part"
    miss = take_from_cache(cached["cache"], repo="org/m", commit=cached["commit"], file="w.bin", dest=dest,
                           size_bytes=len(cached["data"]) + size_delta, sha256=sha or cached["sha"])
    assert isinstance(miss, CacheMiss) and miss.reason == reason and miss.damaged
    assert not dest.exists()
    assert sha256_of_bytes(Path(miss.source).read_bytes()) == cached["sha"]  # the cache is left alone


def test_a_download_in_progress_gives_way_only_to_a_checked_file(cached: dict[str, Any], tmp_path: Path) -> None:
    partial, sidecar = tmp_path / "w.part", tmp_path / "w.json"
    partial.write_bytes(b"resumable bytes")
    sidecar.write_text('{"done_bytes": 15}')
    bad = take_into_partial(cached["cache"], partial=partial, sidecar=sidecar, repo="org/m", commit=cached["commit"],
                            file="w.bin", size_bytes=len(cached["data"]), sha256="0" * 64)
    assert isinstance(bad, CacheMiss)
    assert partial.read_bytes() == b"resumable bytes" and sidecar.exists()  # the resume is not lost
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("w.")) == ["w.json", "w.part"]
    good = take_into_partial(cached["cache"], partial=partial, sidecar=sidecar, repo="org/m",
                             commit=cached["commit"], file="w.bin", size_bytes=len(cached["data"]),
                             sha256=cached["sha"])
    assert isinstance(good, CacheHit) and partial.read_bytes() == cached["data"] and not sidecar.exists()


def test_only_the_pinned_commit_is_looked_at(cached: dict[str, Any], tmp_path: Path) -> None:
    miss = take_from_cache(cached["cache"], repo="org/m", commit="f" * 40, file="w.bin", dest=tmp_path / "x",
                           size_bytes=len(cached["data"]), sha256=cached["sha"])
    assert isinstance(miss, CacheMiss) and miss.reason == "absent" and not miss.damaged


def test_a_non_lfs_file_is_checked_against_its_git_blob_id(cached: dict[str, Any], tmp_path: Path) -> None:
    ok = take_from_cache(cached["cache"], repo="org/m", commit=cached["commit"], file="small.json",
                         dest=tmp_path / "a", size_bytes=None, max_size_bytes=1 << 20)
    assert isinstance(ok, CacheHit) and (tmp_path / "a").read_bytes() == b'{"a": 1}'
    flip_a_byte(Path(ok.source), offset=2)
    bad = take_from_cache(cached["cache"], repo="org/m", commit=cached["commit"], file="small.json",
                          dest=tmp_path / "b", size_bytes=None, max_size_bytes=1 << 20)
    assert isinstance(bad, CacheMiss) and bad.reason == "git_sha1" and not (tmp_path / "b").exists()


# --------------------------------------------------------------------------- fetch-weights and pull


@pytest.fixture
def weights_repo(local_hub: LocalHub, tmp_path: Path) -> dict[str, Any]:
    from tests.test_fetch_weights import make_entry, make_gguf

    (tmp_path / "src").mkdir()
    weights = make_gguf(tmp_path / "src" / "model.gguf")
    commit = local_hub.create_repo("org/model-GGUF", {"model.gguf": weights}, lfs=["model.gguf"])
    entry = make_entry("m", "org/model-GGUF", commit, "model.gguf", weights.stat().st_size, sha256_of(weights))
    cache = tmp_path / "hf" / "hub"
    cached = fill_cache(local_hub, cache, "org/model-GGUF", "model.gguf", commit)
    return {"weights": weights, "entry": entry, "cache": cache, "cached": cached}


@pytest.mark.anyio
async def test_offline_fetch_takes_the_cached_file_with_no_request(local_hub: LocalHub, weights_repo: dict[str, Any],
                                                                  tmp_path: Path) -> None:
    settings = load_settings({"HOTFIT_HOME": str(tmp_path / "home"), "HF_ENDPOINT": local_hub.endpoint,
                              "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})  # HF_HOME/hub
    with structlog.testing.capture_logs() as events:
        result = await fetch_m(weights_repo["entry"], settings)
    assert local_hub.requests == [] and local_hub.bytes_sent() == 0
    assert result.weights is not None and result.weights.bytes_transferred == 0
    assert result.weights.hf_cache == "hardlink"
    final = settings.model_dir("m") / "model.gguf"
    assert sha256_of(final) == weights_repo["entry"].artifact.sha256  # verified and in place, with its receipt
    assert os.stat(final).st_ino == os.stat(os.path.realpath(weights_repo["cached"])).st_ino
    used = [e for e in events if e["event"] == "fetch.hf_cache_used"]
    assert used and used[0]["how"] == "hardlink" and used[0]["size_bytes"] == weights_repo["weights"].stat().st_size


@pytest.mark.anyio
async def test_a_damaged_cached_file_is_warned_about_and_downloaded(local_hub: LocalHub,
                                                                    weights_repo: dict[str, Any],
                                                                    tmp_path: Path) -> None:
    flip_a_byte(weights_repo["cached"])
    settings = load_settings({"HOTFIT_HOME": str(tmp_path / "home"), "HF_ENDPOINT": local_hub.endpoint,
                              "HF_HUB_CACHE": str(weights_repo["cache"])})
    with structlog.testing.capture_logs() as events:
        result = await fetch_m(weights_repo["entry"], settings)
    rejected = [e for e in events if e["event"] == "fetch.hf_cache_rejected"]
    assert len(rejected) == 1 and rejected[0]["reason"] == "sha256" and rejected[0]["log_level"] == "warning"
    assert result.weights is not None and result.weights.hf_cache is None
    assert result.weights.bytes_transferred == weights_repo["weights"].stat().st_size
    final = settings.model_dir("m") / "model.gguf"
    assert final.read_bytes() == weights_repo["weights"].read_bytes()
    assert os.stat(final).st_ino != os.stat(os.path.realpath(weights_repo["cached"])).st_ino  # the cache untouched


def test_offline_pull_from_a_cache_hf_hub_download_filled(local_hub: LocalHub, model: dict[str, Any],
                                                          tmp_path: Path) -> None:
    # Before: "HF_HUB_OFFLINE is set and org/model-GGUF/model.gguf is not on disk", exit 4.
    entry = model["entry"]
    cache = tmp_path / "hf-cache"
    fill_cache(local_hub, cache, entry.artifact.repo, entry.artifact.file, entry.artifact.revision)
    fill_cache(local_hub, cache, entry.chat_template.repo, entry.chat_template.file, entry.chat_template.revision)
    env = {**env_for(local_hub), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    out = subprocess.run(pull_cmd(model["home"], model["registry"], "test-model"), env=env, cwd=REPO_ROOT,
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    assert local_hub.requests == [] and local_hub.bytes_sent() == 0
    assert model["final"].read_bytes() == model["weights"].read_bytes()
    events = [json.loads(line) for line in out.stderr.decode().splitlines() if line.startswith("{")]
    used = {e["role"]: e for e in events if e.get("event") == "fetch.hf_cache_used"}
    assert set(used) == {"weights", "template"}


# --------------------------------------------------------------------------- auto, offline


@pytest.mark.llama
def test_offline_auto_provisions_from_the_cache_with_zero_bytes_fetched(hub: LocalHub, world: World,
                                                                        tmp_path: Path) -> None:
    # huggingface_hub's hf_hub_download fills the cache; then HF_HUB_OFFLINE=1 `hotfit auto` provisions
    # (fetch, template, verify, load, tool-call probe, re-check) and the Hub sees no request at all.
    entry = world.entry(SMALL)
    cache = tmp_path / "hf-cache"
    for source in (entry.artifact, entry.projector, entry.chat_template):
        if source is not None:
            assert source.file is not None  # each source of this entry names its file
            fill_cache(hub, cache, source.repo, source.file, source.revision)
    env = {**auto_env(hub), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    probe = write_probe(tmp_path / "probe.json", ROOMY_FREE_BYTES)
    done = subprocess.run(auto_cmd(tmp_path / "home", world, probe, "--json", "--model", SMALL), cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["entry_name"] == SMALL
    assert hub.requests == [] and hub.bytes_sent() == 0


@pytest.mark.anyio
async def test_an_openvino_snapshot_takes_its_cached_files_and_fetches_the_rest(local_hub: LocalHub,
                                                                                tmp_path: Path) -> None:
    from hotfit.stages.fetch_weights import fetch_weights
    from hotfit.stages.verify import verify
    from tests.test_fetch_weights import FAST, _openvino_entry

    files: dict[str, str | bytes] = {"openvino_model.xml": "<net/>" * 100, "openvino_model.bin": os.urandom(600_000),
             "config.json": "{}", "tok/tokenizer.json": '{"t": 1}'}
    commit = local_hub.create_repo("OpenVINO/m-ov", files, lfs=["openvino_model.bin"])
    cache = tmp_path / "hf"
    for path in ("openvino_model.bin", "tok/tokenizer.json"):
        fill_cache(local_hub, cache, "OpenVINO/m-ov", path, commit)
    settings = load_settings({"HOTFIT_HOME": str(tmp_path / "home"), "HF_ENDPOINT": local_hub.endpoint,
                              "HF_HUB_CACHE": str(cache)})
    dest = settings.model_dir("ov")
    result = await fetch_weights(_openvino_entry("OpenVINO/m-ov"), dest, settings=settings, options=FAST,
                                 progress=False)
    await verify(_openvino_entry("OpenVINO/m-ov"), dest, fetched=result)
    fetched = {r.file for r in local_hub.requests if r.method == "GET" and r.file}
    assert fetched == {"openvino_model.xml", "config.json"}  # the listing is asked; cached files are not
    assert result.snapshot is not None and result.snapshot.bytes_transferred == len(files["openvino_model.xml"]) + 2
    for path, content in files.items():
        assert (dest / "snapshot" / path).read_bytes() == (content.encode() if isinstance(content, str) else content)

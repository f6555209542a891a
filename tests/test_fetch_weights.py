"""fetch-weights against the local Hub: pinning, resume, parallel ranges, faults, integrity.

The weights are real GGUF files (a header the verify stage parses plus a random-filled tensor so that
ranges, hashes and corruption mean something), a few MiB each so the suite stays fast.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import structlog

from hotfit.core.errors import (
    DiskSpaceError,
    HubError,
    IntegrityError,
    LockedError,
    PinMismatch,
    RegistryError,
    TransferError,
)
from hotfit.core.settings import Settings, load_settings
from hotfit.core.entry import Artifact, Entry, Evidence, LayerGroup, SourceConfig, TemplateSource
from hotfit.core.model_files import FetchResult
from hotfit.stages.fetch_weights import fetch_weights
from hotfit.download import TransferOptions, partial_paths
from hotfit.stages.verify import verify
from hotfit.state.locks import FileLock
from hotfit.state.receipts import file_identity, read_receipt, receipt_path
from tests.e2e_support import sha256_of
from tests.hubserver import LocalHub, free_port_closed, serve_handler

TIER = "integration"

MiB = 1 << 20
FAST = TransferOptions(connections=4, block_bytes=512 * 1024, backoff_initial_s=0.01, backoff_max_s=0.05,
                       checkpoint_interval_s=0.05, max_attempts_without_progress=4)


# --------------------------------------------------------------------------- builders (shared by the other test modules)


def make_gguf(path: Path, *, arch: str = "llama", n_layers: int = 4, kv_heads: int | list[int] = 2,
              head_dim: int = 64, ctx: int = 8192, sliding_window: int | None = None,
              template: str | None = None, pad_bytes: int = 3 * MiB, seed: int = 0) -> Path:
    """A valid GGUF with the given header facts and ``pad_bytes`` of random tensor data."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(ctx)
    w.add_embedding_length(head_dim * 4)
    w.add_head_count(4)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if sliding_window:
        w.add_sliding_window(sliding_window)
    if template is not None:
        w.add_chat_template(template)
    data = np.random.default_rng(seed).integers(0, 255, size=pad_bytes, dtype=np.uint8)
    w.add_tensor("pad", data.view(np.int8), raw_dtype=gguf.GGMLQuantizationType.I8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def make_entry(name: str, repo: str, commit: str, file: str, size: int | None, sha: str | None, *,
               n_layers: int = 4, kv_heads: int = 2, head_dim: int = 64, ctx: int = 8192,
               window: int | None = None, template: TemplateSource | None = None,
               projector: Artifact | None = None, backend: str = "llama", architecture: str = "llama") -> Entry:
    groups = (LayerGroup(n_layers, kv_heads, head_dim, head_dim, window),)
    return Entry(
        name=name, display_name=name, backend=backend, origin="us", license="Apache-2.0",  # type: ignore[arg-type]
        params_total_b=1.0, params_active_b=None, release_date=None, architecture=architecture,
        agentic_tier="agentic", evidence=(Evidence("provenance", "test", "test"),), auto_eligible=True,
        ineligible_reason=None, artifact=Artifact(repo, commit, file, size, sha), projector=projector,
        chat_template=template,
        config=SourceConfig(n_layers=n_layers, layer_groups=groups, source="test"), context_limit=ctx,
    )


def settings_for(hub: LocalHub, home: Path, **kw: Any) -> Settings:
    env = {"HOTFIT_HOME": str(home), "HF_ENDPOINT": hub.endpoint, **kw}
    return load_settings(env)


async def fetch_and_verify(entry: Entry, dest: Path, **kw: Any) -> FetchResult:
    """fetch-weights, then verify (which puts the hashed partial in place): what a pull does to the
    weights. Returns fetch-weights' result; the tests below that look at placement use this."""
    fetched = await fetch_weights(entry, dest, **kw)
    await verify(entry, dest, fetched=fetched)
    return fetched


async def fetch_m(entry: Entry, settings: Settings, **kw: Any) -> FetchResult:
    """fetch_and_verify into model directory "m", quiet, with the FAST options unless ``kw`` says otherwise."""
    return await fetch_and_verify(entry, settings.model_dir("m"), settings=settings,
                                  **{"options": FAST, "progress": False, **kw})


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    (tmp_path / "src").mkdir()
    return make_gguf(tmp_path / "src" / "model.gguf")


@pytest.fixture
def repo(local_hub: LocalHub, weights: Path) -> tuple[str, str, Entry]:
    commit = local_hub.create_repo("org/model-GGUF", {"model.gguf": weights, "README.md": "hi"},
                                   lfs=["model.gguf"])
    entry = make_entry("m", "org/model-GGUF", commit, "model.gguf", weights.stat().st_size, sha256_of(weights))
    return "org/model-GGUF", commit, entry


@pytest.fixture
def entry(repo: tuple[str, str, Entry]) -> Entry:
    """The registry entry of ``repo``'s model.gguf."""
    return repo[2]


@pytest.fixture
def settings(local_hub: LocalHub, tmp_path: Path) -> Settings:
    """A fresh home under tmp_path whose Hub is ``local_hub``."""
    return settings_for(local_hub, tmp_path / "home")


# --------------------------------------------------------------------------- tests


@pytest.mark.anyio
async def test_parallel_download_verifies_and_places_file(local_hub: LocalHub, repo: Any, weights: Path,
                                                          tmp_path: Path) -> None:
    _repo, commit, entry = repo
    settings = settings_for(local_hub, tmp_path / "home")
    dest = settings.model_dir("m")
    result = await fetch_weights(entry, dest, settings=settings, options=FAST, progress=False)
    final = dest / "model.gguf"
    # fetch-weights ends with a complete, hashed partial: nothing in place, no receipt yet
    assert result.weights is not None and result.weights.sha256 == sha256_of(weights)
    assert not final.exists() and read_receipt(dest, "model.gguf") is None
    partial = Path(result.weights.partial_path)  # type: ignore[arg-type]
    assert partial.read_bytes() == weights.read_bytes()
    assert result.weights.identity == file_identity(partial)
    assert result.weights.path == str(final) and not result.weights.already_present
    assert result.weights.connections == 4
    assert result.weights.bytes_transferred == weights.stat().st_size
    # ranged GETs on the CDN, several of them
    gets = local_hub.requests_for(file="model.gguf", method="GET", where="cdn")
    assert len(gets) > 4 and all(r.range for r in gets)
    # verify checks it, renames it into place and writes the receipt, reusing the streamed sha256
    verified = await verify(entry, dest, fetched=result)
    assert final.read_bytes() == weights.read_bytes()
    assert verified.sha256 == sha256_of(weights) and verified.sha256_source == "streamed"
    assert set(verified.verified_against) == {"registry", "hub_lfs"}
    assert not list((dest / ".partial").glob("*.part")) and not partial.exists()
    assert read_receipt(dest, "model.gguf").sha256 == sha256_of(weights)
    assert {c.field for c in verified.header_checks if c.ok} >= {"architecture", "block_count", "head_count_kv",
                                                                "key_length", "context_length"}
    # second run: no network, same answer
    local_hub.reset_counters()
    again = await fetch_weights(entry, dest, settings=settings, options=FAST, progress=False)
    assert again.weights is not None and again.weights.already_present and again.weights.partial_path is None
    assert set(again.weights.verified_against) == {"registry", "hub_lfs"}
    assert local_hub.requests == []


@pytest.mark.anyio
async def test_a_final_file_without_its_receipt_is_verified_in_place_not_fetched_again(
        local_hub: LocalHub, entry: Entry, settings: Settings, weights: Path) -> None:
    # A kill between the rename into place and the receipt write (or a file seeded by the operator)
    # leaves the right bytes without a receipt: they are re-hashed once and verified, not re-downloaded.
    dest = settings.model_dir("m")
    await fetch_and_verify(entry, dest, settings=settings, options=FAST, progress=False)
    receipt_path(dest, "model.gguf").unlink()
    local_hub.reset_counters()
    again = await fetch_and_verify(entry, dest, settings=settings, options=FAST, progress=False)
    assert local_hub.bytes_sent("model.gguf") == 0
    assert again.weights is not None and again.weights.resumed_from_bytes == weights.stat().st_size
    assert (dest / "model.gguf").read_bytes() == weights.read_bytes()
    assert read_receipt(dest, "model.gguf").sha256 == sha256_of(weights)
    # wrong bytes of the right size in the final path: never trusted, replaced by a verified copy
    receipt_path(dest, "model.gguf").unlink()
    (dest / "model.gguf").write_bytes(b"\0" * weights.stat().st_size)
    fixed = await fetch_and_verify(entry, dest, settings=settings, options=FAST, progress=False)
    assert (dest / "model.gguf").read_bytes() == weights.read_bytes()
    assert fixed.weights is not None and fixed.weights.integrity_retries == 1


@pytest.mark.anyio
async def test_no_sha256_to_check_against_fails_once_and_keeps_the_bytes(local_hub: LocalHub, weights: Path,
                                                                         tmp_path: Path) -> None:
    # Registry sha256 null and no Hub LFS sha256 (a mirror that drops X-Linked-Etag; here a non-LFS
    # file): nothing can verify it. That is not corruption — fetching it twice more cannot help, and
    # the complete bytes are kept so a rerun after pinning the sha256 only re-hashes them.
    commit = local_hub.create_repo("org/plain", {"model.gguf": weights}, lfs=[])
    entry = make_entry("m", "org/plain", commit, "model.gguf", weights.stat().st_size, None)
    settings = settings_for(local_hub, tmp_path / "home")
    dest = settings.model_dir("m")
    with pytest.raises(IntegrityError) as exc:
        await fetch_and_verify(entry, dest, settings=settings, options=FAST, progress=False)
    assert exc.value.details["field"] == "sha256" and "pin" in (exc.value.hint or "")
    assert local_hub.bytes_sent("model.gguf") == weights.stat().st_size
    assert not (dest / "model.gguf").exists()
    part, _sidecar, _lock = partial_paths(dest / ".partial", "org/plain", "model.gguf")
    assert part.read_bytes() == weights.read_bytes()
    # the sha256 pinned afterwards: the kept bytes are re-hashed and put in place, nothing re-sent
    pinned = make_entry("m", "org/plain", commit, "model.gguf", weights.stat().st_size, sha256_of(weights))
    local_hub.reset_counters()
    result = await fetch_weights(pinned, dest, settings=settings, options=FAST, progress=False)
    assert local_hub.bytes_sent("model.gguf") == 0
    verified = await verify(pinned, dest, fetched=result)
    assert (dest / "model.gguf").read_bytes() == weights.read_bytes()
    assert verified.verified_against == ("registry",)


@pytest.mark.anyio
async def test_a_cut_late_in_a_long_download_is_still_retried(local_hub: LocalHub, entry: Entry, settings: Settings,
                                                              weights: Path) -> None:
    # max_total_retry_s bounds the time spent *failing*, not the length of the download: a cut that
    # comes after the download has run longer than that (hours into a 20 GB pull) is retried.
    size = weights.stat().st_size
    one = replace(FAST, connections=1, block_bytes=None, max_total_retry_s=0.3)
    local_hub.inject(file="model.gguf", method="GET", throughput_bps=size, close_after_bytes=size // 2, times=1)
    # the first half alone takes ~0.5 s at this pace
    result = await fetch_m(entry, settings, options=one, connections=1)
    assert (settings.model_dir("m") / "model.gguf").read_bytes() == weights.read_bytes()
    assert result.weights is not None and result.weights.attempts >= 2


@pytest.mark.anyio
async def test_cut_mid_body_is_resumed_in_process(local_hub: LocalHub, entry: Entry, settings: Settings,
                                                  weights: Path) -> None:
    cut = local_hub.inject(file="model.gguf", method="GET", close_after_bytes=100_000, times=3)
    result = await fetch_m(entry, settings)
    assert cut.hits == 3
    assert (settings.model_dir("m") / "model.gguf").read_bytes() == weights.read_bytes()
    # every cut range is resumed from where it broke: nothing is fetched twice
    assert local_hub.bytes_sent("model.gguf") == weights.stat().st_size
    assert result.weights is not None and result.weights.attempts > 3
    # a fresh HEAD (signed CDN links expire) before every resumed attempt: 1 initial + 1 per cut
    assert len(local_hub.requests_for(file="model.gguf", method="HEAD")) == 1 + cut.hits


@pytest.mark.anyio
async def test_an_expired_cdn_link_is_refreshed_by_a_new_head_not_fatal(local_hub: LocalHub, entry: Entry,
                                                                        settings: Settings, weights: Path) -> None:
    # Signed CDN URLs expire (the CDN then answers 403); blocks requested after that must re-HEAD
    # the Hub for a fresh link instead of failing a long unattended pull half-way.
    expired = local_hub.inject(file="model.gguf", method="GET", where="cdn", status=403, times=2)
    result = await fetch_m(entry, settings)
    assert expired.hits == 2
    assert (settings.model_dir("m") / "model.gguf").read_bytes() == weights.read_bytes()
    assert result.weights is not None
    assert len(local_hub.requests_for(file="model.gguf", method="HEAD")) == 1 + expired.hits


@pytest.mark.anyio
async def test_failed_run_leaves_partial_and_rerun_resumes_rehashing_prefix_once(
        local_hub: LocalHub, repo: Any, weights: Path, tmp_path: Path) -> None:
    _repo, _commit, entry = repo
    size = weights.stat().st_size
    settings = settings_for(local_hub, tmp_path / "home")
    dest = settings.model_dir("m")
    # gives up at the first cut, however many bytes came before it
    one_shot = replace(FAST, max_attempts_without_progress=1, min_progress_bytes=1 << 40, connections=1,
                       block_bytes=None)
    local_hub.inject(file="model.gguf", method="GET", close_after_bytes=size // 3, times=1)
    with pytest.raises(Exception) as failed:
        await fetch_and_verify(entry, dest, settings=settings, options=one_shot, connections=1, progress=False)
    assert "rerun" in str(failed.value)
    part, sidecar, _lock = partial_paths(dest / ".partial", "org/model-GGUF", "model.gguf")
    side = json.loads(sidecar.read_text())
    assert side["done_bytes"] == size // 3 and side["revision"] == entry.artifact.revision
    assert not (dest / "model.gguf").exists()

    local_hub.reset_counters()
    result = await fetch_and_verify(entry, dest, settings=settings, options=one_shot, connections=1, progress=False)
    w = result.weights
    assert w is not None and w.resumed_from_bytes == size // 3
    assert w.bytes_reread == size // 3  # the prefix on disk is hashed once, nothing else read back
    assert local_hub.bytes_sent("model.gguf") == size - size // 3
    assert [r.range for r in local_hub.requests_for(file="model.gguf", method="GET")] == [f"bytes={size // 3}-{size - 1}"]
    assert (dest / "model.gguf").read_bytes() == weights.read_bytes()


@pytest.mark.anyio
async def test_500_burst_and_429_are_retried(local_hub: LocalHub, entry: Entry, settings: Settings,
                                             weights: Path) -> None:
    burst = local_hub.inject(file="model.gguf", method="GET", status=500, times=3)
    limited = local_hub.inject(file="model.gguf", method="HEAD", status=429, retry_after=0, times=2)
    await fetch_m(entry, settings)
    assert burst.hits == 3 and limited.hits == 2
    statuses = [r.status for r in local_hub.requests_for(file="model.gguf")]
    assert statuses.count(500) == 3 and statuses.count(429) == 2 and 206 in statuses
    assert (settings.model_dir("m") / "model.gguf").read_bytes() == weights.read_bytes()


@pytest.mark.anyio
async def test_retry_after_beyond_the_cap_gives_up_with_a_clear_error(local_hub: LocalHub, entry: Entry,
                                                                      settings: Settings) -> None:
    local_hub.inject(file="model.gguf", method="HEAD", status=429, retry_after=3600, times=None)
    with pytest.raises(Exception) as exc:
        await fetch_m(entry, settings)
    assert "429" in str(exc.value) and exc.value.exit_code == 11  # type: ignore[attr-defined]
    assert len(local_hub.requests_for(file="model.gguf", method="HEAD")) == 1  # no hammering


@pytest.mark.anyio
async def test_server_ignoring_range_restarts_as_one_stream(local_hub: LocalHub, entry: Entry, settings: Settings,
                                                            weights: Path) -> None:
    local_hub.inject(file="model.gguf", method="GET", ignore_range=True, times=None)
    result = await fetch_m(entry, settings)
    assert (settings.model_dir("m") / "model.gguf").read_bytes() == weights.read_bytes()
    assert result.weights is not None and result.weights.connections == 1
    final_get = local_hub.requests_for(file="model.gguf", method="GET")[-1]
    assert final_get.range is None and final_get.status == 200


@pytest.mark.anyio
async def test_wrong_size_fails_closed_before_writing(local_hub: LocalHub, entry: Entry, settings: Settings) -> None:
    local_hub.inject(file="model.gguf", advertise_size=entry.artifact.size_bytes - 10, times=None)
    with pytest.raises(PinMismatch, match="registry pins"):
        await fetch_m(entry, settings)
    assert local_hub.requests_for(file="model.gguf", method="GET") == []
    assert not (settings.model_dir("m") / "model.gguf").exists()


@pytest.mark.anyio
async def test_moved_branch_is_not_followed_and_a_repin_discards_the_old_partial(
        local_hub: LocalHub, repo: Any, weights: Path, tmp_path: Path) -> None:
    repo_id, old_commit, entry = repo
    other = make_gguf(tmp_path / "other.gguf", seed=7, pad_bytes=2 * MiB)
    new_commit = local_hub.commit(repo_id, {"model.gguf": other}, lfs=["model.gguf"])  # main moves
    assert local_hub.head(repo_id) == new_commit
    settings = settings_for(local_hub, tmp_path / "home")
    dest = settings.model_dir("m")
    # A partial of the new commit is lying around (from a run against a re-pinned registry) ...
    new_entry = make_entry("m", repo_id, new_commit, "model.gguf", other.stat().st_size, sha256_of(other))
    # gives up at the first cut, however many bytes came before it
    one_shot = replace(FAST, max_attempts_without_progress=1, min_progress_bytes=1 << 40, connections=1,
                       block_bytes=None)
    local_hub.inject(file="model.gguf", method="GET", close_after_bytes=MiB, times=1)
    with pytest.raises(Exception):
        await fetch_and_verify(new_entry, dest, settings=settings, options=one_shot, connections=1, progress=False)
    # ... the entry pinned to the old commit gets exactly the old bytes, never the moved main's
    result = await fetch_and_verify(entry, dest, settings=settings, options=FAST, progress=False)
    assert (dest / "model.gguf").read_bytes() == weights.read_bytes()
    assert result.weights is not None and result.weights.resumed_from_bytes == 0
    assert {r.revision for r in local_hub.requests_for(file="model.gguf", method="HEAD")} >= {old_commit}
    assert all(old_commit in r.url_path or new_commit in r.url_path
               for r in local_hub.requests_for(file="model.gguf"))


@pytest.mark.anyio
async def test_unpinned_entry_is_refused(local_hub: LocalHub, entry: Entry, settings: Settings) -> None:
    assert entry.artifact is not None
    unpinned = replace(entry, artifact=replace(entry.artifact, revision="main"))
    with pytest.raises(RegistryError, match="not pinned"):
        await fetch_and_verify(unpinned, settings.model_dir("m"), settings=settings, options=FAST, progress=False)
    assert local_hub.requests == []


@pytest.mark.anyio
async def test_gated_repo_names_licence_and_token_then_works_with_token(
        local_hub: LocalHub, weights: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commit = local_hub.create_repo("org/gated", {"model.gguf": weights}, lfs=["model.gguf"], gated_token="hf_ok")
    entry = make_entry("g", "org/gated", commit, "model.gguf", weights.stat().st_size, sha256_of(weights))
    settings = settings_for(local_hub, tmp_path / "home")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(HubError) as exc:
        await fetch_and_verify(entry, settings.model_dir("g"), settings=settings, options=FAST, progress=False)
    text = str(exc.value)
    assert "gated" in text and "licence" in text and "HF_TOKEN" in text
    monkeypatch.setenv("HF_TOKEN", "hf_ok")
    result = await fetch_and_verify(entry, settings.model_dir("g"), settings=settings, options=FAST, progress=False)
    assert result.weights is not None and result.weights.sha256 == sha256_of(weights)
    # the token went to the Hub, never to the CDN
    assert all(not r.authorization for r in local_hub.requests_for(file="model.gguf", where="cdn"))
    assert any(r.authorization for r in local_hub.requests_for(file="model.gguf", where="hub"))


@pytest.mark.anyio
async def test_missing_repo_and_missing_file(local_hub: LocalHub, repo: Any, tmp_path: Path) -> None:
    _repo, commit, entry = repo
    settings = settings_for(local_hub, tmp_path / "home")
    no_repo = replace(entry, artifact=replace(entry.artifact, repo="org/nope"))
    with pytest.raises(HubError, match="repository org/nope not found"):
        await fetch_and_verify(no_repo, settings.model_dir("m"), settings=settings, options=FAST, progress=False)
    no_file = replace(entry, artifact=replace(entry.artifact, file="missing.gguf"))
    with pytest.raises(HubError, match="missing.gguf not found"):
        await fetch_and_verify(no_file, settings.model_dir("m"), settings=settings, options=FAST, progress=False)


@pytest.mark.anyio
async def test_corrupt_body_is_discarded_and_fetched_again(local_hub: LocalHub, entry: Entry, settings: Settings,
                                                           weights: Path) -> None:
    local_hub.inject(file="model.gguf", method="GET", corrupt=True, times=1)
    result = await fetch_m(entry, settings)
    assert result.weights is not None and result.weights.integrity_retries == 1
    assert (settings.model_dir("m") / "model.gguf").read_bytes() == weights.read_bytes()


@pytest.mark.anyio
async def test_persistent_corruption_fails_and_never_places_the_file(local_hub: LocalHub, entry: Entry,
                                                                     settings: Settings) -> None:
    local_hub.inject(file="model.gguf", method="GET", corrupt=True, times=None)
    with pytest.raises(IntegrityError) as exc:
        await fetch_m(entry, settings, integrity_retries=1)
    assert exc.value.details["field"] == "sha256"
    assert not (settings.model_dir("m") / "model.gguf").exists()
    assert not list((settings.model_dir("m") / ".partial").glob("*.part"))  # bad bytes are not resumed from


@pytest.mark.anyio
async def test_header_mismatch_names_the_field_and_keeps_the_file_out(entry: Entry, settings: Settings) -> None:
    wrong = replace(entry, config=replace(entry.config, layer_groups=(LayerGroup(4, 8, 64, 64),)))
    fetched = await fetch_weights(wrong, settings.model_dir("m"), settings=settings, options=FAST, progress=False)
    with pytest.raises(IntegrityError, match="head_count_kv") as exc:
        await verify(wrong, settings.model_dir("m"), fetched=fetched)
    assert exc.value.details["field"] == "head_count_kv"
    assert not (settings.model_dir("m") / "model.gguf").exists()
    # the same bytes would fail again: the hashed partial is kept (never in place), not discarded
    assert fetched.weights.partial_path is not None and Path(fetched.weights.partial_path).is_file()


@pytest.mark.anyio
async def test_not_enough_disk_space_is_refused_up_front(local_hub: LocalHub, repo: Any, tmp_path: Path) -> None:
    _repo, _commit, entry = repo
    huge = 1 << 60  # the server claims (and the registry pins) an exabyte
    local_hub.inject(file="model.gguf", advertise_size=huge, times=None)
    settings = settings_for(local_hub, tmp_path / "home")
    big = replace(entry, artifact=replace(entry.artifact, size_bytes=huge, sha256=None))
    with pytest.raises(DiskSpaceError, match="not enough disk space"):
        await fetch_and_verify(big, settings.model_dir("m"), settings=settings, options=FAST, progress=False)
    assert local_hub.requests_for(file="model.gguf", method="GET") == []


@pytest.mark.anyio
async def test_offline_mode_refuses_network_but_serves_verified_files(local_hub: LocalHub, repo: Any,
                                                                      tmp_path: Path) -> None:
    _repo, _commit, entry = repo
    home = tmp_path / "home"
    offline = settings_for(local_hub, home, HF_HUB_OFFLINE="1")
    with pytest.raises(HubError, match="HF_HUB_OFFLINE"):
        await fetch_and_verify(entry, offline.model_dir("m"), settings=offline, options=FAST, progress=False)
    assert local_hub.requests == []
    online = settings_for(local_hub, home)
    await fetch_and_verify(entry, online.model_dir("m"), settings=online, options=FAST, progress=False)
    local_hub.reset_counters()
    result = await fetch_and_verify(entry, offline.model_dir("m"), settings=offline, options=FAST, progress=False)
    assert result.weights is not None and result.weights.already_present and local_hub.requests == []


@pytest.mark.anyio
async def test_missing_projector_is_a_warning_not_a_failure(local_hub: LocalHub, repo: Any, tmp_path: Path) -> None:
    repo_id, commit, entry = repo
    settings = settings_for(local_hub, tmp_path / "home")
    with_proj = replace(entry, projector=Artifact(repo_id, commit, "mmproj.gguf", 1000, None))
    result = await fetch_and_verify(with_proj, settings.model_dir("m"), settings=settings, options=FAST, progress=False)
    assert result.vision is False and result.projector is None
    assert any("projector" in w for w in result.warnings)
    assert (settings.model_dir("m") / "model.gguf").is_file()


@pytest.mark.anyio
async def test_present_projector_gives_vision(local_hub: LocalHub, weights: Path, tmp_path: Path) -> None:
    proj = make_gguf(tmp_path / "mmproj.gguf", arch="clip", pad_bytes=200_000, seed=3)
    commit = local_hub.create_repo("org/vl", {"model.gguf": weights, "mmproj.gguf": proj}, lfs=True)
    entry = make_entry("vl", "org/vl", commit, "model.gguf", weights.stat().st_size, sha256_of(weights),
                       projector=Artifact("org/vl", commit, "mmproj.gguf", proj.stat().st_size, sha256_of(proj)))
    settings = settings_for(local_hub, tmp_path / "home")
    result = await fetch_and_verify(entry, settings.model_dir("vl"), settings=settings, options=FAST, progress=False)
    assert result.vision is True and result.projector is not None
    assert (settings.model_dir("vl") / "mmproj.gguf").read_bytes() == proj.read_bytes()


@pytest.mark.anyio
async def test_second_writer_of_a_target_is_told_the_holder(local_hub: LocalHub, entry: Entry,
                                                            settings: Settings) -> None:
    dest = settings.model_dir("m")
    _p, _s, lock_path = partial_paths(dest / ".partial", "org/model-GGUF", "model.gguf")
    with FileLock(lock_path):  # another writer holds the target
        with pytest.raises(LockedError, match=f"PID {os.getpid()}"):
            await fetch_and_verify(entry, dest, settings=settings, options=FAST, progress=False)
    assert local_hub.requests == []


# --------------------------------------------------------------------------- OpenVINO snapshots


def _openvino_entry(repo_id: str, revision: str | None = None) -> Entry:
    base = make_entry("ov", repo_id, "0" * 40, "x", None, None, backend="openvino")
    return replace(base, artifact=Artifact(repo_id, revision, None, None, None), architecture=None)


@pytest.fixture
def ov_repo(local_hub: LocalHub) -> dict[str, Any]:
    rng = np.random.default_rng(5)
    files: dict[str, str | bytes] = {"openvino_model.xml": "<net/>" * 100, "openvino_model.bin": rng.bytes(1_200_000),
             "config.json": json.dumps({"max_position_embeddings": 40960}), "tok/tokenizer.json": "{}"}
    commit = local_hub.create_repo("OpenVINO/m-ov", files, lfs=["openvino_model.bin"])
    return {"files": files, "commit": commit}


@pytest.mark.anyio
async def test_openvino_snapshot_fetches_every_file_and_records_the_commit(local_hub: LocalHub, tmp_path: Path,
                                                                          ov_repo: dict[str, Any]) -> None:
    from hotfit.stages.verify import verify

    settings = settings_for(local_hub, tmp_path / "home")
    dest = settings.model_dir("ov")
    result = await fetch_weights(_openvino_entry("OpenVINO/m-ov"), dest, settings=settings, options=FAST,
                                 progress=False)
    snap = result.snapshot
    assert snap is not None and snap.commit == ov_repo["commit"] and snap.files == 4
    # fetch-weights leaves hashed partials; verify checks them and puts the snapshot in place
    assert not (dest / "snapshot").exists() and not (dest / "snapshot.json").exists()
    assert len(snap.listed) == 4 and all(f.partial_path and Path(f.partial_path).is_file() for f in snap.listed)
    placed = await verify(_openvino_entry("OpenVINO/m-ov"), dest, fetched=result)
    assert placed.files_checked == 4 and not list((dest / ".partial").glob("*.part"))
    for path, content in ov_repo["files"].items():
        data = content.encode() if isinstance(content, str) else content
        assert (dest / "snapshot" / path).read_bytes() == data
    manifest = json.loads((dest / "snapshot.json").read_text())
    assert manifest["commit"] == ov_repo["commit"] and manifest["revision_requested"] == "main"
    checked = await verify(_openvino_entry("OpenVINO/m-ov"), dest, rehash=True)
    assert checked.files_checked == 4


@pytest.mark.anyio
async def test_openvino_snapshot_follows_the_current_commit_and_refetches_only_changes(
        local_hub: LocalHub, tmp_path: Path, ov_repo: dict[str, Any]) -> None:
    settings = settings_for(local_hub, tmp_path / "home")
    dest = settings.model_dir("ov")
    await fetch_and_verify(_openvino_entry("OpenVINO/m-ov"), dest, settings=settings, options=FAST, progress=False)
    new = local_hub.commit("OpenVINO/m-ov", {"config.json": "{\"v\": 2}", "tok/tokenizer.json": None})
    local_hub.reset_counters()
    result = await fetch_and_verify(_openvino_entry("OpenVINO/m-ov"), dest, settings=settings, options=FAST,
                                 progress=False)
    assert result.snapshot is not None and result.snapshot.commit == new
    assert result.snapshot.files_already_present == 2
    assert {r.file for r in local_hub.requests_for(method="GET") if r.file} == {"config.json"}
    assert (dest / "snapshot" / "config.json").read_text() == "{\"v\": 2}"
    assert not (dest / "snapshot" / "tok" / "tokenizer.json").exists()  # gone from the commit, gone here


@pytest.mark.anyio
async def test_corrupt_non_lfs_file_fails_its_blob_id_and_is_refetched(local_hub: LocalHub, tmp_path: Path,
                                                                       ov_repo: dict[str, Any]) -> None:
    settings = settings_for(local_hub, tmp_path / "home")
    local_hub.inject(file="openvino_model.xml", method="GET", corrupt=True, times=1)
    result = await fetch_and_verify(_openvino_entry("OpenVINO/m-ov"), settings.model_dir("ov"), settings=settings,
                                 options=FAST, progress=False)
    assert result.snapshot is not None
    assert len(local_hub.requests_for(file="openvino_model.xml", method="GET")) == 2
    assert (settings.model_dir("ov") / "snapshot" / "openvino_model.xml").read_text() == ov_repo["files"]["openvino_model.xml"]


def test_snapshot_disk_check_counts_what_the_partials_already_hold(tmp_path: Path) -> None:
    # A resumed snapshot needs room only for the bytes still missing, like a single file's resume.
    from hotfit.stages.fetch_weights import ListedFile, _snapshot_needed_bytes

    partial_dir = tmp_path / ".partial"
    partial_dir.mkdir()
    a = ListedFile("a.bin", 4 << 20, None, "a" * 64)
    b = ListedFile("sub/b.bin", 2 << 20, None, "b" * 64)
    assert _snapshot_needed_bytes(partial_dir, "o/r", [a, b]) == 6 << 20
    part, _side, _lock = partial_paths(partial_dir, "o/r", "a.bin")
    part.write_bytes(b"x" * (3 << 20))  # 3 MiB of a.bin already on disk
    assert _snapshot_needed_bytes(partial_dir, "o/r", [a, b]) <= (1 << 20) + (2 << 20)


@pytest.mark.anyio
@pytest.mark.parametrize("evil", ["../escape.txt", "/etc/escape.txt", "a/../../escape.txt"])
async def test_snapshot_listing_with_escaping_path_is_refused(local_hub: LocalHub, tmp_path: Path,
                                                              ov_repo: dict[str, Any], evil: str) -> None:
    # Hand-write a commit whose tree lists an escaping path (the store refuses to create one) and move main.
    commits = Path(local_hub.store.root) / "repos" / "OpenVINO/m-ov" / "commits"
    data = json.loads((commits / f"{ov_repo['commit']}.json").read_text())
    entry = data["files"].pop("config.json")
    data["files"][evil] = {**entry, "path": evil}
    data["id"] = hashlib.sha1(evil.encode()).hexdigest()
    (commits / f"{data['id']}.json").write_text(json.dumps(data))
    local_hub.set_ref("OpenVINO/m-ov", "main", data["id"])
    settings = settings_for(local_hub, tmp_path / "home")
    with pytest.raises(IntegrityError, match="would escape") as exc:
        await fetch_and_verify(_openvino_entry("OpenVINO/m-ov"), settings.model_dir("ov"), settings=settings,
                            options=FAST, progress=False)
    assert exc.value.details["path"] == evil
    assert local_hub.requests_for(method="GET", where="cdn") == []
    assert not (settings.model_dir("ov") / "snapshot").exists()
    assert not (tmp_path / "home" / "models" / "escape.txt").exists()


@pytest.mark.anyio
async def test_snapshot_of_gated_or_missing_repo(local_hub: LocalHub, tmp_path: Path, ov_repo: dict[str, Any],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    settings = settings_for(local_hub, tmp_path / "home")
    with pytest.raises(HubError, match="not found"):
        await fetch_and_verify(_openvino_entry("OpenVINO/absent"), settings.model_dir("ov"), settings=settings,
                            options=FAST, progress=False)
    local_hub.set_gated("OpenVINO/m-ov", "hf_secret")
    with pytest.raises(HubError) as exc:
        await fetch_and_verify(_openvino_entry("OpenVINO/m-ov"), settings.model_dir("ov"), settings=settings,
                            options=FAST, progress=False)
    assert "licence" in str(exc.value) and "HF_TOKEN" in str(exc.value)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    result = await fetch_and_verify(_openvino_entry("OpenVINO/m-ov"), settings.model_dir("ov"), settings=settings,
                                 options=FAST, progress=False)
    assert result.snapshot is not None and result.snapshot.files == 4


@pytest.mark.anyio
async def test_revision_header_mismatch_fails_closed(tmp_path: Path) -> None:
    """A server (a stale mirror, a misconfigured proxy) that answers the pinned URL with another commit."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_a: Any) -> None:
            pass

        def do_HEAD(self) -> None:  # noqa: N802 - stdlib name
            seen.append("HEAD " + self.path)
            self.send_response(200)
            self.send_header("X-Repo-Commit", "f" * 40)
            self.send_header("ETag", '"' + "a" * 64 + '"')
            self.send_header("Content-Length", "1000")
            self.end_headers()

        def do_GET(self) -> None:  # noqa: N802 - stdlib name
            seen.append("GET " + self.path)
            self.send_error(500)

    with serve_handler(Handler) as url:
        settings = load_settings({"HOTFIT_HOME": str(tmp_path / "home"), "HF_ENDPOINT": url})
        entry = make_entry("m", "org/m", "1" * 40, "model.gguf", 1000, "a" * 64)
        with pytest.raises(PinMismatch, match="served commit f{40} but the registry pins 1{40}") as exc:
            await fetch_m(entry, settings)
        assert exc.value.details["served"] == "f" * 40
    assert seen == [f"HEAD /org/m/resolve/{'1' * 40}/model.gguf"]  # nothing fetched from a wrong commit
    assert not (tmp_path / "home" / "models" / "m" / "model.gguf").exists()


@pytest.mark.anyio
async def test_an_unreachable_mirror_reports_each_retry_before_giving_up(tmp_path: Path) -> None:
    # Before: ~18 s of silence, then the error. Each wait is now a download.retry event; the URL
    # carries no credentials (a mirror's user:password in HF_ENDPOINT never reaches the log).
    port = free_port_closed()  # nothing listens there: connection refused on every attempt
    settings = load_settings({"HOTFIT_HOME": str(tmp_path / "home"),
                              "HF_ENDPOINT": f"http://mirror-user:s3cret@127.0.0.1:{port}"})
    entry = make_entry("m", "org/m", "1" * 40, "model.gguf", 1000, "a" * 64)
    with structlog.testing.capture_logs() as events:
        with pytest.raises(TransferError, match="gave up .4 attempts in a row brought less than"):
            await fetch_m(entry, settings)
    retries = [e for e in events if e["event"] == "download.retry"]
    assert [e["attempt"] for e in retries] == list(range(1, FAST.max_attempts_without_progress))
    for e in retries:
        assert e["url"] == f"http://127.0.0.1:{port}/org/m/resolve/{'1' * 40}/model.gguf"
        assert "ConnectError" in e["cause"] and e["wait_s"] >= 0
        assert e["repo"] == "org/m" and e["file"] == "model.gguf"
    assert "s3cret" not in json.dumps(events, default=str)


@pytest.mark.anyio
async def test_a_retried_cdn_get_is_reported_without_the_signed_query(local_hub: LocalHub, entry: Entry,
                                                                      settings: Settings, weights: Path) -> None:
    local_hub.inject(file="model.gguf", method="GET", where="cdn", status=503, retry_after=0, times=1)
    with structlog.testing.capture_logs() as events:
        await fetch_m(entry, settings)
    retries = [e for e in events if e["event"] == "download.retry"]
    assert len(retries) == 1
    assert retries[0]["attempt"] == 1 and "HTTP 503" in retries[0]["cause"] and retries[0]["wait_s"] == 0
    assert retries[0]["url"].startswith(local_hub.cdn_endpoint) and "?" not in retries[0]["url"]


@pytest.mark.anyio
async def test_a_retried_snapshot_listing_is_reported(local_hub: LocalHub, tmp_path: Path,
                                                      ov_repo: dict[str, Any]) -> None:
    settings = settings_for(local_hub, tmp_path / "home")
    local_hub.inject(url="/api/models/*", status=503, retry_after=0, times=1)
    with structlog.testing.capture_logs() as events:
        result = await fetch_and_verify(_openvino_entry("OpenVINO/m-ov"), settings.model_dir("ov"), settings=settings,
                                     options=FAST, progress=False)
    assert result.snapshot is not None
    retries = [e for e in events if e["event"] == "download.retry"]
    assert len(retries) == 1 and retries[0]["repo"] == "OpenVINO/m-ov" and retries[0]["file"] is None
    assert retries[0]["url"].startswith(f"{local_hub.endpoint}/api/models/OpenVINO/m-ov/tree/")


NOT_A_HUB = "HF_ENDPOINT does not answer like a Hugging Face Hub"


@pytest.mark.anyio
async def test_a_web_server_that_is_not_a_hub_is_named_not_blamed_on_the_registry(not_a_hub: str,
                                                                                  tmp_path: Path) -> None:
    # Before: a bare 404 read as "the file was renamed or removed; fix the registry entry", and an
    # HTML 200 as a missing X-Repo-Commit. Neither is the registry's fault.
    settings = load_settings({"HOTFIT_HOME": str(tmp_path / "home"), "HF_ENDPOINT": not_a_hub})
    entry = make_entry("m", "org/m-GGUF", "1" * 40, "model.gguf", 1000, "a" * 64)
    with pytest.raises(HubError) as exc:
        await fetch_m(entry, settings)
    assert NOT_A_HUB in exc.value.what and not_a_hub in exc.value.what
    assert "renamed" not in str(exc.value) and "registry" not in str(exc.value)
    assert exc.value.details["endpoint"] == not_a_hub


@pytest.mark.anyio
async def test_a_snapshot_listing_from_a_server_that_is_not_a_hub_says_so(not_a_hub: str, tmp_path: Path) -> None:
    settings = load_settings({"HOTFIT_HOME": str(tmp_path / "home"), "HF_ENDPOINT": not_a_hub})
    with pytest.raises(HubError) as exc:
        await fetch_and_verify(_openvino_entry("OpenVINO/m-ov"), settings.model_dir("ov"), settings=settings,
                            options=FAST, progress=False)
    assert NOT_A_HUB in exc.value.what and not_a_hub in exc.value.what

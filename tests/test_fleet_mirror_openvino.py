"""OpenVINO snapshots in the fleet's mirror: ``hotfit registry lock`` pins a snapshot's revision and
its file list (``artifact.sha256``, core.model_files.snapshot_listing_sha256); ``hotfit fleet mirror``
fills every file of the repository at that commit plus the listing where the Hub's tree API answers;
Debian's nginx serves the read-only tree on loopback and machines pull the snapshot from it with 0
requests to the upstream Hub, trusting only the registry's pin (docs/fleet.md, "OpenVINO snapshots").

The repository is a fixture (small IR-named files, one LFS): what is shown is listing, transport and
trust, which a real export's bytes would not change; tests/test_auto_openvino_e2e.py runs real exports."""

from __future__ import annotations

import dataclasses
import json
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hotfit.core.entry import Artifact, TemplateSource
from tests.e2e_support import write_registry
from tests.hubserver import LocalHub
from tests.test_fetch_weights import make_entry
from tests.test_fleet_mirror import TOKEN, Nginx, by_name_only, hotfit
from tests.test_pull_cli import env_for

TIER = "integration"

REPO = "OpenVINO/m-int4-ov"
TOOLS_TEMPLATE = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                  "{% if tools %}<tool_call>{{ tools | tojson }}</tool_call>{% endif %}")


@pytest.fixture
def ov_world(local_hub: LocalHub, tmp_path: Path) -> dict[str, Any]:
    rng = np.random.default_rng(7)
    files: dict[str, str | bytes] = {
        "openvino_model.xml": "<net/>" * 200, "openvino_model.bin": rng.bytes(600_000),
        "config.json": json.dumps({"max_position_embeddings": 40960}),
        "tokenizer_config.json": json.dumps({"chat_template": TOOLS_TEMPLATE}), "tok/vocab.json": "{}"}
    commit = local_hub.create_repo(REPO, files, lfs=["openvino_model.bin"])
    base = make_entry("ov", REPO, commit, "x", None, None, backend="openvino")
    # as the bundled OpenVINO entries are: revision, size and sha256 open, the template a file of the snapshot
    entry = by_name_only(dataclasses.replace(base, artifact=Artifact(REPO, None, None, None, None), architecture=None,
                                             chat_template=TemplateSource(REPO, None, "tokenizer_config.json")))
    registry = tmp_path / "registry.json"
    write_registry(registry, [entry])
    locked = tmp_path / "locked.json"
    out = hotfit(tmp_path / "locker", "--json", "registry", "lock", "--registry", str(registry), "--output",
                 str(locked), env=env_for(local_hub))
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    return {"files": files, "commit": commit, "registry": registry, "locked": locked}


@pytest.fixture
def served(local_hub: LocalHub, ov_world: dict[str, Any], tmp_path: Path) -> Iterator[dict[str, Any]]:
    mirror = tmp_path / "mirror"
    out = hotfit(tmp_path / "filler", "--json", "fleet", "mirror", str(mirror), "ov", "--registry",
                 str(ov_world["locked"]), env={**env_for(local_hub), "HF_TOKEN": TOKEN})
    assert out.returncode == 0, out.stderr[-3000:]
    nginx = Nginx(mirror, tmp_path / "nginx")
    try:
        yield {"mirror": mirror, "result": json.loads(out.stdout), "nginx": nginx,
               "env": {**env_for(local_hub), "HF_ENDPOINT": nginx.url, "HF_TOKEN": TOKEN}}
    finally:
        nginx.stop()
        for p in [mirror, *mirror.rglob("*")]:
            p.chmod(p.stat().st_mode | stat.S_IWUSR)


def _data(content: str | bytes) -> bytes:
    return content.encode() if isinstance(content, str) else content


def test_the_lock_pins_the_snapshot_and_the_mirror_holds_every_file_and_its_listing(
        local_hub: LocalHub, ov_world: dict[str, Any], served: dict[str, Any], tmp_path: Path) -> None:
    art = json.loads(ov_world["locked"].read_text())["entries"][0]["artifact"]
    assert art["revision"] == ov_world["commit"] and len(art["sha256"]) == 64
    assert art["size_bytes"] == sum(len(_data(c)) for c in ov_world["files"].values())
    [snap] = served["result"]["files"]
    assert (snap["role"], snap["status"], snap["pinned"]) == ("snapshot", "fetched", True)
    assert snap["fetched_bytes"] == art["size_bytes"]
    mirror = served["mirror"]
    for path, content in ov_world["files"].items():
        assert (mirror / REPO / "resolve" / ov_world["commit"] / path).read_bytes() == _data(content)
    listing = json.loads((mirror / "api" / "models" / REPO / "tree" / ov_world["commit"]).read_text())
    assert sorted(i["path"] for i in listing) == sorted(ov_world["files"])
    # a rerun fetches nothing
    local_hub.reset_counters()
    out = hotfit(tmp_path / "filler", "--json", "fleet", "mirror", str(mirror), "ov", "--registry",
                 str(ov_world["locked"]), env=env_for(local_hub))
    assert out.returncode == 0 and json.loads(out.stdout)["files"][0]["status"] == "present"
    assert local_hub.requests_for(method="GET", where="cdn") == []


def test_machines_pull_the_snapshot_from_nginx_with_0_upstream_requests(
        local_hub: LocalHub, ov_world: dict[str, Any], served: dict[str, Any], tmp_path: Path) -> None:
    mirror = served["mirror"]
    for p in [mirror, *mirror.rglob("*")]:  # the same tree, read-only
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    upstream = len(local_hub.requests)
    for i in range(2):  # two machines, two homes
        home = tmp_path / f"machine{i}"
        out = hotfit(home, "--json", "pull", "ov", "--registry", str(ov_world["locked"]), env=served["env"])
        assert out.returncode == 0, out.stderr[-3000:]
        for path, content in ov_world["files"].items():
            assert (home / "models" / "ov" / "snapshot" / path).read_bytes() == _data(content)
        assert json.loads((home / "models" / "ov" / "snapshot.json").read_text())["commit"] == ov_world["commit"]
        assert (home / "models" / "ov" / "chat_template.jinja").read_text() == TOOLS_TEMPLATE
    assert len(local_hub.requests) == upstream  # 0 requests to the upstream Hub
    lines = served["nginx"].requests()
    assert any(f"/api/models/{REPO}/tree/{ov_world['commit']} 200" in line for line in lines), lines
    assert all(line.endswith("auth=-") for line in lines)  # the token never went there


def test_an_unpinned_snapshot_is_not_mirrored_and_is_refused_from_a_static_mirror(
        local_hub: LocalHub, ov_world: dict[str, Any], served: dict[str, Any], tmp_path: Path) -> None:
    out = hotfit(tmp_path / "filler", "--json", "fleet", "mirror", str(tmp_path / "m2"), "ov", "--registry",
                 str(ov_world["registry"]), env=env_for(local_hub))
    assert out.returncode == 0, out.stderr[-3000:]
    [snap] = json.loads(out.stdout)["files"]
    assert snap["status"] == "skipped" and "registry lock" in snap["reason"]
    out = hotfit(tmp_path / "m", "--json", "pull", "ov", "--registry", str(ov_world["registry"]), env=served["env"])
    assert out.returncode == 4
    err = json.loads(out.stdout)["error"]
    assert "static mirror serves an OpenVINO snapshot only when the registry pins" in err["message"], err
    assert "registry lock" in err["hint"]
    assert not (tmp_path / "m" / "models" / "ov" / "snapshot").exists()


def test_a_listing_or_a_file_the_pin_does_not_vouch_for_is_refused(
        local_hub: LocalHub, ov_world: dict[str, Any], served: dict[str, Any], tmp_path: Path) -> None:
    mirror, commit = served["mirror"], ov_world["commit"]
    listing_path = mirror / "api" / "models" / REPO / "tree" / commit
    original = listing_path.read_text()
    # a listing that names other bytes for config.json (consistent with a changed file beside it)
    config = mirror / REPO / "resolve" / commit / "config.json"
    config_bytes = config.read_bytes()
    forged = b'{"max_position_embeddings": 99999}'[:len(config_bytes)].ljust(len(config_bytes))
    listing = json.loads(original)
    from tests.hubserver import git_blob_sha1

    for item in listing:
        if item["path"] == "config.json":
            item["oid"] = git_blob_sha1(forged)
    listing_path.write_text(json.dumps(listing))
    config.write_bytes(forged)
    out = hotfit(tmp_path / "a", "--json", "pull", "ov", "--registry", str(ov_world["locked"]), env=served["env"])
    assert out.returncode == 4
    err = json.loads(out.stdout)["error"]
    assert "the registry pins" in err["message"] and "fleet mirror" in err["hint"], err
    assert not (tmp_path / "a" / "models" / "ov" / "snapshot").exists()
    # the listing restored, the file still changed (same size): refused by its git blob id
    listing_path.write_text(original)
    out = hotfit(tmp_path / "b", "--json", "pull", "ov", "--registry", str(ov_world["locked"]), env=served["env"])
    assert out.returncode != 0
    assert "config.json" in json.loads(out.stdout)["error"]["message"]
    assert not (tmp_path / "b" / "models" / "ov" / "snapshot" / "config.json").exists()

"""``hotfit fleet mirror`` and provisioning from a static mirror: the directory is filled from the
local Hub (tests/hubserver.py, which counts every request) with each artifact fetched once, served
read-only by Debian's nginx on loopback (its own config, a free port, no system service), and several
machines — distinct homes and probe files — pull from it with 0 requests to the upstream Hub, trusting
only the registry's pins; the token goes to nginx only when HOTFIT_MIRROR_TOKEN asks (docs/fleet.md).
The GGUFs are built fixtures (tests/test_fetch_weights.py, ``make_gguf``): what is shown is
transport and trust, which a real model's bytes would not change."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hotfit.core.entry import Entry, TemplateSource
from tests.e2e_support import sha256_of, write_registry
from tests.gguf_fixtures import free_port
from tests.hubserver import LocalHub
from tests.polling import accepts_connections, wait_until
from tests.test_fetch_weights import make_entry, make_gguf
from tests.test_pull_cli import env_for

TIER = "integration"

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKEN = "hf_fleet_secret"


def hotfit(home: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hotfit", "--home", str(home), "--log-format", "json", *args],
                          env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def by_name_only(e: Entry) -> Entry:
    """Not auto-eligible: pulled by name, so it may name no chat template."""
    return dataclasses.replace(e, ineligible_reason="fixture", ineligible_cause="unverified", auto_eligible=False)


@pytest.fixture
def world(local_hub: LocalHub, tmp_path: Path) -> dict[str, Any]:
    """Two pinned entries sharing nothing, one sharing the first's file (fetched once), and one
    without a sha256 pin."""
    src = tmp_path / "src"
    src.mkdir()
    a = make_gguf(src / "a.gguf", seed=1)
    b = make_gguf(src / "b.gguf", seed=2, ctx=65536)  # holds the 32768-token floor: fleet plan picks it
    ca = local_hub.create_repo("org/a-GGUF", {"a.gguf": a}, lfs=["a.gguf"])
    cb = local_hub.create_repo("org/b-GGUF", {"b.gguf": b}, lfs=["b.gguf"])
    # pulled by name: no chat template to fetch (a template pinned by commit alone is refused from a
    # static mirror, like any file without a sha256 pin)
    entries = [by_name_only(e) for e in (
        make_entry("ma", "org/a-GGUF", ca, "a.gguf", a.stat().st_size, sha256_of(a)),
        make_entry("ma-alias", "org/a-GGUF", ca, "a.gguf", a.stat().st_size, sha256_of(a)),
        make_entry("mb", "org/b-GGUF", cb, "b.gguf", b.stat().st_size, sha256_of(b), ctx=65536),
        make_entry("nosha", "org/b-GGUF", cb, "b.gguf", b.stat().st_size, None, ctx=65536))]
    # auto-eligible entries name their chat template: pinned by size and sha256 (a static mirror may
    # serve it), or by commit alone (it may not)
    template = b"{% for m in messages %}{{ m.content }}{% endfor %}{# tools <tool_call> #}"
    tc = local_hub.create_repo("org/tpl", {"chat_template.jinja": template})
    pinned = TemplateSource("org/tpl", tc, "chat_template.jinja", len(template), hashlib.sha256(template).hexdigest())
    entries += [make_entry("mt", "org/b-GGUF", cb, "b.gguf", b.stat().st_size, sha256_of(b), template=pinned,
                           ctx=65536),
                make_entry("mt-commit-only", "org/b-GGUF", cb, "b.gguf", b.stat().st_size, sha256_of(b), ctx=65536,
                           template=TemplateSource("org/tpl", tc, "chat_template.jinja"))]
    registry = tmp_path / "registry.json"
    write_registry(registry, entries)
    return {"registry": registry, "template_bytes": len(template), "sizes": {"a.gguf": a.stat().st_size, "b.gguf": b.stat().st_size},
            "files": {"a.gguf": a, "b.gguf": b}, "commits": {"a.gguf": ca, "b.gguf": cb}}


class Nginx:
    """Debian's nginx serving ``root`` on a free loopback port, logging each request with whether it
    carried an Authorization header."""

    def __init__(self, root: Path, workdir: Path) -> None:
        exe = shutil.which("nginx") or "/usr/sbin/nginx"
        if not os.path.exists(exe):
            raise RuntimeError("nginx is not installed: apt-get install nginx (scripts/bootstrap --test does)")
        workdir.mkdir(parents=True)
        self.port = free_port()
        self.log = workdir / "access.log"
        user = "user root;\n" if os.geteuid() == 0 else ""  # workers read the test's 0700 tmp dirs
        temp = "".join(f"  {k}_temp_path {workdir / k};\n" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        (workdir / "nginx.conf").write_text(
            f"{user}daemon off;\nworker_processes 1;\npid {workdir / 'nginx.pid'};\nerror_log {workdir / 'error.log'};\n"
            "events {}\nhttp {\n  default_type application/octet-stream;\n"
            "  log_format fleet '$request_method $uri $status auth=$http_authorization';\n"
            f"  access_log {self.log} fleet;\n{temp}"
            f"  server {{\n    listen 127.0.0.1:{self.port};\n    root {root};\n  }}\n}}\n")
        self.proc = subprocess.Popen([exe, "-p", str(workdir), "-c", str(workdir / "nginx.conf")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_until(lambda: accepts_connections(self.port), f"nginx to accept connections on port {self.port}",
                   timeout_s=30, proc=self.proc)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def requests(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture
def filled(local_hub: LocalHub, world: dict[str, Any], tmp_path: Path) -> Iterator[dict[str, Any]]:
    mirror = tmp_path / "mirror"
    out = hotfit(tmp_path / "filler", "--json", "fleet", "mirror", str(mirror), "ma", "ma-alias", "mb", "mt",
                 "--registry", str(world["registry"]), env={**env_for(local_hub), "HF_TOKEN": TOKEN})
    assert out.returncode == 0, out.stderr[-3000:]
    yield {"mirror": mirror, "result": json.loads(out.stdout)}


def test_filling_fetches_each_artifact_once_verified_and_a_rerun_fetches_nothing(
        local_hub: LocalHub, world: dict[str, Any], filled: dict[str, Any], tmp_path: Path) -> None:
    result, mirror = filled["result"], filled["mirror"]
    # ma and ma-alias share org/a-GGUF's file: one entry in the list, one transfer at the upstream
    assert sorted((f["repo"], f["status"]) for f in result["files"]) == [("org/a-GGUF", "fetched"),
                                                                        ("org/b-GGUF", "fetched"),
                                                                        ("org/tpl", "fetched")]
    for name, size in world["sizes"].items():
        assert local_hub.bytes_sent(name) == size  # each byte once
        path = mirror / ("org/a-GGUF" if name == "a.gguf" else "org/b-GGUF") / "resolve" / world["commits"][name] / name
        assert sha256_of(path) == sha256_of(world["files"][name])
    assert result["fetched_bytes"] == sum(world["sizes"].values()) + world["template_bytes"]
    before = len(local_hub.requests)
    again = hotfit(tmp_path / "filler", "--json", "fleet", "mirror", str(mirror), "ma", "mb",
                   "--registry", str(world["registry"]), env=env_for(local_hub))
    assert again.returncode == 0, again.stderr[-3000:]
    assert {f["status"] for f in json.loads(again.stdout)["files"]} == {"present"}
    assert len(local_hub.requests) == before  # nothing fetched twice


def test_a_damaged_mirror_file_is_fetched_again(local_hub: LocalHub, world: dict[str, Any],
                                                 filled: dict[str, Any], tmp_path: Path) -> None:
    path = filled["mirror"] / "org/b-GGUF/resolve" / world["commits"]["b.gguf"] / "b.gguf"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    out = hotfit(tmp_path / "filler", "--json", "fleet", "mirror", str(filled["mirror"]), "mb",
                 "--registry", str(world["registry"]), env=env_for(local_hub))
    assert out.returncode == 0 and json.loads(out.stdout)["files"][0]["status"] == "fetched"
    assert sha256_of(path) == sha256_of(world["files"]["b.gguf"])


def test_machines_provision_from_nginx_serving_the_read_only_mirror_with_0_upstream_requests(
        local_hub: LocalHub, world: dict[str, Any], filled: dict[str, Any], tmp_path: Path) -> None:
    mirror = filled["mirror"]
    for p in [mirror, *mirror.rglob("*")]:  # the same tree, read-only
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    nginx = Nginx(mirror, tmp_path / "nginx")
    try:
        upstream = len(local_hub.requests)
        env = {**env_for(local_hub), "HF_ENDPOINT": nginx.url, "HF_TOKEN": TOKEN}
        for i, name in enumerate(("ma", "mb", "ma-alias", "mt")):  # four machines, four homes
            home = tmp_path / f"machine{i}"
            out = hotfit(home, "--json", "pull", name, "--registry", str(world["registry"]), env=env)
            assert out.returncode == 0, out.stderr[-3000:]
            pulled = json.loads(out.stdout)
            weights = home / "models" / name / ("a.gguf" if name.startswith("ma") else "b.gguf")
            assert sha256_of(weights) == sha256_of(world["files"][weights.name]), pulled
            assert '"download.static_mirror"' in out.stderr
        assert (tmp_path / "machine3" / "models" / "mt" / "chat_template.jinja").is_file()
        assert len(local_hub.requests) == upstream  # 0 requests to the upstream Hub
        served = nginx.requests()
        assert served and all(line.endswith("auth=-") for line in served)  # the token never went there
        # an entry the registry does not pin by sha256 is refused from the mirror, with the reason
        out = hotfit(tmp_path / "machine9", "--json", "pull", "nosha", "--registry", str(world["registry"]), env=env)
        assert out.returncode == 4
        err = json.loads(out.stdout)["error"]
        assert "static mirror" in err["message"] and "sha256" in err["message"]
        out = hotfit(tmp_path / "machine7", "--json", "pull", "mt-commit-only", "--registry", str(world["registry"]),
                     env=env)  # its template is pinned by commit only
        assert out.returncode == 4
        err = json.loads(out.stdout)["error"]
        assert "chat template" in err["message"] and "size and sha256" in err["message"], err
        # asked for, the token goes there too
        out = hotfit(tmp_path / "machine8", "--json", "pull", "mb", "--registry", str(world["registry"]),
                     env={**env, "HOTFIT_MIRROR_TOKEN": "1"})
        assert out.returncode == 0, out.stderr[-3000:]
        assert any(line.endswith(f"auth=Bearer {TOKEN}") for line in nginx.requests())
        assert len(local_hub.requests) == upstream
    finally:
        nginx.stop()
        for p in [mirror, *mirror.rglob("*")]:
            p.chmod(p.stat().st_mode | stat.S_IWUSR)


def test_a_hub_mirror_gets_the_token_once_it_answered_like_a_hub(local_hub: LocalHub, world: dict[str, Any],
                                                                   tmp_path: Path) -> None:
    # A gated repository: the first HEAD goes without the token (the endpoint has not shown itself a
    # Hub yet); the Hub's GatedRepo answer (X-Error-Code) shows it is one, and the HEAD is sent again
    # with the token.
    data = world["files"]["b.gguf"]
    commit = local_hub.create_repo("org/gated", {"g.gguf": data}, lfs=["g.gguf"], gated_token=TOKEN)
    entry = by_name_only(make_entry("g", "org/gated", commit, "g.gguf", data.stat().st_size, sha256_of(data)))
    registry = tmp_path / "gated.json"
    write_registry(registry, [entry])
    out = hotfit(tmp_path / "m", "--json", "pull", "g", "--registry", str(registry),
                 env={**env_for(local_hub), "HF_TOKEN": TOKEN})
    assert out.returncode == 0, out.stderr[-3000:]
    heads = [r for r in local_hub.requests if r.where == "hub" and r.method == "HEAD"]
    assert not heads[0].authorization and heads[0].status in (401, 403)
    assert heads[1].authorization and heads[1].status < 400
    assert not any(r.authorization for r in local_hub.requests if r.where == "cdn")
    assert '"download.static_mirror"' not in out.stderr


def test_mirror_needs_a_plan_or_names(tmp_path: Path, local_hub: LocalHub) -> None:
    out = hotfit(tmp_path / "h", "--json", "fleet", "mirror", str(tmp_path / "m"), env=env_for(local_hub))
    assert out.returncode == 2 and "--plan" in json.loads(out.stdout)["error"]["message"]


def test_mirror_from_a_fleet_plan_places_the_builds_and_names_the_missing(
        local_hub: LocalHub, world: dict[str, Any], tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"machines": [{"model": "ma"}, {"model": "mb"}, {"model": None}],
                                "builds": [{"flavour": "cpu", "export_command": "scripts/install-llama-server "
                                            "--backend cpu --export llama-server-cpu.tar.gz"},
                                           {"flavour": "cuda", "export_command": "x"}]}))
    builds = tmp_path / "exports"
    builds.mkdir()
    (builds / "llama-server-cpu.tar.gz").write_bytes(b"archive bytes")  # a stand-in: only placement is shown
    out = hotfit(tmp_path / "h", "--json", "fleet", "mirror", str(tmp_path / "m"), "--plan", str(plan),
                 "--registry", str(world["registry"]), "--builds", str(builds), env=env_for(local_hub))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert {f["repo"] for f in result["files"]} == {"org/a-GGUF", "org/b-GGUF"}
    placed = {b["flavour"]: b for b in result["builds"]}
    assert placed["cpu"]["status"] == "placed" and placed["cuda"]["status"] == "missing"
    sums = (tmp_path / "m" / "builds" / "SHA256SUMS").read_text()
    assert f"{sha256_of(builds / 'llama-server-cpu.tar.gz')}  llama-server-cpu.tar.gz" in sums
    # and beside the archive, where `install-llama-server --from URL` looks (URL.sha256)
    beside = (tmp_path / "m" / "builds" / "llama-server-cpu.tar.gz.sha256").read_text()
    assert beside == f"{sha256_of(builds / 'llama-server-cpu.tar.gz')}  llama-server-cpu.tar.gz\n"


def test_filling_from_the_hugging_face_cache_makes_no_request(local_hub: LocalHub, world: dict[str, Any],
                                                              tmp_path: Path) -> None:
    from tests.test_hf_cache import fill_cache

    cache = tmp_path / "hf-cache"
    for name in ("a.gguf", "b.gguf"):
        fill_cache(local_hub, cache, "org/a-GGUF" if name == "a.gguf" else "org/b-GGUF", name, world["commits"][name])
    local_hub.reset_counters()
    out = hotfit(tmp_path / "filler", "--json", "fleet", "mirror", str(tmp_path / "m"), "ma", "mb",
                 "--registry", str(world["registry"]),
                 env={**env_for(local_hub), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert {f["status"] for f in json.loads(out.stdout)["files"]} == {"hf-cache"}
    assert local_hub.requests == []
    for name, repo in (("a.gguf", "org/a-GGUF"), ("b.gguf", "org/b-GGUF")):
        path = tmp_path / "m" / repo / "resolve" / world["commits"][name] / name
        assert sha256_of(path) == sha256_of(world["files"][name])


def test_a_cut_transfer_is_resumed_not_restarted(local_hub: LocalHub, world: dict[str, Any], tmp_path: Path) -> None:
    size = world["sizes"]["a.gguf"]
    cut = local_hub.inject(file="a.gguf", method="GET", close_after_bytes=size // 3, times=1)
    out = hotfit(tmp_path / "filler", "--json", "fleet", "mirror", str(tmp_path / "m"), "ma",
                 "--registry", str(world["registry"]), env=env_for(local_hub))
    assert out.returncode == 0, out.stderr[-3000:]
    assert cut.hits == 1  # the stream was cut once, and the transfer went on from where it was:
    assert size <= local_hub.bytes_sent("a.gguf") < size + size // 3
    path = tmp_path / "m" / "org/a-GGUF/resolve" / world["commits"]["a.gguf"] / "a.gguf"
    assert sha256_of(path) == sha256_of(world["files"]["a.gguf"])


def test_fleet_plan_output_is_what_fleet_mirror_reads(local_hub: LocalHub, world: dict[str, Any],
                                                      tmp_path: Path) -> None:
    probes = tmp_path / "probes"
    probes.mkdir()
    for i in range(3):
        (probes / f"m{i}.json").write_text(json.dumps({
            "schema": 1, "selected": 0, "machine": {"name": f"m{i}", "arch": "x86_64"},
            "devices": [{"index": 0, "kind": "cpu", "name": "host memory", "total_bytes": 16 << 30,
                         "free_bytes": (14 << 30) - i}]}))
    out = hotfit(tmp_path / "h", "--json", "fleet", "plan", str(probes), "--registry", str(world["registry"]),
                 env=env_for(local_hub))
    assert out.returncode == 0, out.stderr[-3000:]
    plan = json.loads(out.stdout)
    assert {m["model"] for m in plan["machines"]} == {"mt"} and [b["flavour"] for b in plan["builds"]] == ["cpu"]
    (tmp_path / "plan.json").write_text(out.stdout)
    out = hotfit(tmp_path / "h", "--json", "fleet", "mirror", str(tmp_path / "m"), "--plan", str(tmp_path / "plan.json"),
                 "--registry", str(world["registry"]), env=env_for(local_hub))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert sorted(f["repo"] for f in result["files"]) == ["org/b-GGUF", "org/tpl"]
    assert [(f["machines"], f["status"]) for f in result["files"]] == [(3, "fetched"), (3, "fetched")]
    assert [(b["flavour"], b["status"]) for b in result["builds"]] == [("cpu", "missing")]


@pytest.mark.llama
def test_machines_run_hotfit_auto_from_the_static_mirror(local_hub: LocalHub, tmp_path: Path) -> None:
    # The whole pipeline (fetch, template, verify, load in the real llama-server, tool-call probe,
    # re-check) on two machines with their own probe files and homes, from nginx serving the read-only
    # mirror: 0 requests upstream.
    from tests.e2e_support import SMALL, build_world, write_probe
    from tests.gguf_fixtures import require_llama_server
    from tests.test_auto_e2e import ROOMY_FREE_BYTES
    from tests.test_auto_e2e import cmd as auto_cmd
    from tests.test_auto_e2e import env_for as auto_env

    require_llama_server()
    world = build_world(tmp_path / "world", local_hub, pin_template=True)
    mirror = tmp_path / "mirror"
    out = hotfit(tmp_path / "filler", "--json", "fleet", "mirror", str(mirror), *world.entries,
                 "--registry", str(world.registry_path), env=env_for(local_hub))
    assert out.returncode == 0, out.stderr[-3000:]
    for p in [mirror, *mirror.rglob("*")]:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    nginx = Nginx(mirror, tmp_path / "nginx")
    try:
        upstream = len(local_hub.requests)
        env = {**auto_env(local_hub), "HF_ENDPOINT": nginx.url}
        for i, free in enumerate((ROOMY_FREE_BYTES, ROOMY_FREE_BYTES - (1 << 30))):
            probe = write_probe(tmp_path / f"probe{i}.json", free)
            done = subprocess.run(auto_cmd(tmp_path / f"home{i}", world, probe, "--json", "--model", SMALL),
                                  cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr[-3000:]
            assert json.loads(done.stdout)["entry_name"] == SMALL
        assert len(local_hub.requests) == upstream
    finally:
        nginx.stop()
        for p in [mirror, *mirror.rglob("*")]:
            p.chmod(p.stat().st_mode | stat.S_IWUSR)


def test_a_locked_registry_provisions_its_template_from_the_static_mirror_and_refuses_other_bytes(
        local_hub: LocalHub, world: dict[str, Any], tmp_path: Path) -> None:
    # `registry lock` pins the template (by commit alone in the world's registry) by size and sha256:
    # the static mirror then serves it, verified; bytes that differ from the lock are refused.
    locked = tmp_path / "locked.json"
    out = hotfit(tmp_path / "locker", "--json", "registry", "lock", "--registry", str(world["registry"]),
                 "--output", str(locked), env=env_for(local_hub))
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    tpl = next(e for e in json.loads(locked.read_text())["entries"] if e["name"] == "mt-commit-only")["chat_template"]
    assert tpl["size_bytes"] == world["template_bytes"] and len(tpl["sha256"]) == 64
    mirror = tmp_path / "mirror"
    out = hotfit(tmp_path / "filler", "--json", "fleet", "mirror", str(mirror), "mt-commit-only",
                 "--registry", str(locked), env=env_for(local_hub))
    assert out.returncode == 0, out.stderr[-3000:]
    assert all(f["pinned"] for f in json.loads(out.stdout)["files"])
    nginx = Nginx(mirror, tmp_path / "nginx")
    try:
        upstream = len(local_hub.requests)
        env = {**env_for(local_hub), "HF_ENDPOINT": nginx.url}
        out = hotfit(tmp_path / "m1", "--json", "pull", "mt-commit-only", "--registry", str(locked), env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        assert sha256_of(tmp_path / "m1" / "models" / "mt-commit-only" / "chat_template.jinja") is not None
        served = resolve_path_of(mirror, tpl)
        data = served.read_bytes()
        served.write_bytes(data.replace(b"content", b"CONTENT"))  # the same size, other bytes
        out = hotfit(tmp_path / "m2", "--json", "pull", "mt-commit-only", "--registry", str(locked), env=env)
        assert out.returncode != 0
        err = json.loads(out.stdout)["error"]
        assert tpl["sha256"] in err["message"] and "chat_template.jinja" in err["message"], err
        assert not (tmp_path / "m2" / "models" / "mt-commit-only" / "chat_template.jinja").exists()
        assert len(local_hub.requests) == upstream
    finally:
        nginx.stop()


def resolve_path_of(mirror: Path, source: dict[str, Any]) -> Path:
    return mirror / source["repo"] / "resolve" / source["revision"] / source["file"]

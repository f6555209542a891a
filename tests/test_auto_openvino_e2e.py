"""End-to-end: `hotfit auto --backend openvino` as an operator runs it.

Real parts only: fixture IR models made at test time by GenAI's own GGUF reader
(tests/openvino_fixtures.py), uploaded to the local Hub (tests/hubserver.py) as OpenVINO snapshot
repositories, a registry file naming them, `hotfit` run as a subprocess with its own --home, and
the real OpenVINO GenAI pipeline in its worker process. A saved probe gives the planner a budget. ``hub`` is the module-scoped one of tests/conftest.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hotfit.planner.probe import Device, ProbeResult
from hotfit.core.entry import Artifact, Entry, TemplateSource
from tests.e2e_support import GiB, write_probe, write_registry
from tests.hubserver import LocalHub
from tests.openvino_fixtures import (
    CHATML_NO_TOOLS_TEMPLATE,
    IR_FILES,
    QWEN3_TOOLS_TEMPLATE,
    OvFixture,
    make_ov_fixture,
    ov_entry,
    require_openvino_genai,
)
from tests.test_load import process_gone

TIER = "e2e"

pytestmark = pytest.mark.openvino
REPO = Path(__file__).resolve().parent.parent
STAGES = ["probe", "plan", "fetch-weights", "fetch-template", "verify", "load", "probe-tool-call", "re-check",
          "measure-speed"]
ROOMY_FREE_BYTES = 8 * GiB
TEMPLATE_REPO = "hotfit-fixtures/ov-qwen3-template"
# The tool-capable template as the OpenVINO/*-ov repositories carry it: GenAI reads it from the
# snapshot directory before the IR's own (tokenizer_config.json, then chat_template.jinja).
IN_SNAPSHOT_TEMPLATES = {"tokenizer_config.json": json.dumps({"chat_template": QWEN3_TOOLS_TEMPLATE}).encode(),
                         "chat_template.jinja": QWEN3_TOOLS_TEMPLATE.encode()}


@dataclasses.dataclass(frozen=True)
class OvWorld:
    agent: Path  # registry files, one entry each (agent: the template in a separate repository)
    prose: Path
    damaged: Path
    in_snapshot: dict[str, Path]  # the template inside the snapshot, by file name
    entries: dict[str, Entry]


def _publish(hub: LocalHub, fx: OvFixture, name: str, template: TemplateSource | str, *,
             truncate_bin: bool = False) -> Entry:
    """``fx`` as the repository ``OpenVINO/<name>-ov``; ``template`` a source elsewhere, or the name of a
    file added to the repository itself (``tokenizer_config.json`` / ``chat_template.jinja``, holding the
    tool-capable template), the way every bundled OpenVINO entry names its template."""
    files: dict[str, Any] = {n: fx.ir_dir / n for n in IR_FILES}
    if truncate_bin:  # what the Hub serves is damaged: fetch and verify pass, the runtime refuses it
        files["openvino_model.bin"] = (fx.ir_dir / "openvino_model.bin").read_bytes()[:-4096]
    repo = f"OpenVINO/{name}-ov"
    if isinstance(template, str):
        files[template] = IN_SNAPSHOT_TEMPLATES[template]
        template = TemplateSource(repo=repo, revision=None, file=template)
    hub.create_repo(repo, files, lfs=[n for n in IR_FILES if n.endswith(".bin")])
    size = sum(len(v) if isinstance(v, bytes) else v.stat().st_size for v in files.values())
    entry = ov_entry(fx, name)
    return dataclasses.replace(entry, artifact=Artifact(repo=repo, revision=None, file=None, size_bytes=size,
                                                        sha256=None), chat_template=template)


@pytest.fixture(scope="module")
def ov_world(hub: LocalHub, tmp_path_factory: pytest.TempPathFactory) -> OvWorld:
    require_openvino_genai()
    root = tmp_path_factory.mktemp("ov-world")
    agent_ir = make_ov_fixture(root / "agent", "tool-call")
    # The export renders its own template (the IR's rt_info); the registry's tool-capable template is
    # fetched and checked beside it, as for the real entries (their tokenizer_config.json).
    prose_ir = make_ov_fixture(root / "prose", "tool-call", chat_template=CHATML_NO_TOOLS_TEMPLATE)
    commit = hub.create_repo(TEMPLATE_REPO, {"tokenizer_config.json": json.dumps(
        {"chat_template": QWEN3_TOOLS_TEMPLATE})})
    template = TemplateSource(repo=TEMPLATE_REPO, revision=commit, file="tokenizer_config.json")
    entries = {
        "fx-ov-agent": _publish(hub, agent_ir, "fx-ov-agent", template),
        "fx-ov-prose": _publish(hub, prose_ir, "fx-ov-prose", template),
        "fx-ov-damaged": _publish(hub, agent_ir, "fx-ov-damaged", template, truncate_bin=True),
        # the real layout: the template is a file of the snapshot, and the tokenizer IR's rt_info
        # carries the same text, as in an optimum-intel export (GenAI 2026.4 prefers the rt_info one)
        "fx-ov-tokcfg": _publish(hub, agent_ir, "fx-ov-tokcfg", "tokenizer_config.json"),
        "fx-ov-jinja": _publish(hub, agent_ir, "fx-ov-jinja", "chat_template.jinja"),
    }
    paths = {}
    for key in ("agent", "prose", "damaged", "tokcfg", "jinja"):
        paths[key] = root / f"registry-{key}.json"
        write_registry(paths[key], [entries[f"fx-ov-{key}"]])
    return OvWorld(agent=paths["agent"], prose=paths["prose"], damaged=paths["damaged"],
                   in_snapshot={"tokenizer_config.json": paths["tokcfg"], "chat_template.jinja": paths["jinja"]},
                   entries=entries)


def hotfit(hub: LocalHub, home: Path, *args: str, env: dict[str, str] | None = None,
           timeout: float = 300) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("HOTFIT_HOME", "HF_TOKEN", "CONTENOX_LLAMA_KV_CACHE_TYPE")}
    cmd = [sys.executable, "-m", "hotfit", "--home", str(home), "--log-format", "json", "--json", *args]
    return subprocess.run(cmd, cwd=REPO, env=base | hub.env() | (env or {}), capture_output=True, text=True, check=False,
                          timeout=timeout)


def auto(hub: LocalHub, home: Path, registry: Path, probe: Path, *args: str,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return hotfit(hub, home, "auto", "--backend", "openvino", "--registry", str(registry), "--probe-file",
                  str(probe), *args, env=env)


def events(home: Path) -> list[dict[str, Any]]:
    path = home / "logs" / "hotfit.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.exists() else []



def _worker_pids(home: Path) -> list[int]:
    return [e["pid"] for e in events(home) if e.get("event") == "openvino.start"]


@pytest.mark.parametrize(("kv", "precision", "per_token"), [("q8_0", "u8", 80), ("f16", "f16", 128)])
def test_auto_provisions_an_openvino_snapshot_end_to_end(hub: LocalHub, ov_world: OvWorld, tmp_path: Path,
                                                         kv: str, precision: str, per_token: int) -> None:
    home = tmp_path / "home"
    probe = write_probe(tmp_path / "probe.json", ROOMY_FREE_BYTES)
    done = auto(hub, home, ov_world.agent, probe, "--kv-cache-type", kv)
    assert done.returncode == 0, done.stderr[-4000:]
    manifest = json.loads(done.stdout)
    assert manifest["backend"] == "openvino" and manifest["entry_name"] == "fx-ov-agent"
    assert manifest["kv_cache_type"] == kv
    snapshot = Path(manifest["model_path"])
    assert snapshot.is_dir() and sorted(p.name for p in snapshot.iterdir()) == sorted(IR_FILES)
    # every stage ran, in order, and closed
    evs = events(home)
    run_id = manifest["run_id"]
    started = [e["stage"] for e in evs if e.get("run_id") == run_id and e["event"] == "stage.start"]
    finished = [e["stage"] for e in evs if e.get("run_id") == run_id and e["event"] == "stage.done"]
    assert started == STAGES and finished == STAGES
    # the planned window is the fixture's whole ceiling, and what OpenVINO allocated is what was planned:
    # whole 32-token blocks at the planned precision (the planner's OpenVINO price, not llama.cpp's)
    measured = manifest["measured"]
    tokens = manifest["planned_hot_context_tokens"]
    assert tokens == 65536 and measured["opened_context_tokens"] == tokens
    assert measured["kv_precision"] == precision and measured["kv_bytes_per_token"] == per_token
    assert measured["actual_kv_bytes"] == measured["estimated_kv_bytes"] == tokens * per_token
    assert measured["kv_ratio"] == 1.0 and measured["verdict"] == "pass"
    assert manifest["probe_verdict"]["passed"] is True and manifest["probe_verdict"]["tool"] == "hotfit_probe"
    ov = manifest["extra"]["openvino"]
    assert ov["genai_version"].startswith("2026.4.1") and ov["tool_call_family"] == "hermes"
    assert ov["session"]["num_kv_blocks"] == tokens // 32 and ov["session"]["kv_precision"] == precision
    # GenAI's GGUF reader (which made this export) bakes an 8192-token limit into the tokenizer: the
    # load finds it and says so; nothing longer is sent to be cut
    assert ov["prompt_max_tokens"] == 8192
    assert [e["prompt_max_tokens"] for e in evs if e.get("event") == "openvino.prompt_cap"] == [8192]
    assert [w for w in measured["warnings"] if "at most 8192 prompt tokens" in w] == measured["warnings"] != []
    assert any(e["event"] == "recheck.prompt_cap" for e in evs)
    # measure-speed read GenAI's own timings (TTFT, TPOT) of an agent prompt within that limit (less the
    # follow-up's margin), sized in this model's tokens (this toy vocabulary's tool catalogue makes it
    # 11 % long; measured), and of the follow-up turn, which GenAI evaluates whole: prefix caching is off
    speed = manifest["speed"]["measured"]
    assert speed["first_token_s"] > 0 and speed["prefill_tokens_per_s"] > 0, speed
    assert abs(speed["prompt_tokens"] / (8192 - 4096) - 1) <= 0.25 and "8192 tokens" in speed["basis"], speed
    assert speed["follow_up_prompt_tokens"] > speed["prompt_tokens"] and speed["follow_up_first_token_s"] > 0
    # cut to a quarter of the 16,384 tokens predicted: recorded, neither compared nor calibrated on
    assert "OpenVINO GenAI" in speed["basis"] and manifest["speed"]["ratio"] == {}
    assert [e["measured_prompt_tokens"] for e in evs if e.get("event") == "speed.not_compared"] == [speed["prompt_tokens"]]
    assert not (home / "speed-calibration.json").exists()
    assert ov["snapshot_commit"]
    assert manifest["backend_build"] == {}
    # nothing left running once hotfit exited
    pids = _worker_pids(home)
    assert len(pids) == 1 and process_gone(pids[0])

    again = auto(hub, home, ov_world.agent, probe, "--kv-cache-type", kv)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout).get("noop") is True
    assert [e for e in events(home) if e["event"] == "run.noop"]
    assert len(_worker_pids(home)) == 1  # the rerun opened nothing
    status = hotfit(hub, home, "status")
    assert status.returncode == 0 and json.loads(status.stdout)["provisioned"]["backend"] == "openvino"

    rechecked = auto(hub, home, ov_world.agent, probe, "--kv-cache-type", kv, "--recheck")
    assert rechecked.returncode == 0, rechecked.stderr[-3000:]
    assert json.loads(rechecked.stdout)["measured"]["actual_kv_bytes"] == tokens * per_token
    pids = _worker_pids(home)
    assert len(pids) == 2 and all(process_gone(p) for p in pids)  # opened again, and closed again


@pytest.mark.parametrize("template_file", sorted(IN_SNAPSHOT_TEMPLATES))
def test_auto_provisions_a_snapshot_whose_template_is_one_of_its_files(hub: LocalHub, ov_world: OvWorld,
                                                                       tmp_path: Path, template_file: str) -> None:
    # The layout of every bundled OpenVINO entry: chat_template names a file of the artifact's own repository.
    home = tmp_path / "home"
    probe = write_probe(tmp_path / "probe.json", ROOMY_FREE_BYTES)
    hub.reset_counters()
    done = auto(hub, home, ov_world.in_snapshot[template_file], probe, "--kv-cache-type", "q8_0")
    assert done.returncode == 0, done.stderr[-4000:]
    manifest = json.loads(done.stdout)
    name = manifest["entry_name"]
    repo = ov_world.entries[name].artifact.repo
    snapshot = Path(manifest["model_path"])
    # verify placed the whole snapshot, the template's source among its files, as the Hub serves it
    assert sorted(p.name for p in snapshot.iterdir()) == sorted([*IR_FILES, template_file])
    assert (snapshot / template_file).read_bytes() == IN_SNAPSHOT_TEMPLATES[template_file]
    # read from the file fetch-weights brought: the Hub served it once, at the snapshot's commit
    served = hub.requests_for(file=template_file, method="GET")
    assert len(served) == 1 and served[0].repo_id == repo
    written = [e for e in events(home) if e.get("event") == "template.written"]
    commit = manifest["extra"]["openvino"]["snapshot_commit"]
    assert [(e["from_snapshot"], e["source"]) for e in written] == [(True, f"{repo}@{commit}/{template_file}")]
    assert Path(manifest["template_path"]).read_text() == QWEN3_TOOLS_TEMPLATE
    # through load, the tool probe and the re-check
    run_id = manifest["run_id"]
    finished = [e["stage"] for e in events(home) if e.get("run_id") == run_id and e["event"] == "stage.done"]
    assert finished == STAGES
    assert manifest["probe_verdict"]["passed"] is True and manifest["probe_verdict"]["tool"] == "hotfit_probe"
    assert manifest["extra"]["openvino"]["tool_call_family"] == "hermes"
    measured = manifest["measured"]
    assert measured["verdict"] == "pass" and measured["actual_kv_bytes"] == measured["estimated_kv_bytes"]
    # a rerun is a no-op: nothing downloaded, nothing opened
    hub.reset_counters()
    again = auto(hub, home, ov_world.in_snapshot[template_file], probe, "--kv-cache-type", "q8_0")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout).get("noop") is True
    assert hub.requests_for(method="GET") == []
    assert len(_worker_pids(home)) == 1 and all(process_gone(p) for p in _worker_pids(home))


def test_pull_then_auto_serve_and_status_use_the_verified_snapshot(hub: LocalHub, ov_world: OvWorld,
                                                                  tmp_path: Path) -> None:
    home = tmp_path / "home"
    registry = ov_world.in_snapshot["tokenizer_config.json"]
    repo = ov_world.entries["fx-ov-tokcfg"].artifact.repo
    hub.reset_counters()
    pulled = hotfit(hub, home, "pull", "fx-ov-tokcfg", "--registry", str(registry))
    assert pulled.returncode == 0, pulled.stderr[-3000:]
    result = json.loads(pulled.stdout)
    snapshot = home / "models" / "fx-ov-tokcfg" / "snapshot"
    commit = result["fetch"]["snapshot"]["commit"]
    assert result["verify"]["weights_path"] == str(snapshot) and result["verify"]["files_checked"] == len(IR_FILES) + 1
    assert sorted(p.name for p in snapshot.iterdir()) == sorted([*IR_FILES, "tokenizer_config.json"])
    assert result["template"]["source"] == f"{repo}@{commit}/tokenizer_config.json"
    assert len(hub.requests_for(file="tokenizer_config.json", method="GET")) == 1
    # a second pull downloads nothing, and says where the template came from
    hub.reset_counters()
    again = subprocess.run([sys.executable, "-m", "hotfit", "--home", str(home), "pull", "fx-ov-tokcfg",
                            "--registry", str(registry)], cwd=REPO, capture_output=True, text=True, check=False,
                           env=os.environ | hub.env())
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"snapshot  {snapshot} at {commit}" in again.stdout
    assert "read from the snapshot's tokenizer_config.json" in again.stdout
    assert [r for r in hub.requests_for(method="GET") if r.file] == []
    # nothing is provisioned by a pull: serve says to run auto
    refused = hotfit(hub, home, "serve", "--print-command")
    assert refused.returncode == 2 and "hotfit auto" in json.loads(refused.stdout)["error"]["hint"]
    # auto provisions the pulled snapshot without downloading it again
    hub.reset_counters()
    probe = write_probe(tmp_path / "probe.json", ROOMY_FREE_BYTES)
    done = auto(hub, home, registry, probe, "--kv-cache-type", "q8_0")
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads(done.stdout)
    assert manifest["model_path"] == str(snapshot) and manifest["extra"]["openvino"]["snapshot_commit"] == commit
    assert [r for r in hub.requests_for(method="GET") if r.file] == []  # only the listing: no file fetched again
    fetched = [e for e in events(home) if e.get("event") == "fetch.snapshot_done" and e.get("run_id")]
    assert fetched[-1]["bytes_transferred"] == 0 and fetched[-1]["files_already_present"] == len(IR_FILES) + 1
    printed = hotfit(hub, home, "serve", "--print-command")
    assert printed.returncode == 0, printed.stderr
    argv = json.loads(printed.stdout)["argv"]
    assert dict(zip(argv[1::2], argv[2::2]))["--model_path"] == str(snapshot)
    status = hotfit(hub, home, "status")
    assert status.returncode == 0
    shown = json.loads(status.stdout)
    assert shown["provisioned"]["model_path"] == str(snapshot) and shown["provisioned"]["backend"] == "openvino"
    assert shown["provisioned_problems"] == []
    human = subprocess.run([sys.executable, "-m", "hotfit", "--home", str(home), "status"], cwd=REPO,
                           capture_output=True, text=True, check=False, env=os.environ | hub.env())
    assert "provisioned: fx-ov-tokcfg (q8_0 KV" in human.stdout and f"→ {snapshot}" in human.stdout
    # the human summary (a no-op rerun) carries the re-check's warning: the tokenizer's prompt limit
    rerun = subprocess.run([sys.executable, "-m", "hotfit", "--home", str(home), "auto", "--backend", "openvino",
                            "--registry", str(registry), "--probe-file", str(probe), "--kv-cache-type", "q8_0"],
                           cwd=REPO, capture_output=True, text=True, check=False, env=os.environ | hub.env())
    assert rerun.returncode == 0 and "already provisioned" in rerun.stdout, rerun.stderr[-3000:]
    assert "  WARNING         the export's tokenizer passes at most 8192 prompt tokens" in rerun.stdout


def test_serve_prints_the_ovms_command_and_refuses_to_exec(hub: LocalHub, ov_world: OvWorld, tmp_path: Path) -> None:
    home = tmp_path / "home"
    probe = write_probe(tmp_path / "probe.json", ROOMY_FREE_BYTES)
    assert auto(hub, home, ov_world.agent, probe, "--kv-cache-type", "q8_0").returncode == 0
    manifest = json.loads((home / "manifest.json").read_text())
    printed = hotfit(hub, home, "serve", "--print-command", "--port", "9001")
    assert printed.returncode == 0, printed.stderr
    argv = json.loads(printed.stdout)["argv"]
    assert argv[0] == "ovms"
    opt = dict(zip(argv[1::2], argv[2::2]))
    assert opt["--model_path"] == manifest["model_path"] and opt["--model_name"] == "fx-ov-agent"
    assert opt["--target_device"] == "CPU" and opt["--max_num_seqs"] == "1" and opt["--rest_port"] == "9001"
    assert opt["--tool_parser"] == "hermes3" and opt["--task"] == "text_generation"
    assert opt["--cache_size"] == "1"  # 5 MiB of verified KV: OVMS takes whole GB, rounded up
    refused = hotfit(hub, home, "serve")
    assert refused.returncode == 2
    err = json.loads(refused.stdout)["error"]
    assert "OpenVINO model" in err["message"] and "OpenVINO Model Server" in err["hint"]
    assert "ovms --rest_bind_address" in err["hint"]


def test_a_template_that_cannot_express_tools_fails_the_probe(hub: LocalHub, ov_world: OvWorld,
                                                              tmp_path: Path) -> None:
    home = tmp_path / "home"
    probe = write_probe(tmp_path / "probe.json", ROOMY_FREE_BYTES)
    failed = auto(hub, home, ov_world.prose, probe)
    assert failed.returncode == 5, failed.stderr[-3000:]
    err = json.loads(failed.stdout)["error"]
    assert err["code"] == "tool_call_probe" and "cannot express tools" in err["message"]
    assert err["details"]["cause"] == "prose" and err["details"]["backend"] == "openvino"
    assert not (home / "manifest.json").exists()
    assert [p for p in _worker_pids(home) if not process_gone(p)] == []


def test_a_damaged_ir_is_refused_at_load(hub: LocalHub, ov_world: OvWorld, tmp_path: Path) -> None:
    home = tmp_path / "home"
    probe = write_probe(tmp_path / "probe.json", ROOMY_FREE_BYTES)
    failed = auto(hub, home, ov_world.damaged, probe)
    assert failed.returncode == 5, failed.stderr[-3000:]
    err = json.loads(failed.stdout)["error"]
    assert err["code"] == "load" and err["details"]["cause"] == "damaged_ir", err
    assert "could not open" in err["message"] and "re-fetch" in err["hint"]
    assert not (home / "manifest.json").exists()
    assert [p for p in _worker_pids(home) if not process_gone(p)] == []


def test_a_non_cpu_plan_is_refused_before_download(hub: LocalHub, ov_world: OvWorld, tmp_path: Path) -> None:
    home = tmp_path / "home"
    probe = tmp_path / "probe.json"
    gpu = Device(index=0, kind="nvidia", name="fixture GPU", total_bytes=24 * GiB, free_bytes=20 * GiB)
    probe.write_text(json.dumps(ProbeResult(devices=(gpu,)).to_json()))
    failed = auto(hub, home, ov_world.agent, probe)
    # The planner plans only devices OpenVINO serves: a probe with none of them is refused there.
    assert failed.returncode == 2, failed.stderr[-3000:]
    err = json.loads(failed.stdout)["error"]
    assert err["code"] == "usage" and "openvino backend cannot run a model on [0] nvidia" in err["message"]
    assert "--device cpu" in err["hint"]
    assert not (home / "models").exists()


def test_a_missing_openvino_extra_is_refused_before_download(hub: LocalHub, ov_world: OvWorld,
                                                              tmp_path: Path) -> None:
    # sitecustomize hides the installed package (sys.modules[name] = None: find_spec answers None)
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['openvino_genai'] = None\n")
    home = tmp_path / "home"
    probe = write_probe(tmp_path / "probe.json", ROOMY_FREE_BYTES)
    failed = auto(hub, home, ov_world.agent, probe, env={"PYTHONPATH": f"{hide}{os.pathsep}{REPO}"})
    assert failed.returncode == 5, failed.stderr[-3000:]
    err = json.loads(failed.stdout)["error"]
    assert err["code"] == "backend_not_found" and "openvino-genai" in err["message"]
    assert 'pip install -e ".[openvino]"' in err["hint"]
    assert not (home / "models").exists()


def test_auto_provisions_a_locked_snapshot_from_a_static_mirror_with_0_upstream_requests(
        hub: LocalHub, ov_world: OvWorld, tmp_path: Path) -> None:
    # The real layout (the template a file of the snapshot) locked by `hotfit registry lock`, filled
    # into a mirror by `hotfit fleet mirror`, served read-only by Debian's nginx; `hotfit auto` loads
    # the real export from it and passes the tool-call probe with 0 requests to the upstream Hub
    # (docs/fleet.md, "OpenVINO snapshots").
    import stat

    from tests.test_fleet_mirror import Nginx

    locked = tmp_path / "locked.json"
    done = hotfit(hub, tmp_path / "locker", "registry", "lock", "--registry",
                  str(ov_world.in_snapshot["tokenizer_config.json"]), "--output", str(locked))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    mirror = tmp_path / "mirror"
    done = hotfit(hub, tmp_path / "filler", "fleet", "mirror", str(mirror), "fx-ov-tokcfg", "--registry", str(locked))
    assert done.returncode == 0, done.stderr[-3000:]
    assert [(f["role"], f["status"]) for f in json.loads(done.stdout)["files"]] == [("snapshot", "fetched")]
    for p in [mirror, *mirror.rglob("*")]:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    nginx = Nginx(mirror, tmp_path / "nginx")
    try:
        upstream = len(hub.requests)
        probe = write_probe(tmp_path / "probe.json", ROOMY_FREE_BYTES)
        done = auto(hub, tmp_path / "home", locked, probe, env={"HF_ENDPOINT": nginx.url})
        assert done.returncode == 0, done.stderr[-4000:]
        manifest = json.loads(done.stdout)
        assert manifest["entry_name"] == "fx-ov-tokcfg" and manifest["probe_verdict"]["passed"] is True
        assert manifest["extra"]["openvino"]["snapshot_commit"] == json.loads(locked.read_text())["entries"][0][
            "artifact"]["revision"]
        assert len(hub.requests) == upstream
        assert any("/api/models/OpenVINO/fx-ov-tokcfg-ov/tree/" in line for line in nginx.requests())
    finally:
        nginx.stop()
        for p in [mirror, *mirror.rglob("*")]:
            p.chmod(p.stat().st_mode | stat.S_IWUSR)

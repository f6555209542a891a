"""``hotfit fleet plan``: each saved probe planned exactly as ``hotfit plan --probe-file`` plans it,
a damaged or foreign probe reported for its machine alone, and what the fleet needs once — the
artifacts (each counted once) and the builds (CUDA architectures united). Saved probes are the
fixtures here: the format ``hotfit probe --save`` writes (docs/fleet.md)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import pytest

from hotfit.pipeline.cli import main
from tests.entries import GiB

TIER = "unit"


@pytest.fixture(autouse=True)
def _home(hotfit_home: Path) -> None:
    """Every test here runs with its own HOTFIT_HOME (the CLI writes its event log there)."""


def saved_probe(path: Path, devices: Sequence[tuple[str, str, int, int, str | None]], *, name: str | None = None,
                arch: str | None = "x86_64") -> Path:
    """A probe file as ``hotfit probe --save`` writes it; ``devices``: (kind, name, total, free, capability)."""
    doc: dict[str, Any] = {
        "schema": 1, "selected": len(devices) - 1, "notes": [],
        "devices": [{"index": i, "kind": k, "name": n, "total_bytes": t, "free_bytes": f, "compute_capability": c}
                    for i, (k, n, t, f, c) in enumerate(devices)]}
    if name is not None or arch is not None:
        doc["machine"] = {"name": name, "arch": arch}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


HOST_8 = ("cpu", "host memory", 8 * GiB, 6 * GiB, None)


def fleet_dir(tmp_path: Path) -> Path:
    d = tmp_path / "probes"
    saved_probe(d / "a.json", [HOST_8, ("nvidia", "NVIDIA L4", 24 * GiB, 23 * GiB, "8.9")], name="gpu-l4")
    saved_probe(d / "b.json", [HOST_8, ("nvidia", "Tesla T4", 16 * GiB, 15 * GiB, "7.5")], name="gpu-t4")
    saved_probe(d / "c.json", [HOST_8, ("nvidia", "Tesla T4", 16 * GiB, 15 * GiB, "7.5")], name="gpu-t4-2")
    saved_probe(d / "d.json", [("cpu", "host memory", 32 * GiB, 30 * GiB, None)], name="arm-1", arch="aarch64")
    saved_probe(d / "e.json", [HOST_8, ("vulkan", "Intel Arc B580", 12 * GiB, 12 * GiB, None)], name="arc")
    saved_probe(d / "tiny.json", [("cpu", "host memory", 4 * GiB, 2 * GiB, None)], name=None, arch=None)
    (d / "cut.json").write_text('{"schema": 1, "devices": [')  # damaged: cut off mid-write
    (d / "foreign.json").write_text(json.dumps({"name": "some-package", "version": "1.0"}))
    return d


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    rc = main(list(argv), out=out)
    return rc, out.getvalue()


def fleet_json(*argv: str) -> tuple[int, dict[str, Any]]:
    rc, text = run("--json", "fleet", "plan", *argv)
    return rc, json.loads(text)


@pytest.mark.parametrize("options", [(), ("--kv-cache-type", "q8_0"), ("--origin", "eu"),
                                     ("--previous", "minicpm5-2b"),
                                     # the speed options are selection options too (registry/speed.py)
                                     ("--agent-prompt-tokens", "4096", "--max-first-token-s", "30"),
                                     ("--min-decode-tokens-per-s", "20"), ("--min-context", "65536")])
def test_each_machine_gets_the_plan_hotfit_plan_gives_it(tmp_path: Path, options: tuple[str, ...]) -> None:
    d = fleet_dir(tmp_path)
    _rc, fleet = fleet_json(str(d), *options)
    by_file = {m["probe_file"]: m for m in fleet["machines"]}
    compared = 0
    for path in sorted(d.glob("*.json")):
        rc, text = run("--json", "plan", "--probe-file", str(path), *options)
        alone = json.loads(text)
        m = by_file[str(path)]
        if "error" in alone and "selected" not in alone:  # the probe itself is unusable
            assert m["status"] == "error" and m["error"]["code"] == alone["error"]["code"] and rc == 2
            continue
        compared += 1
        selected = alone["selected"]
        assert m["model"] == (selected and selected["name"]), path.name
        assert m["plan_id"] == (selected and selected["plan_id"])
        assert m["hot_context_tokens"] == (selected and selected["hot_context"])
        predicted = selected and selected["speed"]["predicted"]
        fleet_predicted = m["speed_predicted"] and {k: v for k, v in m["speed_predicted"].items() if k != "warning"}
        assert fleet_predicted == predicted
        assert m["kv_cache_type"] == alone["kv_cache_type"]
        assert m["device"]["index"] == alone["device"]["index"]
        assert m["status"] == ("planned" if selected else "refused")
        if not selected:
            assert m["refusal"] == alone["error"] and m["reason"] == alone["error"]["message"].splitlines()[0]
    assert compared == 6


def test_the_speed_options_reach_every_machine_and_its_predicted_speed_is_shown(tmp_path: Path) -> None:
    d = fleet_dir(tmp_path)
    _rc, fleet = fleet_json(str(d))
    planned = [m for m in fleet["machines"] if m["status"] == "planned"]
    assert planned and all(m["speed_predicted"]["prompt_tokens"] == 16384 for m in planned)
    gpu = next(m for m in planned if m["name"] == "gpu-l4")
    _rc, text = run("fleet", "plan", str(d))
    row = next(line for line in text.splitlines() if line.startswith("gpu-l4 "))
    assert f"{gpu['speed_predicted']['decode_tokens_per_s']:.1f}" in row.split()
    _rc, table = run("fleet", "plan", str(d), "--csv", "machines")
    rows = {r["machine"]: r for r in csv.DictReader(io.StringIO(table))}
    assert float(rows["gpu-l4"]["first_token_s"]) == gpu["speed_predicted"]["first_token_s"]
    # a floor no machine can meet refuses each machine with the floor's refusal, naming the fastest
    _rc, floored = fleet_json(str(d), "--min-decode-tokens-per-s", "100000")
    read = [m for m in floored["machines"] if m["status"] != "error"]
    assert read and all(m["status"] == "refused" for m in read)
    assert any("--min-decode-tokens-per-s" in m["reason"] for m in read)
    _rc, short = fleet_json(str(d), "--agent-prompt-tokens", "2048")
    assert {m["speed_predicted"]["prompt_tokens"] for m in short["machines"] if m["status"] == "planned"} == {2048}


def test_a_damaged_or_foreign_probe_is_that_machines_error_and_the_rest_are_planned(tmp_path: Path) -> None:
    rc, fleet = fleet_json(str(fleet_dir(tmp_path)))
    machines = {m["name"]: m for m in fleet["machines"]}
    assert machines["cut"]["status"] == "error" and "not JSON" in machines["cut"]["reason"]
    assert machines["foreign"]["status"] == "error" and "schema is missing" in machines["foreign"]["reason"]
    assert {m["status"] for n, m in machines.items() if n not in ("cut", "foreign", "tiny")} == {"planned"}
    assert machines["tiny"]["status"] == "refused"  # named by its file: its probe names no machine
    assert fleet["summary"]["errors"] == 2
    assert fleet["summary"]["planned"] == 5 and fleet["summary"]["refused"] == 1
    assert rc == 2  # an unreadable probe is a usage error, reported after every machine was planned


def test_exit_code_is_the_refusals_when_every_probe_reads(tmp_path: Path) -> None:
    d = tmp_path / "p"
    saved_probe(d / "ok.json", [("cpu", "host memory", 32 * GiB, 30 * GiB, None)], name="ok")
    assert fleet_json(str(d))[0] == 0
    saved_probe(d / "tiny.json", [("cpu", "host memory", 4 * GiB, 2 * GiB, None)], name="tiny")
    assert fleet_json(str(d))[0] == 3


def test_artifacts_are_listed_once_with_the_bytes_counted_once(tmp_path: Path) -> None:
    _rc, fleet = fleet_json(str(fleet_dir(tmp_path)))
    planned = [m for m in fleet["machines"] if m["status"] == "planned"]
    arts = fleet["artifacts"]
    keys = [(a["repo"], a["revision"], a["file"]) for a in arts]
    assert len(keys) == len(set(keys))
    per_model: dict[str, int] = {}
    for m in planned:
        per_model[m["model"]] = per_model.get(m["model"], 0) + 1
    assert fleet["summary"]["per_model"] == dict(sorted(per_model.items(), key=lambda kv: (-kv[1], kv[0])))
    shared = [a for a in arts if a["role"] == "weights" and a["machines"] > 1]
    assert shared, "two T4 machines pick the same model: its weights are needed by both, listed once"
    assert sum(a["machines"] for a in arts if a["role"] == "weights") == len(planned)
    assert fleet["summary"]["mirror_bytes"] == sum(a["size_bytes"] or 0 for a in arts)
    assert all(a["size_bytes"] is not None for a in arts if a["role"] == "weights")


def test_builds_unite_cuda_architectures_and_name_aarch64_and_vulkan(tmp_path: Path) -> None:
    _rc, fleet = fleet_json(str(fleet_dir(tmp_path)))
    machines = {m["name"]: m for m in fleet["machines"]}
    builds = {b["flavour"]: b for b in fleet["builds"]}
    for n in ("gpu-l4", "gpu-t4", "gpu-t4-2"):  # the GPU outplans the 6 GiB host on each
        assert machines[n]["device"]["kind"] == "nvidia" and machines[n]["build"] == "cuda"
    assert builds["cuda"]["cuda_architectures"] == ["75", "89"] and builds["cuda"]["machines"] == 3
    assert builds["cuda"]["export_command"].startswith('HOTFIT_CUDA_ARCHS="75;89" ')
    assert machines["arm-1"]["build"] == "cpu-aarch64"
    assert "--arch aarch64" in builds["cpu-aarch64"]["export_command"]
    assert builds["cpu-aarch64"]["arch"] == "aarch64"
    assert machines["arc"]["device"]["kind"] == "vulkan" and machines["arc"]["build"] == "vulkan"
    assert "--backend vulkan" in builds["vulkan"]["export_command"]
    assert sum(b["machines"] for b in fleet["builds"]) == fleet["summary"]["planned"]


def test_cuda_union_over_several_generations(tmp_path: Path) -> None:
    d = tmp_path / "gpus"
    small_host = ("cpu", "host memory", 4 * GiB, 3 * GiB, None)
    for cap in ("7.5", "8.6", "8.9", "9.0", "8.9"):
        saved_probe(d / f"{cap}-{len(list(d.glob('*'))) if d.exists() else 0}.json",
                    [small_host, ("nvidia", f"GPU {cap}", 24 * GiB, 23 * GiB, cap)], name=None)
    saved_probe(d / "nocap.json", [small_host, ("nvidia", "GPU ?", 24 * GiB, 23 * GiB, None)])
    _rc, fleet = fleet_json(str(d))
    (cuda,) = fleet["builds"]
    assert cuda["flavour"] == "cuda" and cuda["machines"] == 6
    assert cuda["cuda_architectures"] == ["75", "86", "89", "90"]
    assert cuda["unknown_capability_machines"] == 1
    rc, text = run("fleet", "plan", str(d))
    assert 'HOTFIT_CUDA_ARCHS="75;86;89;90" scripts/install-llama-server --backend cuda --export' in text
    assert "1 machine recorded no compute capability" in text


def test_machine_names_come_from_the_probe_else_the_file_and_stay_distinct(tmp_path: Path) -> None:
    d = tmp_path / "p"
    host = [("cpu", "host memory", 32 * GiB, 30 * GiB, None)]
    saved_probe(d / "x.json", host, name="clone")
    saved_probe(d / "y.json", host, name="clone")  # a cloned image: the same host name twice
    saved_probe(d / "z.json", host, name=None)
    _rc, fleet = fleet_json(str(d / "x.json"), str(d / "y.json"), str(d / "z.json"))
    assert [m["name"] for m in fleet["machines"]] == ["clone", "clone (y.json)", "z"]


def test_text_and_csv(tmp_path: Path) -> None:
    d = fleet_dir(tmp_path)
    _rc, fleet = fleet_json(str(d))
    rc, text = run("fleet", "plan", str(d))
    assert rc == 2
    for m in fleet["machines"]:
        assert m["name"] in text
    assert "mirror:" in text and "builds to make:" in text and "not JSON" in text
    rc, table = run("fleet", "plan", str(d), "--csv", "machines")
    rows = list(csv.DictReader(io.StringIO(table)))
    assert [r["machine"] for r in rows] == [m["name"] for m in fleet["machines"]]
    assert [r["status"] for r in rows] == [m["status"] for m in fleet["machines"]]
    rc, table = run("fleet", "plan", str(d), "--csv", "artifacts")
    rows = list(csv.DictReader(io.StringIO(table)))
    assert [(r["repo"], r["file"]) for r in rows] == [(a["repo"], a["file"]) for a in fleet["artifacts"]]
    rc, table = run("fleet", "plan", str(d), "--csv", "builds")
    assert [r["flavour"] for r in csv.DictReader(io.StringIO(table))] == [b["flavour"] for b in fleet["builds"]]


def test_a_missing_path_or_an_empty_inventory_is_a_usage_error(tmp_path: Path) -> None:
    rc, fleet = fleet_json(str(tmp_path / "nowhere"))
    assert rc == 2 and "does not exist" in fleet["error"]["message"]
    (tmp_path / "empty").mkdir()
    rc, fleet = fleet_json(str(tmp_path / "empty"))
    assert rc == 2 and "no probe files" in fleet["error"]["message"]


def test_a_damaged_manifest_is_that_machines_error(tmp_path: Path) -> None:
    d = tmp_path / "p"
    host = [("cpu", "host memory", 32 * GiB, 30 * GiB, None)]
    saved_probe(d / "a.json", host, name="a")
    saved_probe(d / "b.json", host, name="b")
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    (manifests / "a.json").write_text("{not json")
    rc, fleet = fleet_json(str(d), "--manifests", str(manifests))
    a, b = fleet["machines"]
    assert a["status"] == "error" and "manifest" in a["reason"] and b["status"] == "planned"


@pytest.mark.integration
def test_probe_save_names_the_machine(tmp_path: Path) -> None:
    import platform
    import socket

    path = tmp_path / "me.json"
    rc, _ = run("probe", "--save", str(path))
    assert rc == 0
    doc = json.loads(path.read_text())
    assert doc["machine"] == {"name": socket.gethostname(), "arch": platform.machine()}
    _rc, fleet = fleet_json(str(path))
    assert fleet["machines"][0]["name"] == socket.gethostname()


def test_a_saved_manifest_keeps_that_machines_previous_model(tmp_path: Path) -> None:
    from hotfit.pipeline.manifest import Manifest, write_manifest
    from hotfit.pipeline.registry_file import load_registry
    from hotfit.registry.kv import KV_CACHE_TYPES
    from hotfit.stages.plan import build_plan
    from hotfit.stages.probe import load_probe_file

    d = tmp_path / "p"
    host = [("cpu", "host memory", 32 * GiB, 30 * GiB, None)]
    saved_probe(d / "a.json", host, name="a")
    saved_probe(d / "b.json", host, name="b")
    _rc, before = fleet_json(str(d))
    best = before["machines"][0]["model"]
    small = next(e for e in load_registry().entries if e.name == "minicpm5-2b")
    assert best != small.name
    plan = build_plan(load_probe_file(d / "a.json"), [small], KV_CACHE_TYPES["f16"]).plan
    assert plan is not None
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    write_manifest(manifests / "a.json", Manifest(
        run_id="r1", plan_id=plan.plan_id, written_at="2026-12-01T00:00:00Z", entry_name=small.name,
        model_path="/x", model_size_bytes=1, model_sha256="0" * 64, template_path=None, projector_path=None,
        kv_cache_type="f16", planned_hot_context_tokens=plan.hot_context_tokens, measured={}, probe_verdict={},
        backend_build={}, device={}, plan=plan.to_json()))
    _rc, fleet = fleet_json(str(d), "--manifests", str(manifests))
    a, b = fleet["machines"]
    assert a["model"] == small.name and a["reused_previous"] and a["previous_from"] == str(manifests / "a.json")
    assert b["model"] == best and not b["reused_previous"]  # no manifest: planned afresh


def test_an_openvino_pick_lists_its_snapshot_once_with_its_template_and_pinned_once_locked(tmp_path: Path) -> None:
    # Three CPU machines planned for OpenVINO: the mirror holds the whole repository once (its size
    # counted once); the template, a file of that snapshot, is not a second artifact. Pinned (what a
    # static mirror serves) only once `registry lock` gave it a commit and its file list's sha256:
    # the values below stand in for the lock's (tests/test_fleet_mirror_openvino.py runs it).
    from hotfit.pipeline.registry_file import bundled_registry_path

    for i in range(3):
        saved_probe(tmp_path / "probes" / f"m{i}.json", [("cpu", "host memory", 32 * GiB, (30 - i) * GiB, None)],
                    name=f"m{i}")
    doc = json.loads(bundled_registry_path().read_text(encoding="utf-8"))
    for locked in (False, True):
        for e in doc["entries"]:
            if e["backend"] == "openvino" and locked:
                e["artifact"].update(revision="a" * 40, sha256="b" * 64)
                e["chat_template"]["revision"] = "a" * 40
        registry = tmp_path / f"registry-{locked}.json"
        registry.write_text(json.dumps(doc))
        rc, fleet = fleet_json(str(tmp_path / "probes"), "--backend", "openvino", "--registry", str(registry))
        assert rc == 0, fleet
        [art] = fleet["artifacts"]
        models = {m["model"] for m in fleet["machines"]}
        assert (art["role"], art["file"], art["machines"], art["entries"]) == ("snapshot", None, 3, sorted(models))
        assert art["pinned"] is locked and fleet["summary"]["mirror_bytes"] == art["size_bytes"] > 0

"""The hardware matrix: each real machine under tests/data/hardware (captured files, their public
source in SOURCE.md) drives what ``scripts/install-llama-server --detect`` picks, the ISA verdict for
the native build of this project's build machine and what ``hotfit probe`` reports, each against the
row's expected.json, and holds what ``hotfit plan`` picks with the bundled registry, for both
backends, to the spec's rules (a curation change moves picks, not rules). Machines the matrix does
not cover get a message, never a traceback.
docs/hardware-matrix.md describes the rows."""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from hotfit.backends.llama_server.discovery import BuildInfo, ServerBinary, check_cpu_features
from hotfit.backends.select import backend_for
from hotfit.core.errors import BackendError
from hotfit.core.isa import cpu_feature_names, cpuinfo_flags, features_from_macros, ggml_cpu_variant
from hotfit.planner.probe import ProbeResult
from hotfit.pipeline.cli import main
from hotfit.pipeline.cli.render import probe_text as describe
from hotfit.pipeline.registry_file import bundled_registry_path
from hotfit.stages.probe import probe_devices, save_probe
from tests.hardware_matrix import (
    BUILD_MACHINE,
    MATRIX,
    Row,
    facts_from_exporter_capture,
    facts_from_xml,
    machine_root,
    nvidia_smi_standin,
    nvml_from,
    rows,
)

TIER = "unit"

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "install-llama-server"
ROWS = rows()
ROW_IDS = [r.machine for r in ROWS]


@pytest.fixture(autouse=True)
def _home(hotfit_home: Path) -> None:
    """Each test has its own HOTFIT_HOME (the CLI writes its event log there)."""


# ----------------------------------------------------------------------------- what each row drives


def detect(root: Path, bin_dir: Path | None = None) -> tuple[str, str]:
    path = f"{bin_dir}:/usr/bin:/bin" if bin_dir is not None else "/usr/bin:/bin"
    env = {**os.environ, "HOTFIT_DETECT_ROOT": str(root), "PATH": path}
    proc = subprocess.run([str(SCRIPT), "--detect"], capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    backend, why = proc.stdout.rstrip("\n").split("\t")
    return backend, why


def row_detect(row: Row, tmp: Path) -> tuple[str, str]:
    root = machine_root(row, tmp)
    bin_dir = None
    if row.file("nvml.json"):
        bin_dir = tmp / "bin"
        nvidia_smi_standin(bin_dir, row.folder / "nvml.json")
    return detect(root, bin_dir)


def build_machine_binary() -> ServerBinary:
    """The native llama-server built on the build machine, as its build-info.json records it."""
    macros = (MATRIX / BUILD_MACHINE / "gcc-march-native-macros.txt").read_text()
    build = BuildInfo("build-info.json", None, None, None, backend="cpu", variant="native",
                      cpu_features=tuple(features_from_macros(macros)))
    return ServerBinary(Path("/cache/llama.cpp/cpu/bin/llama-server"), "cache", build, None)


def isa_verdict(cpuinfo: str) -> dict[str, Any]:
    if not cpuinfo_flags(cpuinfo):
        return {"verdict": "not-compared", "missing": []}  # no x86 flags line (Arm64, empty /proc/cpuinfo)
    try:
        check_cpu_features(build_machine_binary(), cpuinfo)
    except BackendError as exc:
        assert "SIGILL" in exc.what and "--force" in (exc.hint or "")
        return {"verdict": "refused", "missing": exc.details["missing_features"]}
    return {"verdict": "runs", "missing": []}


def row_probe(row: Row, tmp: Path, env: dict[str, str] | None = None) -> ProbeResult:
    root = machine_root(row, tmp)
    data = row.nvml
    return probe_devices(env=env or {}, nvml=None if data is None else nvml_from(data), proc_root=root / "proc",
                         sys_root=root / "sys", cgroup_root=root / "cgroup")


def plan_json(probe: ProbeResult, tmp: Path, *args: str) -> tuple[int, dict[str, Any]]:
    path = tmp / "probe.json"
    save_probe(probe, path)
    out = io.StringIO()
    rc = main(["plan", "--json", "--probe-file", str(path), *args], out=out)
    return rc, json.loads(out.getvalue())


def probe_summary(probe: ProbeResult) -> dict[str, Any]:
    return {"devices": [{"kind": d.kind, "name": d.name, "total_bytes": d.total_bytes, "free_bytes": d.free_bytes,
                         "uuid": d.uuid, "compute_capability": d.compute_capability}
                        for d in probe.devices if d.kind != "cpu"],
            "selected_kind": probe.preferred.kind}


# ----------------------------------------------------------------------------- the matrix


def test_every_row_names_its_public_source() -> None:
    assert len(ROWS) >= 15
    for row in ROWS:
        source = (row.folder / "SOURCE.md").read_text()
        if row.machine != BUILD_MACHINE:  # the build machine is this project's own capture
            assert "https://github.com/" in source and "commit: `" in source, row.machine
        captured = [p for p in row.folder.rglob("*") if p.is_file() and p.name not in ("SOURCE.md", "expected.json")]
        assert captured, f"{row.machine}: no captured file"


@pytest.mark.integration
@pytest.mark.parametrize("row", ROWS, ids=ROW_IDS)
def test_detect_picks_the_backend(row: Row, tmp_path: Path) -> None:
    want = row.expected["detect"]
    backend, why = row_detect(row, tmp_path)
    assert backend == want["backend"], why
    assert want["why_contains"] in why


@pytest.mark.parametrize("row", ROWS, ids=ROW_IDS)
def test_isa_verdict_for_the_build_machines_native_build(row: Row) -> None:
    want = row.expected["isa"]
    cpuinfo = row.file("proc-cpuinfo.txt")
    if want is None:
        assert cpuinfo is None  # a GPU capture: its host's CPU was not published
        return
    assert cpuinfo is not None
    assert isa_verdict(cpuinfo.read_text()) == {"verdict": want["verdict"], "missing": want["missing"]}


@pytest.mark.parametrize("row", ROWS, ids=ROW_IDS)
def test_probe_reports_the_captured_devices(row: Row, tmp_path: Path) -> None:
    want = row.expected["probe"]
    probe = row_probe(row, tmp_path)
    assert probe_summary(probe) == {"devices": want["devices"], "selected_kind": want["selected_kind"]}
    text = describe(probe)
    for d in want["devices"]:
        assert d["name"] in text
        if d["compute_capability"]:
            assert f"{d['name']}: " in text and f"compute capability {d['compute_capability']}" in text
    for note in want.get("notes_contain", ()):
        assert any(note in n for n in probe.notes), probe.notes


# What hotfit plan picks on a row depends on the bundled registry's curation, which changes as models
# are added; what the tests hold it to are the spec's rules ("Selection and hot context"), read from
# the plan's own figures, so that a curation change breaks none of them and a planner that breaks a
# rule fails them (test_a_curation_change_moves_picks_and_breaks_no_rule,
# test_each_rule_catches_its_break).
RUNTIME_ALLOWANCE_FLOOR_BYTES = 256 << 20  # "the larger of one quarter of weight bytes or 256 MiB"


def _spec_order(params_total_b: float, hot_context: int) -> tuple[float, int]:
    """The spec's order among models that clear the gate: the larger one, then the larger hot
    context (the name breaks a tie of both, which no rule here depends on)."""
    return params_total_b, hot_context


def pick_problems(data: dict[str, Any], probe: dict[str, Any]) -> list[str]:
    """Every rule a successful plan (``hotfit plan --json``) breaks on the probe it was made from."""
    sel, budget, won = data["selected"], data["budget"], data["device"]["index"]
    device = next(d for d in data["devices"] if d["index"] == won)
    probed = next(d for d in probe["devices"] if d["index"] == won)
    problems = []
    # it fits the device's budget: weights, runtime allowance and KV within what the free memory leaves
    need = budget["weights_bytes"] + budget["allowance_bytes"] + budget["kv_bytes"]
    if not need <= budget["usable_bytes"] <= probed["free_bytes"]:
        problems.append(f"does not fit: needs {need} of usable {budget['usable_bytes']} (free {probed['free_bytes']})")
    if budget["allowance_bytes"] != max(-(-budget["weights_bytes"] // 4), RUNTIME_ALLOWANCE_FLOOR_BYTES):
        problems.append(f"runtime allowance {budget['allowance_bytes']} is not max(weights / 4, 256 MiB)")
    if (sel["weights_bytes"], sel["hot_context"]) != (budget["weights_bytes"], budget["hot_context_tokens"]):
        problems.append("the selected model's figures are not the budget's")
    # it clears the agentic gate
    if sel["agentic_tier"] != "agentic" or sel["hot_context"] < data["min_hot_context"]:
        problems.append(f"below the gate: {sel['agentic_tier']}, {sel['hot_context']} tokens")
    # the backend serves that device kind
    if not device["served"] or device["kind"] not in backend_for(data["backend"]).device_kinds:
        problems.append(f"planned on {device['kind']}, which the {data['backend']} backend does not serve")
    # it ranks first among the eligible on its device, and its device's pick first among the devices
    eligible = [c for c in data["candidates"] if c["verdict"] in ("qualifies", "selected")]
    first = _spec_order(sel["params_total_b"], sel["hot_context"])
    ahead = [c["name"] for c in eligible if _spec_order(c["params_total_b"], c["hot_context"]) > first]
    ahead += [f"{d['selected']} on [{d['index']}] {d['kind']}" for d in data["devices"]
              if d["considered"] and d["selected"] is not None
              and _spec_order(d["params_total_b"], d["hot_context"]) > first]
    if [c["name"] for c in eligible if c["verdict"] == "selected"] != [sel["name"]] or ahead:
        problems.append(f"{sel['name']} does not rank first: ahead of it {ahead}")
    return problems


def plan_problems(rc: int, data: dict[str, Any], probe: dict[str, Any]) -> list[str]:
    """The rules for whatever the plan answered: a pick by :func:`pick_problems`, or a refusal that
    is justified — nothing of the backend holds the floor at any budget, or the smallest agentic
    model needs more than the refused device has free."""
    if rc == 0:
        return pick_problems(data, probe)
    if rc != 3 or data["error"]["code"] != "no_model_qualifies":
        return [f"exit {rc}: {data.get('error')}"]
    smallest = data["error"]["smallest"]
    free = next(d["free_bytes"] for d in probe["devices"] if d["index"] == data["device"]["index"])
    if smallest is not None and smallest["required_free_bytes"] <= free:
        return [f"refused, though {smallest['name']} needs {smallest['required_free_bytes']} of {free} free"]
    return []


def refusal_problems(row: Row, probe: dict[str, Any], tmp: Path, *args: str) -> list[str]:
    """What is wrong with how the plan refuses when every device of ``probe`` has 64 MiB free: it must
    name the smallest agentic model and the exact memory it needs — that much free on the refused
    device plans (or, beyond its total, an empty device of the size named), one byte less still
    refuses naming the same model (so no other model needs less)."""
    def plan_with(memory: dict[int, tuple[int, int]]) -> tuple[int, dict[str, Any]]:
        changed = json.loads(json.dumps(probe))
        for d in changed["devices"]:
            d["free_bytes"], d["total_bytes"] = memory.get(d["index"], (64 << 20, d["total_bytes"]))
        path = tmp / "probe-edited.json"
        path.write_text(json.dumps(changed))
        out = io.StringIO()
        rc = main(["plan", "--json", "--probe-file", str(path), *args], out=out)
        return rc, json.loads(out.getvalue())

    rc, refused = plan_with({})
    if rc != 3 or refused["error"]["code"] != "no_model_qualifies":
        return [f"{row.machine}: 64 MiB free everywhere planned (exit {rc})"]
    smallest, device = refused["error"]["smallest"], refused["device"]["index"]
    if smallest is None:  # "no agentic model at any budget": not even every device wholly free plans
        rc, _ = plan_with({d["index"]: (d["total_bytes"], d["total_bytes"]) for d in probe["devices"]})
        return [] if rc == 3 else [f"{row.machine}: no model at any budget, yet whole devices plan (exit {rc})"]
    total = next(d["total_bytes"] for d in probe["devices"] if d["index"] == device)
    if smallest["required_free_bytes"] <= total:
        need, what = smallest["required_free_bytes"], "free"
        memory = {device: (need, total)}
        less = {device: (need - 1, total)}
    else:  # beyond the device (an APU's carve-out): the empty device of the size the refusal names
        need, what = smallest["required_device_bytes"], "device"
        memory = {device: (need, need)}
        less = {device: (need - 1, need - 1)}
    problems = []
    rc, enough = plan_with(memory)
    if rc != 0 or enough["device"]["index"] != device:
        problems.append(f"{smallest['name']}'s stated {need} bytes ({what}) do not plan (exit {rc})")
    rc, short = plan_with(less)
    if rc != 3 or short["error"]["smallest"]["name"] != smallest["name"]:
        problems.append(f"one byte less than {smallest['name']} needs ({what}) still plans (exit {rc}): "
                        "it is not the smallest")
    return problems


def plan_of_row(row: Row, tmp: Path, *args: str) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """``hotfit plan --json`` on the row's probe: exit code, the plan, the probe file it read."""
    rc, data = plan_json(row_probe(row, tmp), tmp, *args)
    return rc, data, json.loads((tmp / "probe.json").read_text())


@pytest.mark.parametrize("row", ROWS, ids=ROW_IDS)
@pytest.mark.parametrize("backend", ["llama", "openvino"])
def test_plan_picks_a_model_and_a_device_the_backend_serves(row: Row, backend: str, tmp_path: Path) -> None:
    rc, data, probe = plan_of_row(row, tmp_path, "--backend", backend)
    assert data["kv_cache_type"] == "f16" and data["backend"] == backend
    assert plan_problems(rc, data, probe) == [], data.get("device_choice")
    if backend == "openvino":  # OpenVINO serves host memory only: no GPU row plans a GPU for it
        assert all(d["selected"] is None for d in data["devices"] if d["kind"] != "cpu")
        assert all(d["served"] is (d["kind"] == "cpu") for d in data["devices"])


@pytest.mark.parametrize("row", ROWS, ids=ROW_IDS)
@pytest.mark.parametrize("backend", ["llama", "openvino"])
def test_a_row_without_room_is_refused_naming_the_smallest_agentic_model(row: Row, backend: str,
                                                                         tmp_path: Path) -> None:
    probe = plan_of_row(row, tmp_path, "--backend", backend)[2]
    assert refusal_problems(row, probe, tmp_path, "--backend", backend) == []


def _registry_without(names: set[str], path: Path) -> Path:
    data = json.loads(bundled_registry_path().read_text(encoding="utf-8"))
    data["entries"] = [e for e in data["entries"] if e["name"] not in names]
    path.write_text(json.dumps(data))
    return path


def test_a_curation_change_moves_picks_and_breaks_no_rule(tmp_path: Path) -> None:
    """The bundled registry without every model it picks on the matrix today (the curation change
    that moves the most picks: OpenVINO is then left with no model that holds the floor on 14 GiB):
    every row still answers by the rules above, where a test pinning each row's model fails on all."""
    picks = {}
    for row in ROWS:
        for backend in ("llama", "openvino"):
            rc, data, _ = plan_of_row(row, tmp_path / row.machine / backend, "--backend", backend)
            picks[row.machine, backend] = data["selected"]["name"]
    curated = _registry_without(set(picks.values()), tmp_path / "curated.json")
    moved = []
    for row in ROWS:
        for backend in ("llama", "openvino"):
            tmp = tmp_path / "changed" / row.machine / backend
            rc, data, probe = plan_of_row(row, tmp, "--backend", backend, "--registry", str(curated))
            assert plan_problems(rc, data, probe) == [], (row.machine, backend)
            assert refusal_problems(row, probe, tmp, "--backend", backend, "--registry", str(curated)) == []
            moved.append((data["selected"] or {}).get("name") != picks[row.machine, backend])
    assert all(moved)  # every row's answer changed: a test pinning them would fail 36 times


def test_each_rule_catches_its_break(tmp_path: Path) -> None:
    """The rules read from a real plan, broken one at a time as a faulty planner would: each is named."""
    row = next(r for r in ROWS if r.machine == "nvidia-a10g")
    rc, good, probe = plan_of_row(row, tmp_path, "--backend", "llama")
    assert rc == 0 and pick_problems(good, probe) == []

    def broken(change: Any) -> list[str]:
        data = json.loads(json.dumps(good))
        change(data)
        return pick_problems(data, probe)

    def smaller_pick(data: dict[str, Any]) -> None:  # a qualifying model ranked below the pick
        lower = min((c for c in data["candidates"] if c["verdict"] in ("qualifies", "selected")),
                    key=lambda c: _spec_order(c["params_total_b"], c["hot_context"]))
        data["selected"].update({k: lower[k] for k in ("name", "params_total_b", "hot_context", "weights_bytes")})
        data["budget"].update(weights_bytes=lower["weights_bytes"], hot_context_tokens=lower["hot_context"],
                              allowance_bytes=lower["allowance_bytes"])

    def no_allowance(data: dict[str, Any]) -> None:
        data["budget"]["allowance_bytes"] = 0

    def kv_past_the_budget(data: dict[str, Any]) -> None:
        data["budget"]["kv_bytes"] = data["budget"]["usable_bytes"]

    def unserved_device(data: dict[str, Any]) -> None:
        next(d for d in data["devices"] if d["index"] == data["device"]["index"])["served"] = False

    def below_the_gate(data: dict[str, Any]) -> None:
        data["selected"]["agentic_tier"] = "tool-chat"

    assert "does not rank first" in " ".join(broken(smaller_pick))
    assert "runtime allowance" in " ".join(broken(no_allowance))
    assert "does not fit" in " ".join(broken(kv_past_the_budget))
    assert "does not serve" in " ".join(broken(unserved_device))
    assert "below the gate" in " ".join(broken(below_the_gate))


@pytest.mark.integration
@pytest.mark.parametrize("row", [r for r in ROWS if r.file("proc-cpuinfo.txt")], ids=lambda r: r.machine)
def test_the_portable_build_loads_the_expected_cpu_variant(row: Row) -> None:
    """Which of the portable build's CPU variants ggml's scoring loads on this machine (core.isa),
    from the variant table the real build for the row's architecture recorded: an Arm64 row (a
    Features line, no flags) against the cross-built cpu-aarch64 (tests/test_arm64_build.py)."""
    from tests.test_arm64_build import require_arm64_build
    from tests.test_portable_build import _info, _require_build

    cpuinfo = row.file("proc-cpuinfo.txt").read_text()
    bin_dir = _require_build("cpu") if cpuinfo_flags(cpuinfo) else require_arm64_build()
    variants = _info(bin_dir)["cpu_variants"]
    assert ggml_cpu_variant(variants, cpu_feature_names(cpuinfo)) == row.expected["ggml_cpu_variant"]


@pytest.mark.integration
@pytest.mark.parametrize("row", [r for r in ROWS if "cuda_preflight" in r.expected], ids=lambda r: r.machine)
def test_the_preflight_refuses_a_cuda_build_without_code_for_the_planned_gpu(row: Row, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The load stage's preflight (before any download) on each captured NVIDIA machine, with the
    probe's compute capability from NVML, for a CUDA build of each architecture list: the build made
    here ("90"), the fleet build measured in docs/builds.md ("75;86": machine code and PTX) and one
    with machine code only ("75-real;86-real", which no Hopper runs)."""
    import hotfit.backends.llama_server.backend
    from hotfit.backends.select import backend_for
    from hotfit.core.settings import load_settings
    from hotfit.pipeline.registry_file import load_registry
    from hotfit.registry.kv import KV_CACHE_TYPES
    from hotfit.stages.plan import build_plan

    # What is tested is the build's CUDA architectures against the GPU's capability; the stand-in
    # binary lists no device, so the planned-device check (tests/test_device_check.py) is waived.
    monkeypatch.setattr(hotfit.backends.llama_server.backend, "check_planned_device", lambda *a, **k: None)
    probe = row_probe(row, tmp_path)
    outcome = build_plan(probe, load_registry().entries, KV_CACHE_TYPES["f16"], backend="llama", device="nvidia")
    assert outcome.plan is not None and outcome.plan.placement.device.kind == "nvidia"
    capability = outcome.plan.placement.device.compute_capability
    assert capability == row.nvml["gpus"][0]["compute_cap"]
    for archs, verdict in row.expected["cuda_preflight"].items():
        bin_dir = tmp_path / archs.replace(";", "_")
        bin_dir.mkdir()
        server = bin_dir / "llama-server"
        server.write_text("#!/bin/sh\necho 'version: 0.5.0-dev (build 1, commit 0c1e570)'\n")
        server.chmod(0o755)
        (bin_dir / "build-info.json").write_text(json.dumps(
            {"backend": "cuda", "cpu_features": [], "cuda_architectures": archs.split(";")}))
        settings = load_settings(llama_server=server)
        if verdict == "runs":
            assert backend_for("llama").preflight(outcome.plan, settings).to_json()["server_path"] == str(server), archs
            continue
        with pytest.raises(BackendError) as refused:
            backend_for("llama").preflight(outcome.plan, settings)
        assert f"compute capability {capability}" in refused.value.what and archs in refused.value.what
        assert f'HOTFIT_CUDA_ARCHS=\"{archs};{capability.replace(".", "")}\"' in (refused.value.hint or "")


# ----------------------------------------------------------------------------- the captures, transcribed


@pytest.mark.parametrize("row", [r for r in ROWS if r.file("nvml.json")], ids=lambda r: r.machine)
def test_nvml_json_is_what_the_capture_says(row: Row) -> None:
    data = row.nvml
    assert data is not None
    keys = ("name", "uuid", "memory_total_mib", "memory_used_mib", "memory_free_mib", "mig_mode", "max_memory_clock_mhz")
    if row.file("nvidia-smi-q.xml"):
        facts = facts_from_xml(row.folder / "nvidia-smi-q.xml")
        assert data["driver_version"] == facts["driver_version"] and data["cuda_version"] == facts["cuda_version"]
        for gpu, cap in zip(data["gpus"], facts["gpus"], strict=True):
            assert {k: gpu[k] for k in (*keys, "processes")} == {k: cap[k] for k in (*keys, "processes")}
    else:
        facts = facts_from_exporter_capture(row.folder / "nvidia-smi-capture.txt")
        for gpu, cap in zip(data["gpus"], facts["gpus"], strict=True):
            assert {k: gpu[k] for k in (*keys, "compute_cap")} == {k: cap[k] for k in (*keys, "compute_cap")}
            assert data["driver_version"] == cap["driver_version"]
        migs = [m for g in data["gpus"] for m in g["mig_devices"]]
        mkeys = ("index", "profile", "uuid", "memory_total_mib", "memory_used_mib", "memory_free_mib")
        assert [{k: m[k] for k in mkeys} for m in migs] == facts["mig_devices"]


@pytest.mark.integration
def test_the_nvidia_smi_standin_answers_like_nvidia_smi(tmp_path: Path) -> None:
    smi = nvidia_smi_standin(tmp_path / "bin", MATRIX / "nvidia-h100-80gb" / "nvml.json")
    out = subprocess.run([str(smi), "--query-gpu=name,memory.total,compute_cap", "--format=csv"],
                         capture_output=True, text=True, check=True).stdout
    assert out == "name, memory.total [MiB], compute_cap\nNVIDIA H100 80GB HBM3, 81559 MiB, 9.0\n"
    bad = subprocess.run([str(smi), "--query-gpu=frobs", "--format=csv,noheader"], capture_output=True, text=True)
    assert bad.returncode == 2 and "is not a valid field" in bad.stdout


# ----------------------------------------------------------------------------- MIG: one slice, or each


def test_a_mig_slice_pinned_by_cuda_visible_devices_is_planned_on_its_own_memory(tmp_path: Path) -> None:
    row = Row("nvidia-h100-mig", MATRIX / "nvidia-h100-mig")
    data = row.nvml
    assert data is not None
    slice_ = data["gpus"][0]["mig_devices"][1]  # 2g.20gb
    probe = row_probe(row, tmp_path, env={"CUDA_VISIBLE_DEVICES": slice_["uuid"]})
    gpus = [d for d in probe.devices if d.kind == "nvidia"]
    assert [(d.name, d.uuid, d.total_bytes) for d in gpus] == [
        ("NVIDIA H100 80GB HBM3 MIG 2g.20gb", slice_["uuid"], slice_["memory_total_mib"] << 20)]
    rc, plan = plan_json(probe, tmp_path)
    assert rc == 0 and plan["selected"]["name"]
    nv = next(d for d in plan["devices"] if d["kind"] == "nvidia")
    assert nv["budget"]["total_bytes"] == slice_["memory_total_mib"] << 20  # never the whole 80 GB card


# ----------------------------------------------------------------------------- machines the matrix does not cover


@pytest.mark.integration
def test_an_empty_cpuinfo_is_no_traceback(tmp_path: Path) -> None:
    root = machine_root(None, tmp_path, cpuinfo="")
    assert detect(root)[0] == "cpu"
    assert isa_verdict("") == {"verdict": "not-compared", "missing": []}
    probe = probe_devices(env={}, nvml=None, proc_root=root / "proc", sys_root=root / "sys",
                          cgroup_root=root / "cgroup")
    rc, data = plan_json(probe, tmp_path)
    assert rc == 0 and data["device"]["kind"] == "cpu"


@pytest.mark.parametrize(("garbage", "code"), [
    ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest "
     "NVIDIA driver is installed and running.", 9),
    ("\x00\x01 not a version", 0),
    ("", 0),
])
@pytest.mark.integration
def test_a_garbage_nvidia_smi_is_reported_not_read_as_a_driver(tmp_path: Path, garbage: str, code: int) -> None:
    root = machine_root(None, tmp_path, cpuinfo="")
    nvidia_smi_standin(tmp_path / "bin", garbage=garbage, exit_code=code)
    backend, why = detect(root, tmp_path / "bin")
    assert backend == "cpu" and "older than" not in why
    assert "nvidia-smi is on PATH but answered no driver version" in why


@pytest.mark.integration
def test_a_garbage_nvidia_smi_beside_an_nvidia_card_falls_back_to_vulkan(tmp_path: Path) -> None:
    root = machine_root(None, tmp_path, cpuinfo="")
    dev = root / "sys" / "class" / "drm" / "card0" / "device"
    dev.mkdir(parents=True)
    (dev / "vendor").write_text("0x10de\n")
    (dev / "class").write_text("0x030000\n")
    nvidia_smi_standin(tmp_path / "bin", garbage="NVIDIA-SMI has failed because it couldn't communicate", exit_code=9)
    backend, why = detect(root, tmp_path / "bin")
    assert backend == "vulkan" and "without a loaded NVIDIA driver" in why and "NVIDIA-SMI has failed" in why


@pytest.mark.integration
def test_an_unknown_display_vendor_and_unreadable_vram_counters_are_no_traceback(tmp_path: Path) -> None:
    root = machine_root(None, tmp_path, cpuinfo="flags\t\t: fpu sse sse2\n")
    bmc = root / "sys" / "class" / "drm" / "card0" / "device"  # a server's BMC display (ASPEED)
    bmc.mkdir(parents=True)
    (bmc / "vendor").write_text("0x1a03\n")
    (bmc / "class").write_text("0x030000\n")
    amd = root / "sys" / "class" / "drm" / "card1" / "device"
    amd.mkdir(parents=True)
    for name, text in (("vendor", "0x1002\n"), ("class", "0x038000\n"), ("mem_info_vram_total", "n/a\n"),
                       ("mem_info_vram_used", "0\n")):
        (amd / name).write_text(text)
    backend, why = detect(root)
    assert backend == "vulkan" and "0x1002" in why  # the AMD card; the BMC display alone would be cpu
    probe = probe_devices(env={}, nvml=None, proc_root=root / "proc", sys_root=root / "sys",
                          cgroup_root=root / "cgroup")
    assert [d.kind for d in probe.devices] == ["cpu"]
    assert any("card1: VRAM counters unreadable" in n for n in probe.notes)
    refused = isa_verdict("flags\t\t: fpu sse sse2\n")
    assert refused["verdict"] == "refused" and "avx2" in refused["missing"]


def test_a_gpu_nvml_cannot_read_is_a_hardware_error_with_a_hint(tmp_path: Path) -> None:
    row = Row("nvidia-tesla-t4", MATRIX / "nvidia-tesla-t4")
    data = row.nvml
    assert data is not None
    nvml = nvml_from(data)

    def broken(handle: Any) -> Any:
        raise nvml.NVMLError(15)  # NVML_ERROR_GPU_IS_LOST

    nvml.nvmlDeviceGetMemoryInfo = broken
    root = machine_root(row, tmp_path)
    from hotfit.core.errors import HardwareProbeError

    with pytest.raises(HardwareProbeError) as err:
        probe_devices(env={}, nvml=nvml, proc_root=root / "proc", sys_root=root / "sys", cgroup_root=root / "cgroup")
    assert "NVML is installed but failing" in err.value.what and "nvidia-smi" in (err.value.hint or "")


def test_a_gpu_in_mig_mode_without_instances_is_not_planned_as_the_whole_card(tmp_path: Path) -> None:
    row = Row("nvidia-h100-mig", MATRIX / "nvidia-h100-mig")
    data = row.nvml
    assert data is not None
    data["gpus"][0]["mig_devices"] = []  # MIG enabled, no GPU instance created yet
    root = machine_root(row, tmp_path)
    probe = probe_devices(env={}, nvml=nvml_from(data), proc_root=root / "proc", sys_root=root / "sys",
                          cgroup_root=root / "cgroup")
    assert [d.kind for d in probe.devices] == ["cpu"]
    assert any("MIG mode" in n and "none configured" in n for n in probe.notes)


@pytest.mark.parametrize("row", [r for r in ROWS if r.expected["probe"]["devices"]], ids=lambda r: r.machine)
def test_openvinos_preflight_accepts_what_the_planner_plans_on_a_gpu_machine(row: Row, tmp_path: Path) -> None:
    # Seen: the planner put qwen3-8b-ov on the GPU and this preflight refused it (exit 5).
    from hotfit.backends.select import backend_for
    from hotfit.core.settings import load_settings
    from hotfit.pipeline.registry_file import load_registry
    from hotfit.registry.kv import KV_CACHE_TYPES
    from hotfit.stages.plan import build_plan

    outcome = build_plan(row_probe(row, tmp_path), load_registry().entries, KV_CACHE_TYPES["q8_0"], backend="openvino")
    assert outcome.plan is not None
    runtime = backend_for("openvino").preflight(outcome.plan, load_settings())
    assert runtime.to_json()["device"] == "CPU"


@pytest.mark.parametrize("row", [r for r in ROWS if r.file("nvml.json")], ids=lambda r: r.machine)
def test_a_gpu_rows_speed_is_plausible_by_construction(row: Row, tmp_path: Path) -> None:
    """The probe reads the card's bandwidth from NVML (max memory clock x 2 x bus width; a MIG slice
    through its GPU), and the pick predicted on the GPU beats the same model on the row's host."""
    from hotfit.pipeline.registry_file import load_registry
    from hotfit.registry.kv import KV_CACHE_TYPES
    from hotfit.registry.speed import device_speed_facts, model_speed_facts, predict

    nvml = row.nvml
    assert nvml is not None
    probe = row_probe(row, tmp_path)
    card = nvml["gpus"][0]
    want = card["max_memory_clock_mhz"] * 1_000_000 * 2 * card["memory_bus_width_bits"] // 8
    gpus = [d for d in probe.devices if d.kind == "nvidia"]
    assert gpus and all(d.read_bandwidth_bytes_per_s == want and "NVML" in (d.bandwidth_basis or "") for d in gpus)
    host = next(d for d in probe.devices if d.kind == "cpu")
    rc, data = plan_json(probe, tmp_path, "--device", str(gpus[0].index))
    assert rc == 0 and data["device"]["kind"] == "nvidia"
    entry = next(e for e in load_registry().entries if e.name == data["selected"]["name"])
    facts = model_speed_facts(entry, KV_CACHE_TYPES["f16"])
    assert facts is not None
    on_gpu, on_host = (predict(facts, device_speed_facts(d), 16384) for d in (gpus[0], host))
    assert on_gpu.decode_tokens_per_s > on_host.decode_tokens_per_s and on_gpu.first_token_s < on_host.first_token_s
    predicted = data["selected"]["speed"]["predicted"]
    assert predicted["decode_tokens_per_s"] == round(on_gpu.decode_tokens_per_s, 2)
    # an MoE (registry: active parameters recorded) is faster than a dense entry of about its total size
    moe = [e for e in load_registry().entries if e.params_active_b and e.params_active_b < (e.params_total_b or 0)]
    assert moe
    for m in moe:
        dense = min((e for e in load_registry().entries if not e.params_active_b and e.params_total_b
                     and model_speed_facts(e, KV_CACHE_TYPES["f16"]) is not None
                     and e.params_total_b >= 0.8 * (m.params_total_b or 0)), key=lambda e: e.params_total_b or 0,
                    default=None)
        fm, fd = model_speed_facts(m, KV_CACHE_TYPES["f16"]), None if dense is None else model_speed_facts(
            dense, KV_CACHE_TYPES["f16"])
        if fm is None or fd is None:
            continue
        pm, pd = predict(fm, device_speed_facts(gpus[0]), 16384), predict(fd, device_speed_facts(gpus[0]), 16384)
        assert pm.decode_tokens_per_s > pd.decode_tokens_per_s, (m.name, dense)

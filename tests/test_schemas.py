"""One schema per file format: the records toolkit, the manifest's decoder (its
entry through the registry's one entry decoder), and damaged manifests and probe files at the CLI."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
from pathlib import Path
from typing import Any, Callable

import pytest

from hotfit.core.errors import RegistryError, UsageError
from hotfit.planner.plan import BudgetBreakdown, Placement, Plan
from hotfit.planner.probe import Device, ProbeResult
from hotfit.core.records import Fields
from hotfit.pipeline.cli import main
from hotfit.pipeline.manifest import Manifest, plan_from_json, read_manifest, write_manifest
from hotfit.pipeline.registry_file import load_registry
from hotfit.registry.catalog import entry_fields
from hotfit.registry.schema import decode_entry
from hotfit.stages.probe import load_probe_file

TIER = "unit"

GiB = 1 << 30


def _fail(field: str, problem: str, hint: str) -> UsageError:
    return UsageError(f"t.json: field {field!r} {problem}", hint=hint, field=field)


# --------------------------------------------------------------------------- the toolkit


def test_nested_readers_name_the_full_field_path() -> None:
    f = Fields(_fail, noun="test").at("plan").at("devices[0]")
    with pytest.raises(UsageError) as info:
        f.integer("8GiB", "total_bytes")
    assert info.value.details["field"] == "plan.devices[0].total_bytes"
    assert "must be a positive whole number, got '8GiB'" in info.value.what and info.value.hint


@pytest.mark.parametrize("value", [True, 1.0, -1, float("nan"), "1"])
def test_integer_refuses_what_json_would_let_through(value: Any) -> None:
    with pytest.raises(UsageError):
        Fields(_fail, noun="test").integer(value, "n", minimum=0)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0, -2.5, True])
def test_number_refuses_non_finite_and_non_positive_values(value: Any) -> None:
    with pytest.raises(UsageError, match="'x' must be a positive number"):
        Fields(_fail, noun="test").number(value, "x")


def test_object_names_a_missing_and_an_unknown_key() -> None:
    f = Fields(_fail, noun="manifest")
    with pytest.raises(UsageError, match="'a.b' is missing"):
        f.object({}, "a", ("b",))
    with pytest.raises(UsageError, match="'a.c' is not a manifest field"):
        f.object({"b": 1, "c": 2}, "a", ("b",))
    assert f.object({"b": 1, "c": 2}, "a", ("b",), extra=True) == {"b": 1, "c": 2}


# --------------------------------------------------------------------------- manifest round trip


def _plan_for(entry: Any) -> Plan:
    probe = ProbeResult(devices=(Device(0, "nvidia", "card", 24 * GiB, 20 * GiB, uuid="GPU-1",
                                        ggml_device="CUDA0"), Device(1, "cpu", "host", 64 * GiB, 30 * GiB)),
                        notes=("a note",))
    budget = BudgetBreakdown(free_bytes=20 * GiB, reserve_bytes=GiB, headroom_bytes=GiB, usable_bytes=18 * GiB,
                             weights_bytes=entry.weights_bytes or 0, allowance_bytes=GiB, kv_budget_bytes=-5,
                             hot_context_tokens=32768)
    return Plan(entry=entry, probe=probe, placement=Placement.single(probe.devices[0]), kv_cache_type="q8_0", kv_cache_type_source="env",
                hot_context_tokens=32768, estimated_kv_bytes=123, budget=budget, origin="eu",
                reused_previous=True, explicit_model=True)


def _manifest(plan: Plan, **changes: Any) -> Manifest:
    m = Manifest(run_id="r1", plan_id=plan.plan_id, written_at="2026-12-01T00:00:00Z", entry_name=plan.entry.name,
                 model_path="/m/x.gguf", model_size_bytes=10, model_sha256="0" * 64, template_path=None,
                 projector_path=None, kv_cache_type=plan.kv_cache_type,
                 planned_hot_context_tokens=plan.hot_context_tokens, measured={"opened_context_tokens": 32768},
                 probe_verdict={"passed": True}, backend_build={"version": "x"}, device={}, plan=plan.to_json())
    return dataclasses.replace(m, **changes)


def test_every_bundled_entry_round_trips_through_the_manifest(tmp_path: Path) -> None:
    """What the manifest writes for a plan comes back equal (same plan_id) for every curated entry,
    and its entry is what the registry's own decoder makes of the same JSON."""
    for entry in load_registry().entries:
        plan = _plan_for(entry)
        path = tmp_path / f"{entry.name}.json"
        write_manifest(path, _manifest(plan))
        read = read_manifest(path, strict=True)
        assert read is not None
        again = plan_from_json(read.plan)
        assert again == plan and again.plan_id == plan.plan_id, entry.name
        registry_view = decode_entry(read.plan["entry"], entry_fields("x.json", 0, read.plan["entry"]))
        assert registry_view == again.entry


def test_the_manifest_entry_is_checked_by_the_registry_decoder(tmp_path: Path) -> None:
    """A field the registry refuses is refused in the manifest with the registry's own wording."""
    entry = next(e for e in load_registry().entries if e.name == "gpt-oss-20b")
    plan_json = json.loads(json.dumps(_plan_for(entry).to_json()))
    for field_path, value, wording in [
        (("artifact", "revision"), "main", "is 'main', not a 40-hex commit id"),
        (("backend",), "vllm", "is 'vllm', not one of llama, openvino"),
        (("config", "layer_groups", 0, "n_kv_heads"), 0, "must be a positive whole number, got 0"),
    ]:
        broken = copy.deepcopy(plan_json)
        target: Any = broken["entry"]
        for key in field_path[:-1]:
            target = target[key]
        target[field_path[-1]] = value
        with pytest.raises(RegistryError) as registry_error:
            decode_entry(broken["entry"], entry_fields("reg.json", 0, broken["entry"]))
        with pytest.raises(UsageError) as manifest_error:
            plan_from_json(broken, source="manifest m.json")
        dotted = ".".join(str(k) for k in field_path).replace(".0.", "[0].")
        assert wording in registry_error.value.what and wording in manifest_error.value.what
        assert manifest_error.value.details["field"] == f"entry.{dotted}"
        assert manifest_error.value.what.startswith("manifest m.json holds no usable plan: field 'entry.")


# --------------------------------------------------------------------------- damaged manifests at the CLI


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(doc: dict[str, Any]) -> None:
        target = doc
        *parents, last = key.split(".")
        for k in parents:
            target = target[k]
        target[last] = value
    return apply


DAMAGED_MANIFESTS = [
    ("planned_hot_context_tokens", _set("planned_hot_context_tokens", "40000")),
    ("model_size_bytes", _set("model_size_bytes", -1)),
    ("measured", _set("measured", [1, 2])),
    ("backend", _set("backend", "vllm")),
    ("schema", _set("schema", 2)),
    ("entry_name", lambda d: d.pop("entry_name")),
    ("backend_build", lambda d: d.pop("backend_build")),
    ("llama_cpp", lambda d: d.update(llama_cpp={})),  # both names: which one holds the facts?
]


@pytest.mark.parametrize("field,damage", DAMAGED_MANIFESTS, ids=[d[0] for d in DAMAGED_MANIFESTS])
def test_a_damaged_manifest_names_the_file_and_field(tmp_path: Path, field: str,
                                                     damage: Callable[[dict[str, Any]], None]) -> None:
    entry = next(e for e in load_registry().entries if e.name == "gpt-oss-20b")
    home = tmp_path / "home"
    home.mkdir()
    path = home / "manifest.json"
    doc = _manifest(_plan_for(entry)).to_json()
    doc = json.loads(json.dumps(doc))
    damage(doc)
    path.write_text(json.dumps(doc))
    assert read_manifest(path) is None  # auto provisions afresh
    with pytest.raises(UsageError) as info:
        read_manifest(path, strict=True)
    assert info.value.details == {"manifest": str(path), "field": field}
    assert str(path) in info.value.what and repr(field) in info.value.what

    out = io.StringIO()  # serve: exit 2 (as before), the message names file and field
    assert main(["--home", str(home), "--log-format", "json", "serve", "--json", "--print-command"], out=out) == 2
    error = json.loads(out.getvalue())["error"]
    assert str(path) in error["message"] and repr(field) in error["message"] and "hotfit auto" in error["hint"]
    out = io.StringIO()  # status: exit 0, the problem listed (as before)
    assert main(["--home", str(home), "--log-format", "json", "status", "--json"], out=out) == 0
    problems = json.loads(out.getvalue())["provisioned_problems"]
    assert any(str(path) in p and repr(field) in p for p in problems), problems


def test_a_manifest_written_before_backend_build_reads_its_llama_cpp_section(tmp_path: Path) -> None:
    # manifests on disk name the backend's build facts "llama_cpp" and their plan has no placement
    entry = next(e for e in load_registry().entries if e.name == "gpt-oss-20b")
    plan = _plan_for(entry)
    doc = json.loads(json.dumps(_manifest(plan).to_json()))
    doc["llama_cpp"] = doc.pop("backend_build")
    doc["plan"] = {k: v for k, v in doc["plan"].items() if k not in ("schema", "placement")}
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(doc))
    read = read_manifest(path, strict=True)
    assert read is not None and read.backend_build == {"version": "x"}
    again = plan_from_json(read.plan)
    assert again == plan and again.placement.device == plan.probe.devices[0] and again.plan_id == plan.plan_id
    assert "llama_cpp" not in read.to_json() and read.to_json()["backend_build"] == {"version": "x"}  # rewritten new


def test_a_manifest_with_a_damaged_plan_names_the_plan_field_at_serve(tmp_path: Path) -> None:
    entry = next(e for e in load_registry().entries if e.name == "gpt-oss-20b")
    home = tmp_path / "home"
    home.mkdir()
    model = home / "x.gguf"
    model.write_bytes(b"x" * 10)
    manifest = _manifest(_plan_for(entry), model_path=str(model))
    plan = json.loads(json.dumps(manifest.plan))
    plan["probe"]["devices"][0]["free_bytes"] = 999 * GiB  # more than its total
    write_manifest(home / "manifest.json", dataclasses.replace(manifest, plan=plan))
    out = io.StringIO()
    assert main(["--home", str(home), "--log-format", "json", "serve", "--json", "--print-command"], out=out) == 2
    error = json.loads(out.getvalue())["error"]
    assert "holds no usable plan: field 'probe.devices[0].free_bytes'" in error["message"]
    assert str(home / "manifest.json") in error["message"] and "hotfit auto" in error["hint"]


# --------------------------------------------------------------------------- damaged probe files at the CLI


@pytest.mark.parametrize("text,field", [
    ('{"schema": 1, "devices": [{"index": 0, "kind": "tpu", "name": "x", "total_bytes": 1, "free_bytes": 0}],'
     ' "selected": 0}', "devices[0].kind"),
    ('{"schema": 1, "devices": [{"index": 0, "kind": "cpu", "name": "x", "total_bytes": 1.5e9,'
     ' "free_bytes": 0}], "selected": 0}', "devices[0].total_bytes"),
    ('{"schema": 1, "devices": [], "selected": 0}', "devices"),
    ('{"schema": 1, "devices": [{"index": 0, "kind": "cpu", "name": "x", "total_bytes": 1, "free_bytes": 0}],'
     ' "selected": 0, "notes": [1]}', "notes"),
])
def test_a_damaged_probe_file_names_the_file_and_field_at_the_cli(tmp_path: Path, hotfit_home: Path,
                                                                 text: str, field: str) -> None:
    path = tmp_path / "probe.json"
    path.write_text(text)
    for argv in (["plan", "--json", "--probe-file", str(path)],
                 ["auto", "--dry-run", "--json", "--probe-file", str(path)]):
        out = io.StringIO()
        assert main(argv, out=out) == 2, argv
        error = json.loads(out.getvalue())["error"]
        assert error["message"].startswith(f"probe file {path}: {field} "), error
        assert error["details"] == {"file": str(path), "field": field}
        assert "hotfit probe --save" in error["hint"]


# --------------------------------------------------------------------------- binary files (registry, probe file)


@pytest.mark.parametrize("name,load,error", [
    ("reg.json", load_registry, RegistryError),
    ("probe.json", load_probe_file, UsageError),
], ids=["registry", "probe-file"])
def test_a_binary_file_is_a_typed_error_naming_it_not_a_traceback(
        tmp_path: Path, name: str, load: Callable[[Path], Any], error: type[Exception]) -> None:
    path = tmp_path / name
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(error) as info:
        load(path)
    assert str(path) in str(info.value) and "UTF-8" in str(info.value) and info.value.hint  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- registry/ stays pure


def test_no_registry_module_reaches_files_network_or_processes() -> None:
    """registry/ parses text and computes: the file reads live in pipeline/registry_file.py."""
    import ast

    effectful = {"os", "io", "pathlib", "shutil", "subprocess", "socket", "urllib", "httpx", "huggingface_hub",
                 "importlib", "sqlite3", "state", "stages", "pipeline", "backends", "download"}
    package = Path(__file__).resolve().parent.parent / "registry"
    modules = sorted(package.glob("*.py"))
    assert len(modules) >= 7
    for module in modules:
        tree = ast.parse(module.read_text(encoding="utf-8"))
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module}
        assert not imported & effectful, f"{module.name} imports {sorted(imported & effectful)}"
        calls = {node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
                 and isinstance(node.func, ast.Attribute)}
        assert not calls & {"read_text", "read_bytes", "write_text", "open"}, module.name

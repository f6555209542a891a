"""Every stage's result decodes from its stored record into the type a fresh run returns.

A reused stage hands downstream the same frozen dataclass a fresh run does: each
result type's ``to_json()`` goes through JSON (as state.db stores it) and back through its decoder
to an equal value; a damaged record is a StageRecordError naming the field, never a half-decoded
result.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hotfit.core.errors import StageRecordError
from hotfit.core.records import canonical_json
from hotfit.planner.plan import Placement, Plan
from hotfit.planner.probe import Device, ProbeResult
from hotfit.backends.llama_server.discovery import BuildInfo, ServerBinary
from hotfit.pipeline.provision import AutoOptions, provisioning_stages
from hotfit.backends.llama_server.allocation import AllocationReport
from hotfit.backends.openvino.allocation import OpenVinoAllocationReport
from hotfit.stages.load import decode_load, decode_load_as
from hotfit.stages.probe_tool_call import decode_probe_call
from hotfit.stages.recheck import decode_recheck
from hotfit.stages.load import LoadResult
from hotfit.registry.kv import parse_kv_cache_type
from hotfit.core.model_files import (FetchedFile, FetchResult, FieldCheck, FileIdentity, GGUFFacts, SnapshotFile,
                               SnapshotResult, TemplateResult, VerifyResult)
from hotfit.planner.plan import decode_plan
from hotfit.stages.plan import PlannedRun, build_plan, decode_planned
from hotfit.stages.probe_tool_call import ProbeToolCallResult, ToolCallVerdict
from tests.e2e_support import GiB, fixture_entry
from tests.gguf_fixtures import write_tool_call_model

TIER = "unit"


def stored(result: Any) -> dict[str, Any]:
    """What state.db hands back for ``result``: its JSON, written and read again."""
    return json.loads(json.dumps(result.to_json()))


PROBE = ProbeResult(devices=(Device(0, "cpu", "host", 16 * GiB, 8 * GiB),
                             Device(1, "nvidia", "RTX", 24 * GiB, 20 * GiB, uuid="GPU-1", ggml_device="CUDA0")),
                    notes=("NVML ok",))
IDENTITY = FileIdentity(device=64769, inode=1234, size_bytes=123, mtime_ns=1_700_000_000_000_000_000,
                        ctime_ns=1_700_000_000_000_000_001)
WEIGHTS = FetchedFile(repo="a/b", revision="a" * 40, file="m.gguf", path="/m/m.gguf", partial_path="/m/.partial/m.gguf",
                      size_bytes=123, sha256="0" * 64, hub_lfs_sha256="0" * 64, identity=IDENTITY,
                      bytes_transferred=100, bytes_reread=0, resumed_from_bytes=23, connections=4, attempts=1,
                      already_present=False)
CHECKS = (FieldCheck("general.architecture", "llama", "llama", True), FieldCheck("context", None, 4096, None, "unknown"))
FETCH = FetchResult(entry="m", backend="llama", weights=WEIGHTS, projector=None, vision=False, warnings=("slow mirror",))
SNAPSHOT_FETCH = FetchResult(entry="ov", backend="openvino", weights=None, projector=None, vision=False,
                             snapshot=SnapshotResult("o/r", "main", "c" * 40, "/m/snapshot", 7, 999, 999, 0, 0, listed=(
                                 SnapshotFile("openvino_model.xml", 10, None, "d" * 40, "/m/.partial/x", None, "d" * 40,
                                              IDENTITY),)))
TEMPLATE = TemplateResult(entry="m", path="/m/chat_template.jinja", source="a/b@x/t.jinja", variant="jinja",
                          sha256="1" * 64, tool_markers=("<tool_call>",), size_bytes=42)
VERIFY = VerifyResult(entry="m", weights_path="/m/m.gguf", size_bytes=123, sha256="0" * 64, sha256_source="streamed",
                      header_checks=CHECKS, gguf_embeds_chat_template=True, chat_template_path=None, vision=False,
                      notes=("ok",), verified_against=("registry",),
                      gguf=GGUFFacts(version=3, tensor_count=10, architecture="llama", context_length=8192, block_count=2,
                                     embedding_length=64, head_count=(4, 4), head_count_kv=2, key_length=16,
                                     value_length=None, sliding_window=None, has_chat_template=True,
                                     chat_template_sha256="e" * 64, header_bytes=4096))
VERDICT = ToolCallVerdict(True, "parsed", "hotfit_probe", {"text": "x"}, None, "tool_calls")
CALL = ProbeToolCallResult(verdict=VERDICT, template="/m/chat_template.jinja", supports_tools=True,
                           prompt_tokens_per_s=310.5, generation_tokens_per_s=40.0, prompt_tokens=120,
                           generated_tokens=12, request={"messages": []}, answer={"choices": [{"message": {}}]})
OV_CALL = ProbeToolCallResult(verdict=VERDICT, template="/m/snapshot/chat_template.jinja", supports_tools=True,
                              prompt_tokens_per_s=None, generation_tokens_per_s=20.0, prompt_tokens=100,
                              generated_tokens=10, request={"messages": []}, answer={"text": "<tool_call>"},
                              backend_facts={"family": "hermes", "forced": True, "status": "FINISHED",
                                             "generation_seconds": 0.5, "template_renders_tools": True})
REPORT = AllocationReport(
    verdict="pass", problems=(), warnings=("rounded",), planned_hot_context_tokens=40960, floor_tokens=32768,
    opened_n_ctx_per_slot=(40960,), props_n_ctx=40960, total_slots=1, kv_cache_type="f16",
    estimated_kv_bytes=1000, predicted_kv_bytes=1000, actual_kv_bytes=1000, actual_kv_bytes_uncertainty=5,
    ratio=1.0, predicted_ratio=1.0, tolerance=0.02, caches=({"role": "kv", "cells": 40960},),
    kv_buffers=({"buffer": "CUDA0", "mib": 1.0},), offloaded_layers=(19, 19), flash_attn="on",
    chat_template_caps={"supports_tools": True}, build_info="b1", model_path="/m/m.gguf")
OV_REPORT = OpenVinoAllocationReport(
    verdict="pass", problems=(), warnings=(), planned_hot_context_tokens=32768, floor_tokens=32768,
    opened_context_tokens=32768, configured_kv_blocks=1024, block_tokens=32, kv_cache_type="q8_0", kv_precision="u8",
    kv_bytes_per_token=85248, estimated_kv_bytes=2, predicted_kv_bytes=2, actual_kv_bytes=2, ratio=1.0,
    max_cache_usage_percent=None, kv_states=56, tolerance=0.02)
LOAD_RECORD = {"pid": 42, "base_url": "http://127.0.0.1:5000", "argv": ["llama-server", "--port", "5000"],
               "log_path": "/r/log", "stderr_path": "/r/err", "template": {"kind": "file", "path": "/m/t.jinja"},
               "load_seconds": 1.5, "backend": {"server_path": "/b/llama-server", "build": {"commit": "abc"}}}
OV_LOAD_RECORD = {"pid": 43, "config": {"device": "CPU", "num_kv_blocks": 1024}, "load_seconds": 2.0,
                  "log_path": "/r/ov.log", "genai_version": "2026.4", "backend": {"name": "openvino",
                                                                              "genai_version": "2026.4"}}


@pytest.mark.parametrize("result, decode", [
    (PROBE, ProbeResult.decode), (FETCH, FetchResult.decode), (SNAPSHOT_FETCH, FetchResult.decode),
    (TEMPLATE, TemplateResult.decode), (VERIFY, VerifyResult.decode), (CALL, decode_probe_call),
    (OV_CALL, decode_probe_call), (REPORT, decode_recheck), (OV_REPORT, decode_recheck),
], ids=lambda v: type(v).__name__ if not callable(v) else "")
def test_a_stored_result_decodes_to_an_equal_result_of_the_same_type(result: Any, decode: Callable[..., Any]) -> None:
    back = decode(stored(result))
    assert type(back) is type(result) and back == result


def _cpu_plan(tmp_path: Path) -> Plan:
    info = write_tool_call_model(tmp_path / "m.gguf")
    entry = fixture_entry("fx", info, repo="a/b", revision="a" * 40, sha256="0" * 64, params_b=0.01, template=None)
    probe = ProbeResult(devices=(Device(0, "cpu", "host", 16 * GiB, 8 * GiB),))
    plan = build_plan(probe, [entry], parse_kv_cache_type("f16")).plan
    assert plan is not None
    return plan


def test_the_plan_decodes_with_the_same_plan_id(tmp_path: Path) -> None:
    plan = _cpu_plan(tmp_path)
    back = decode_plan(stored(plan))
    assert back == plan and back.plan_id == plan.plan_id


def _gpu_plan(tmp_path: Path) -> Plan:
    info = write_tool_call_model(tmp_path / "m.gguf")
    entry = fixture_entry("fx", info, repo="a/b", revision="a" * 40, sha256="0" * 64, params_b=0.01, template=None)
    plan = build_plan(PROBE, [entry], parse_kv_cache_type("f16")).plan
    assert plan is not None and plan.placement == Placement.single(PROBE.devices[1])  # the GPU, probe index 1
    return plan


def test_a_plan_record_written_before_placements_decodes_as_a_placement_on_the_device_its_probe_selected(
        tmp_path: Path) -> None:
    # a schema-1 record (before placements): no "schema", no "placement"; the probe's "selected" was the plan's device
    plan = _gpu_plan(tmp_path)
    old = {k: v for k, v in stored(plan).items() if k not in ("schema", "placement")}
    old["probe"]["selected"] = 1
    back = decode_plan(old)
    assert back.placement == Placement((PROBE.devices[1],), "none") and back == plan
    # the plan id is the one schema-1 plans had (entry, KV type, window, the device's kind/name/total), so a
    # provisioned home's stage state is still reused after the upgrade
    decision = {"entry": dataclasses.asdict(plan.entry), "kv_cache_type": "f16",
                "hot_context_tokens": plan.hot_context_tokens,
                "device": {"kind": "nvidia", "name": "RTX", "total_bytes": 24 * GiB}}
    assert back.plan_id == hashlib.sha256(canonical_json(decision).encode()).hexdigest()[:16] == plan.plan_id
    old["probe"]["selected"] = 5
    with pytest.raises(StageRecordError, match="probe.selected"):
        decode_plan(old)


@pytest.mark.parametrize(("change", "field"), [
    (lambda r: r["placement"].update(devices=[7]), "placement.devices[0]"),
    (lambda r: r["placement"].update(devices=[0, 1]), "placement.devices"),
    (lambda r: r["placement"].update(split="layer"), "placement.split"),
    (lambda r: r.pop("placement"), "placement"),
    (lambda r: r.update(schema=3), "schema"),
])
def test_a_damaged_placement_is_a_stage_record_error_naming_the_field(
        tmp_path: Path, change: Callable[[dict[str, Any]], Any], field: str) -> None:
    record = stored(_gpu_plan(tmp_path))
    change(record)
    with pytest.raises(StageRecordError) as err:
        decode_plan(record)
    assert err.value.details["field"] == field


def test_the_plan_stage_record_carries_the_preflight_binary_and_decodes_to_the_same_result(tmp_path: Path) -> None:
    """The plan stage hands load the binary its preflight found as a field of its result (no side
    channel); the record holds the plan and that binary (path and build facts) and decodes back."""
    plan = _cpu_plan(tmp_path)
    binary = ServerBinary(tmp_path / "bin" / "llama-server", "cache",
                          BuildInfo("build-info.json", "0.0.1", 7000, "abc1234", "0.3.36", backend="cpu",
                                    variant="native", cpu_features=("avx2", "fma")), None)
    planned = PlannedRun(plan, binary)
    record = stored(planned)
    assert record["preflight"]["server_path"] == str(binary.server_path)
    assert decode_plan({k: v for k, v in record.items() if k != "preflight"}) == plan  # the plan's own fields
    back = decode_planned(record)
    assert back == planned and isinstance(back.backend, ServerBinary) and back.plan.plan_id == plan.plan_id
    assert decode_planned(stored(PlannedRun(plan))) == PlannedRun(plan)  # planned only: no binary
    with pytest.raises(StageRecordError) as err:
        decode_planned(record | {"preflight": record["preflight"] | {"server_path": 3}})
    assert err.value.details["field"] == "preflight.server_path"


def test_a_load_record_decodes_without_a_live_server_and_re_encodes_the_same() -> None:
    load = decode_load(LOAD_RECORD)
    assert isinstance(load, LoadResult) and load.record["argv"] == ["llama-server", "--port", "5000"]
    assert load.to_json() == LOAD_RECORD
    with pytest.raises(RuntimeError, match="reused from a record"):
        load.live()
    ov = decode_load(OV_LOAD_RECORD)
    assert isinstance(ov, LoadResult) and ov.to_json() == OV_LOAD_RECORD
    assert (load.backend, ov.backend) == ("llama", "openvino")  # each accepted by its own backend


def test_every_hotfit_stage_names_a_decoder() -> None:
    assert all(s.decode is not None for s in provisioning_stages(AutoOptions()))


@pytest.mark.parametrize("decode, record, field, problem", [
    (VerifyResult.decode, {k: v for k, v in stored(VERIFY).items() if k != "sha256_source"}, "sha256_source",
     "is missing"),
    (VerifyResult.decode, stored(VERIFY) | {"size_bytes": "123"}, "size_bytes", "must be a whole number, got str"),
    (VerifyResult.decode, stored(VERIFY) | {"size_bytes": True}, "size_bytes", "must be a whole number, got bool"),
    (VerifyResult.decode, stored(VERIFY) | {"header_checks": [{"field": "x", "registry": 1, "gguf": 1, "ok": "yes"}]},
     "header_checks[0].ok", "must be true or false, got str"),
    (FetchResult.decode, stored(FETCH) | {"weights": stored(WEIGHTS) | {"identity": {"device": 1}}},
     "weights.identity.inode", "is missing"),
    (FetchResult.decode, stored(FETCH) | {"weights": stored(WEIGHTS) | {"verified_against": "registry"}},
     "weights.verified_against", "must be a list, got str"),
    (TemplateResult.decode, stored(TEMPLATE) | {"unexpected": 1}, None, "has keys TemplateResult does not: unexpected"),
    (functools.partial(decode_load_as, backend="llama"), LOAD_RECORD | {"argv": [1]}, "argv[0]",
     "must be a string, got int"),
    (functools.partial(decode_load_as, backend="openvino"), OV_LOAD_RECORD | {"config": None}, "config",
     "must be an object, got null"),
    (decode_recheck, stored(REPORT) | {"offloaded_layers": [19]}, "offloaded_layers", "must hold 2 items, got 1"),
    (ProbeResult.decode, ["not", "an", "object"], None, "must be an object, got list"),
])
def test_a_damaged_record_is_a_stage_record_error_naming_the_field(decode: Callable[..., Any], record: Any,
                                                                   field: str | None, problem: str) -> None:
    with pytest.raises(StageRecordError) as err:
        decode(record)
    assert problem in err.value.what
    assert err.value.details.get("field") == field
    assert err.value.exit_code == 2 and err.value.code == "stage_record"

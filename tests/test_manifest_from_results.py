"""The manifest is built from the stages' typed results (pipeline/auto.py ``build_manifest``): what
differs between backends (the runtime's figures, the ``backend_build`` section, ``extra.openvino``) is
the load's binary's to say, and a run whose session was reused writes the same manifest as a fresh one."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from hotfit.backends.llama_server.discovery import BuildInfo, ServerBinary
from hotfit.backends.openvino.backend import OpenVinoRuntime
from hotfit.planner.plan import Plan
from hotfit.pipeline.auto import ProvisionedResults, build_manifest
from hotfit.pipeline.engine import PipelineOutcome
from hotfit.stages.load import LoadResult, decode_load_for_plan
from hotfit.stages.recheck import decode_recheck_for_plan
from tests.test_stage_records import (CALL, FETCH, LOAD_RECORD, OV_CALL, OV_LOAD_RECORD, OV_REPORT, REPORT,
                                      SNAPSHOT_FETCH, TEMPLATE, VERIFY, _cpu_plan)

TIER = "unit"

BINARY = ServerBinary(Path("/b/llama-server"), "cache", BuildInfo("build-info.json", "0.0.1", 7000, "abc1234", "0.3.36",
                                                                  backend="cpu", variant="native"), None)
RUNTIME = OpenVinoRuntime("2026.4", "CPU", "u8")


def _manifest(plan: Plan, results: dict[str, Any]) -> dict[str, Any]:
    outputs = {k: v.to_json() for k, v in results.items()}
    outcome = PipelineOutcome("run1", False, plan, results, outputs, (), tuple(results))
    data = json.loads(json.dumps(build_manifest(ProvisionedResults.of(outcome)).to_json()))
    data.pop("written_at")
    return dict(data)


@pytest.mark.parametrize("backend", ["llama", "openvino"])
def test_the_backend_facts_come_from_the_loaded_binary_and_a_reused_session_writes_the_same(
        tmp_path: Path, backend: str) -> None:
    plan = _cpu_plan(tmp_path)
    if backend == "openvino":
        plan = dataclasses.replace(plan, entry=dataclasses.replace(plan.entry, backend="openvino"))
    binary, load, fetched, call, report = (
        (BINARY, LOAD_RECORD, FETCH, CALL, REPORT) if backend == "llama"
        else (RUNTIME, OV_LOAD_RECORD, SNAPSHOT_FETCH, OV_CALL, OV_REPORT))
    record = {**load, "backend": binary.to_json()}
    fresh = {"fetch-weights": fetched, "fetch-template": TEMPLATE, "verify": VERIFY,
             "load": LoadResult(record, backend, binary=binary), "probe-tool-call": call, "re-check": report}
    manifest = _manifest(plan, fresh)
    reused = fresh | {"load": decode_load_for_plan(json.loads(json.dumps(record)), plan),
                      "re-check": decode_recheck_for_plan(json.loads(json.dumps(report.to_json())), plan)}
    assert _manifest(plan, reused) == manifest
    measured = manifest["measured"]
    if backend == "llama":
        assert manifest["backend_build"]["server_path"] == "/b/llama-server" and manifest["backend_build"]["build_info"] == "b1"
        assert measured["offloaded_layers"] == [19, 19] and "openvino" not in manifest["extra"]
    else:
        assert manifest["backend_build"] == {} and measured["kv_precision"] == "u8"
        assert manifest["extra"]["openvino"] == {"genai_version": "2026.4", "session": OV_LOAD_RECORD["config"],
                                                 "snapshot_commit": "c" * 40, "tool_call_family": "hermes",
                                                 "prompt_max_tokens": None}
    assert measured["opened_context_tokens"] == report.opened_context_tokens

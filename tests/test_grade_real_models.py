"""The grade on the real PyPI-shipped GGUFs, through the same Backend as load.

What each model does is recorded in the README (scripts/bench-grade measured the tiers); here the
suite checks, on every run, that the verdict a real model earns is decided by the right class:
Gemma 3 270M and SmolLM2 carry no tool-capable template, so the grade must stop at its preflight —
inconclusive, no scenario sent — never "fail"; Qwen2.5-Coder-0.5B has a tool template but writes its
call as bare JSON without the template's markers (the tool probe sees the same), so
the scenario is a stack outcome (``unparsed_call``) and the verdict inconclusive. One scenario only:
the model runs at a few tokens/s on 2 CPU cores. The same scenario graded twice must give the same
transcript hash (fixed sampling, one slot, each scenario's first request uncached).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hotfit.backends.base import ModelFiles
from hotfit.core.settings import load_settings
from hotfit.grading.runner import STACK_FAILURES
from hotfit.grading.scenarios import QUICK, scenarios_for
from hotfit.stages.grade import grade_endpoint
from hotfit.stages.load import open_session, preflight
from tests.gguf_fixtures import require_llama_server
from tests.real_models import GEMMA3, QWEN_CODER, SMOLLM2, planned, require_model

TIER = "integration"

pytestmark = [pytest.mark.llama, pytest.mark.anyio]
BUDGET_S = 300.0  # a stuck server must end the test, not hang it (one scenario takes 8-40 s here)


async def _grade(name: str, run_dir: Path, *, times: int = 1) -> list[dict[str, Any]]:
    require_llama_server()
    model = require_model(name)
    plan, _fit = planned(model.entry(), "f16", tokens=32768)
    settings = load_settings()
    files = ModelFiles(model.path, None, model.header.has_chat_template)
    reports = []
    async with open_session(plan, files, run_dir=run_dir, settings=settings,
                            binary=preflight(plan, settings)) as session:
        for _ in range(times):
            async with session.chat_endpoint() as endpoint:
                reports.append(await grade_endpoint(endpoint, endpoint_label=f"{name} (test)", tier="quick",
                                                    budget_s=BUDGET_S, scenarios=scenarios_for(QUICK)[:1]))
    return reports


@pytest.mark.parametrize("name", [GEMMA3, SMOLLM2])
async def test_a_real_model_without_a_tool_template_is_inconclusive_at_the_preflight(name: str,
                                                                                     tmp_path: Path) -> None:
    (report,) = await _grade(name, tmp_path)
    verdict = report["verdict"]
    assert verdict["verdict"] == "inconclusive", verdict
    assert verdict["stack_problem"].startswith("preflight_failed"), verdict
    assert report["scenarios"] == []  # nothing was sent to grade a model the template cannot carry


async def test_qwen_coder_writes_bare_json_calls_a_stack_outcome_not_a_model_failure(tmp_path: Path) -> None:
    first, second = await _grade(QWEN_CODER, tmp_path, times=2)
    (scenario,) = first["scenarios"]
    assert scenario["outcome"] in STACK_FAILURES, scenario["outcome"]
    assert scenario["outcome"] == "unparsed_call", scenario["detail"]
    assert first["verdict"]["verdict"] == "inconclusive" and first["verdict"]["stack_problem"]
    assert scenario["prompt_tokens"] > 0 and first["speeds"]["generation_tokens_per_s"] > 0
    assert first["fingerprint"]["supports_tools"] is True
    assert [s["transcript_sha256"] for s in second["scenarios"]] == [scenario["transcript_sha256"]]

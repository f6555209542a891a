"""grade: run the multi-turn tool-use grade against an OpenAI-compatible server.

The effectful half of :mod:`grading`, over any :class:`~grading.protocol.ChatEndpoint` (the
HTTP one, :func:`backends.select.endpoint_at`, serves ``--endpoint`` and llama-server
sessions through the Backend boundary; :func:`grade_session` grades any opened
:class:`backends.base.Session` through its ``chat_endpoint()``, so a model is graded through the
same Backend, flags and template that load and serve use): the budget
(``--budget-s`` stops cleanly with an inconclusive verdict), one ``grade.scenario`` event per
scenario, and the JSON record under ``<home>/grades/``.

Determinism (docs/grade.md): fixed sampling (:data:`grading.protocol.SAMPLING`), scenarios
in a fixed order, the slot erased before each scenario where the server supports it
(``POST /slots/0?action=erase``), deterministic tool-call ids echoed back, and a sha256 of each
canonical transcript. A server with more than one slot is noted: with several slots a request
may land on a slot whose cache the erase did not touch.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from hotfit.backends.base import Session
from hotfit.backends.select import backend_for
from hotfit.core.log import get_logger
from hotfit.core.records import JsonRecord
from hotfit.grading.preflight import PREFLIGHT_MESSAGES, PREFLIGHT_TOOLS, roundtrip_problem
from hotfit.grading.protocol import (
    SAMPLING,
    SLOT_FRESH_PROMPT,
    SLOT_UNSUPPORTED,
    ChatEndpoint,
    ServerFacts,
)
from hotfit.grading.report import (
    GRADE_VERSION,
    call_validity,
    category_results,
    decide_verdict,
    speeds,
)
from hotfit.grading.runner import NOT_RUN, STEP_LIMIT, ScenarioResult, run_scenario
from hotfit.grading.scenarios import Scenario, pack_hash, scenarios_for
from hotfit.core.model_files import VerifyResult
from hotfit.stages.declaration import StageContext, StageDeclaration
from hotfit.stages.load import SERVER_SESSION, LoadResult

__all__ = ["DECLARATION", "GRADE_FILE", "GRADE_STAGE", "GradeOptions", "GradeResult", "brief", "default_output_path", "fresh_output_path",
           "grade_endpoint", "grade_session", "session_facts", "write_report"]

GRADE_FILE = "grade.json"  # in a run directory: the record of the grade stage, transcripts included

log = get_logger()

def _fingerprint(facts: ServerFacts, *, tier: str, pack_sha256: str) -> dict[str, Any]:
    def known(value: Any) -> Any:
        return "unknown" if value is None else value

    return {
        "model": known(facts.model),
        "model_path": known(facts.model_path),
        "model_sha256": known(facts.model_sha256),
        "chat_template_sha256": known(facts.chat_template_sha256),
        "chat_format": known(facts.chat_format),
        "supports_tools": known(facts.supports_tools),
        "build": known(facts.build),
        "context_tokens": known(facts.context_tokens),
        "slots": known(facts.slots),
        "flags": "unknown",  # a server already running does not report its command line
        "sampling": dict(SAMPLING),
        "step_limit": STEP_LIMIT,
        "grade_version": GRADE_VERSION,
        "tier": tier,
        "scenario_pack_sha256": pack_sha256,
    }


async def _preflight(endpoint: ChatEndpoint, facts: ServerFacts) -> tuple[str | None, str]:
    """(problem or None, what the round trip showed: "ok", "failed" or "unavailable")."""
    if facts.supports_tools is False:
        return ("the server's chat template cannot express tool calls (/props chat_template_caps.supports_tools "
                "is false): llama-server drops the tools and answers in prose; load a tool-capable template"), "skipped"
    prompt = await endpoint.render(PREFLIGHT_MESSAGES, PREFLIGHT_TOOLS)
    if prompt is None:  # not a llama-server (no /apply-template): the scenarios still show a broken template
        return None, "unavailable"
    problem = roundtrip_problem(prompt)
    return problem, "failed" if problem else "ok"


async def grade_endpoint(endpoint: ChatEndpoint, *, endpoint_label: str, tier: str = "full",
                         budget_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                         known: Mapping[str, Any] | None = None, budget_flag: str = "--budget-s",
                         scenarios: Sequence[Scenario] | None = None) -> dict[str, Any]:
    """Grade ``endpoint``; return the report dict (transcripts included). Never raises for a
    server failure: that becomes an inconclusive verdict naming it. ``known``: fingerprint parts
    the caller knows better than the server reports them (the flags it started it with, the
    verified sha256); a None value leaves the server's reading. ``budget_flag`` names the option that
    set the budget in the verdict. ``scenarios``: another pack than the tier's (the tests' forced
    packs); its hash is the fingerprint's."""
    scenarios = tuple(scenarios) if scenarios is not None else scenarios_for(tier)
    pack_sha256 = pack_hash(scenarios, grade_version=GRADE_VERSION)
    started = clock()
    deadline = None if budget_s is None else started + budget_s
    log.info("grade.start", endpoint=endpoint_label, tier=tier, scenarios=len(scenarios), budget_s=budget_s,
             grade_version=GRADE_VERSION, scenario_pack_sha256=pack_sha256)
    facts = await endpoint.describe()
    preflight, roundtrip = await _preflight(endpoint, facts)
    results: list[ScenarioResult] = []
    budget_problem: str | None = None
    for scenario in scenarios:
        if preflight:
            break
        remaining = None if deadline is None else deadline - clock()
        if remaining is not None and remaining <= 0:
            results.append(ScenarioResult(scenario.id, scenario.category, NOT_RUN, "budget: not started"))
            budget_problem = budget_problem or f"{budget_flag} {budget_s:g} ran out after {len(results) - 1} scenarios"
            continue
        t0 = clock()
        result: ScenarioResult | None = None
        with anyio.move_on_after(remaining if remaining is not None else float("inf")):
            result = await run_scenario(endpoint, scenario)
        wall_s = round(clock() - t0, 3)
        if result is None:
            result = ScenarioResult(scenario.id, scenario.category, NOT_RUN, f"budget: stopped after {wall_s} s")
            budget_problem = budget_problem or (f"{budget_flag} {budget_s:g} ran out during {scenario.id} "
                                                f"({len([r for r in results if r.outcome != NOT_RUN])} "
                                                "scenarios finished)")
        result = _with_wall(result, wall_s)
        results.append(result)
        log.info("grade.scenario", scenario=scenario.id, category=scenario.category, outcome=result.outcome,
                 outcome_class=result.outcome_class, detail=result.detail, requests=result.requests,
                 calls=len(result.calls), invalid_calls=result.invalid_calls, wall_s=wall_s,
                 prompt_tokens=result.prompt_tokens, generated_tokens=result.generated_tokens,
                 first_cache_n=result.first_cache_n, slot=result.slot, transcript_sha256=result.transcript_sha256)
    wall_total = clock() - started
    verdict = decide_verdict(results, tier=tier, preflight_problem=preflight, budget_problem=budget_problem)
    notes = []
    if facts.slots is not None and facts.slots > 1:
        notes.append(f"the server has {facts.slots} slots; with more than one, the slot erase may miss the slot "
                     "a request lands on (start it with -np 1 for reproducible transcripts)")
    if any(r.slot == SLOT_FRESH_PROMPT for r in results):
        notes.append("the server refused POST /slots/0?action=erase (llama-server needs --slot-save-path for it); "
                     "each scenario's first request was sent with cache_prompt:false instead")
    if any(r.slot == SLOT_UNSUPPORTED for r in results):
        notes.append("the server did not accept POST /slots/0?action=erase; the prompt cache was not erased "
                     "between scenarios")
    passed = sum(r.outcome == "pass" for r in results)
    report: dict[str, Any] = {
        "grade_version": GRADE_VERSION,
        "tier": tier,
        "endpoint": endpoint_label,
        "verdict": verdict.to_json(),
        "score": {"passed": passed, "total": len(scenarios),
                  "fraction": round(passed / len(scenarios), 4) if scenarios else 0.0},
        "categories": category_results(results),
        "call_validity": call_validity(results),
        "speeds": speeds(results, wall_total),
        "fingerprint": {**_fingerprint(facts, tier=tier, pack_sha256=pack_sha256), "template_roundtrip": roundtrip,
                        **{k: v for k, v in (known or {}).items() if v is not None}},
        "determinism_notes": notes,
        "scenarios": [r.to_json() for r in results],
    }
    log.info("grade.done", verdict=verdict.verdict, stack_problem=verdict.stack_problem, passed=passed,
             total=len(scenarios), wall_s=round(wall_total, 3))
    return report


def session_facts(session: Session) -> dict[str, Any]:
    """The fingerprint parts an opened session knows that a server cannot report: the settings it
    was started with (asked of its backend: llama-server's flags without the port, which changes
    every start; OpenVINO's pipeline settings) and the backend."""
    flags = backend_for(session.backend).launch_flags(session.to_json())
    return {"flags": flags if flags else "unknown", "backend": session.backend}


async def grade_session(session: Session, *, label: str, tier: str = "full", budget_s: float | None = None,
                        known: Mapping[str, Any] | None = None, budget_flag: str = "--budget-s") -> dict[str, Any]:
    """Grade the model an opened session serves, through its own ``chat_endpoint()``; ``label``
    names it in the record ("model X on llama-server"), ``known`` adds fingerprint facts the caller
    verified (model and template sha256)."""
    async with session.chat_endpoint() as endpoint:
        return await grade_endpoint(endpoint, endpoint_label=label, tier=tier,
                                    budget_s=budget_s, known={**session_facts(session), **(known or {})},
                                    budget_flag=budget_flag)


@dataclass(frozen=True)
class GradeResult(JsonRecord):
    """What a grade's stage record keeps (the summary; the transcripts stay in ``path``), decoded
    back from the record when the stage is reused."""

    verdict: str  # pass | fail | inconclusive
    stack_problem: str | None
    provisional: bool
    reasons: tuple[str, ...]
    tier: str
    passed: int
    total: int
    fraction: float
    categories: dict[str, Any]
    speeds: dict[str, Any]
    fingerprint: dict[str, Any]
    path: str

    @classmethod
    def from_report(cls, report: Mapping[str, Any], path: Path) -> GradeResult:
        v, score = report["verdict"], report["score"]
        return cls(verdict=v["verdict"], stack_problem=v["stack_problem"], provisional=v["provisional"],
                   reasons=tuple(v["reasons"]), tier=report["tier"], passed=score["passed"], total=score["total"],
                   fraction=float(score["fraction"]), categories=dict(report["categories"]),
                   speeds=dict(report["speeds"]), fingerprint=dict(report["fingerprint"]), path=str(path))

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "reasons": list(self.reasons)}


def brief(report: Mapping[str, Any]) -> dict[str, Any]:
    """The report without transcripts and call logs (what the CLI prints)."""
    return {**report, "scenarios": [{k: v for k, v in s.items() if k not in ("transcript", "call_log")}
                                    for s in report["scenarios"]]}


def _with_wall(result: ScenarioResult, wall_s: float) -> ScenarioResult:
    return dataclasses.replace(result, wall_s=wall_s)


def default_output_path(home: Path, tier: str, now: _dt.datetime | None = None) -> Path:
    now = now or _dt.datetime.now(_dt.UTC)
    return home / "grades" / f"grade-{now.strftime('%Y%m%dT%H%M%S')}Z-{tier}.json"


def fresh_output_path(home: Path, tier: str) -> Path:
    """:func:`default_output_path`, with a counter when a grade of the same second already wrote there
    (``auto --grade`` then ``hotfit grade`` can finish within one), so no record is overwritten."""
    path = default_output_path(home, tier)
    n = 2
    while path.exists():
        path = default_output_path(home, tier).with_name(f"{default_output_path(home, tier).stem}-{n}.json")
        n += 1
    return path


def write_report(report: Mapping[str, Any], path: Path) -> Path:
    """Write atomically (temp file + rename), so a reader never sees half a record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


# --------------------------------------------------------------------------- the stage (auto --grade)

GRADE_STAGE = "grade"  # after re-check in the same session, only with `auto --grade`


@dataclass(frozen=True)
class GradeOptions:
    """``hotfit auto --grade``: which tier, and the budget after which it stops as inconclusive."""

    tier: str = "full"
    budget_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"tier": self.tier, "budget_s": self.budget_s}


async def grade_work(ctx: StageContext) -> GradeResult:
    options = ctx.job(GradeOptions)
    plan = ctx.require_plan()
    verified = ctx.result("verify", VerifyResult)
    report = await grade_session(ctx.result("load", LoadResult).live(), label=f"model {plan.entry.name} (hotfit auto)",
                                 tier=options.tier, budget_s=options.budget_s, budget_flag="--grade-budget-s",
                                 known={"model": plan.entry.name, "model_path": verified.weights_path,
                                        "model_sha256": verified.sha256})
    # its own JSON file beside every other grade record, transcripts included; the record keeps the summary
    path = fresh_output_path(ctx.settings.home, options.tier)
    await anyio.to_thread.run_sync(write_report, {**report, "output": str(path), "run_id": ctx.run_id}, path)
    return GradeResult.from_report(report, path)


def _inputs(ctx: StageContext) -> Any:
    options = ctx.job(GradeOptions)
    plan = ctx.require_plan()
    # a new tier, budget, scenario pack or grade version grades again; the same ones reuse the record
    return {"plan_id": plan.plan_id, **options.to_json(), "grade_version": GRADE_VERSION,
            "scenario_pack_sha256": pack_hash(scenarios_for(options.tier), grade_version=GRADE_VERSION)}


def grade_still_there(graded: GradeResult) -> bool:
    return bool(graded.path) and Path(graded.path).is_file()


def grade_figures(result: GradeResult) -> dict[str, Any]:
    return {"verdict": result.verdict, "stack_problem": result.stack_problem, "passed": result.passed,
            "total": result.total, "tier": result.tier, "path": result.path}


# After re-check, in the session (so it runs on the session load opened, and is reused with it). After
# re-check, not before: a session that does not hold the planned window fails closed there, and
# grading it would only spend minutes on a model that is not provisioned. Its verdict is recorded,
# never raised: see pipeline/auto.py for why a failed grade does not fail ``auto``.
DECLARATION = StageDeclaration(
    GRADE_STAGE, grade_work, deps=("verify", "load", "probe-tool-call", "re-check"), inputs=_inputs,
    session=SERVER_SESSION, decode=GradeResult.decode, still_valid=grade_still_there, figures=grade_figures,
    version=1, result_type=GradeResult, job=GradeOptions())

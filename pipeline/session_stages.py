"""The live session's stages for the engine: load → probe-tool-call → re-check (→ grade with
``hotfit auto --grade``), one adapter each.

They share one running session — a llama-server or an OpenVINO GenAI worker, opened through the
Backend boundary (:mod:`backends.base`) — and the engine skips or runs them together
(``session=SERVER_SESSION``). Each result decodes from its record, so a reused session hands on the
same types a fresh one does; only the live handle (``LoadResult.session``) exists solely in the run
that opened it — and since the session's stages are reused as one, no stage that needs the handle
ever runs against a reused load.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from backends.base import AllocationReport as Report
from backends.llama_server.allocation import AllocationReport
from backends.openvino.allocation import OpenVinoAllocationReport
from core.records import decode_record
from core.log import get_logger
from core.model_files import VerifyResult
from core.plan import Plan
from grading.report import GRADE_VERSION
from grading.scenarios import pack_hash, scenarios_for
from pipeline.engine import Stage, StageContext
from stages.grade import GradeResult, fresh_output_path, grade_session, write_report
from stages.load import LoadResult, model_files, open_session
from stages.plan import PlannedRun
from stages.probe_tool_call import ProbeToolCallResult, probe_tool_call
from stages.recheck import recheck_allocation

log = get_logger()

SESSION_STAGES: tuple[str, ...] = ("load", "probe-tool-call", "re-check")
GRADE_STAGE = "grade"  # after re-check in the same session, only with `auto --grade`
SERVER_SESSION = "llama-server"


@dataclass(frozen=True)
class GradeOptions:
    """``hotfit auto --grade``: which tier, and the budget after which it stops as inconclusive."""

    tier: str = "full"
    budget_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"tier": self.tier, "budget_s": self.budget_s}


@dataclass(frozen=True)
class _TemplateShape:
    kind: str  # backends.llama_server.process.TemplateKind
    path: str | None


@dataclass(frozen=True)
class _LlamaLoadShape:
    """What a llama-server load record must hold (the manifest, the fingerprint and serve read it)."""

    pid: int
    base_url: str
    argv: tuple[str, ...]
    log_path: str
    stderr_path: str
    template: _TemplateShape
    load_seconds: float
    backend: dict[str, Any]  # the binary's to_json()


@dataclass(frozen=True)
class _OpenVinoLoadShape:
    """What an OpenVINO load record must hold; the rest is what the worker reported on opening."""

    pid: int
    config: dict[str, Any]
    backend: dict[str, Any]


def decode_load(record: Mapping[str, Any]) -> LoadResult:
    if "config" in record:  # OpenVINO: every pipeline setting
        decode_record(_OpenVinoLoadShape, {k: record.get(k) for k in ("pid", "config", "backend")})
    else:
        decode_record(_LlamaLoadShape, record)
    return LoadResult(dict(record))


_PROBE_FIELDS = frozenset(f.name for f in dataclasses.fields(ProbeToolCallResult)) - {"backend_facts"}


def decode_probe_call(record: Mapping[str, Any]) -> ProbeToolCallResult:
    if not isinstance(record, Mapping):
        return decode_record(ProbeToolCallResult, record)  # names the problem
    # to_json flattens the backend's own facts (OpenVINO's family, raw text…) into the record
    facts = {k: v for k, v in record.items() if k not in _PROBE_FIELDS}
    known = {k: v for k, v in record.items() if k in _PROBE_FIELDS}
    return decode_record(ProbeToolCallResult, known | {"backend_facts": facts})


def decode_recheck(record: Mapping[str, Any]) -> AllocationReport | OpenVinoAllocationReport:
    if isinstance(record, Mapping) and "opened_n_ctx_per_slot" in record:
        return decode_record(AllocationReport, record)
    return decode_record(OpenVinoAllocationReport, record)


async def _load_stage(ctx: StageContext) -> LoadResult:
    plan = ctx.require_plan()
    files = model_files(ctx.result("verify", VerifyResult))
    binary = ctx.result("plan", PlannedRun).backend  # the plan stage's preflight (None: resolve it now)
    session = await ctx.enter_context(open_session(plan, files, run_dir=ctx.run_dir, settings=ctx.settings,
                                                   binary=binary))
    return LoadResult.opened(session, binary)


def _load_fingerprint(out: Mapping[str, Any]) -> Any:
    # the port, pid and timing change every start; the command line without the port does not
    if "config" in out:  # OpenVINO: every pipeline setting; the pid and timing are volatile
        return {"config": out.get("config")}
    argv = list(out.get("argv") or [])
    if "--port" in argv:
        i = argv.index("--port")
        del argv[i:i + 2]
    return {"argv": argv, "template": out.get("template")}


def _load_figures(result: LoadResult) -> dict[str, Any]:
    return result.live().load_figures()


async def _probe_tool_call_stage(ctx: StageContext) -> ProbeToolCallResult:
    return await probe_tool_call(ctx.result("load", LoadResult).live())


def _probe_call_figures(result: ProbeToolCallResult) -> dict[str, Any]:
    return {"passed": result.verdict.passed, "reason": result.verdict.reason, "tool": result.verdict.tool_name,
            "prompt_tokens_per_s": result.prompt_tokens_per_s,
            "generation_tokens_per_s": result.generation_tokens_per_s}


def _probe_call_fingerprint(out: Mapping[str, Any]) -> Any:
    verdict = out.get("verdict") or {}
    return {"passed": verdict.get("passed"), "template": out.get("template")}


def opened_context_tokens(recheck: Mapping[str, Any]) -> int | None:
    """The window the re-check verified, from either backend's report: llama-server's smallest slot,
    or what OpenVINO's allocated bytes hold."""
    if "opened_n_ctx_per_slot" in recheck:
        slots = recheck.get("opened_n_ctx_per_slot") or []
        return min(slots) if slots else None
    value = recheck.get("opened_context_tokens")
    return int(value) if value is not None else None


async def _recheck_stage(ctx: StageContext) -> Report:
    plan: Plan = ctx.require_plan()
    report = await recheck_allocation(ctx.result("load", LoadResult).live(), plan)
    opened = opened_context_tokens(report.to_json())
    # contenox `auto`: an opened session holding less than half the estimate is worth a warning
    if opened is not None and opened * 2 < plan.hot_context_tokens:
        log.warning("recheck.below_half_estimate", opened_context_tokens=opened,
                    planned_hot_context_tokens=plan.hot_context_tokens)
    return report


def _recheck_figures(report: Report) -> dict[str, Any]:
    data = report.to_json()  # llama-server: the window per slot; OpenVINO: the one window its bytes hold
    opened = list(data["opened_n_ctx_per_slot"]) if "opened_n_ctx_per_slot" in data else data.get("opened_context_tokens")
    return {"verdict": report.verdict, "opened_context_tokens": opened,
            "planned_hot_context_tokens": report.planned_hot_context_tokens,
            "estimated_kv_bytes": report.estimated_kv_bytes, "actual_kv_bytes": report.actual_kv_bytes,
            "ratio": round(report.ratio, 6) if report.ratio is not None else None}


async def _grade_stage(ctx: StageContext, options: GradeOptions) -> GradeResult:
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


def _grade_inputs(options: GradeOptions) -> Any:
    def inputs(ctx: StageContext) -> Any:
        plan = ctx.require_plan()
        # a new tier, budget, scenario pack or grade version grades again; the same ones reuse the record
        return {"plan_id": plan.plan_id, **options.to_json(), "grade_version": GRADE_VERSION,
                "scenario_pack_sha256": pack_hash(scenarios_for(options.tier), grade_version=GRADE_VERSION)}
    return inputs


def _grade_still_there(graded: GradeResult) -> bool:
    return bool(graded.path) and Path(graded.path).is_file()


def _grade_figures(result: GradeResult) -> dict[str, Any]:
    return {"verdict": result.verdict, "stack_problem": result.stack_problem, "passed": result.passed,
            "total": result.total, "tier": result.tier, "path": result.path}


def grade_stage(options: GradeOptions) -> Stage[GradeResult]:
    """The grade after re-check, in the session (so it runs on the session load opened, and is
    reused with it). After re-check, not before: a session that does not hold the planned window
    fails closed there, and grading it would only spend minutes on a model that is not provisioned.
    Its verdict is recorded, never raised: see :mod:`pipeline.auto` for why a failed grade does
    not fail ``auto``."""
    return Stage(GRADE_STAGE, functools.partial(_grade_stage, options=options),
                 deps=("verify", "load", "probe-tool-call", "re-check"), inputs=_grade_inputs(options),
                 session=SERVER_SESSION, decode=GradeResult.decode, still_valid=_grade_still_there,
                 figures=_grade_figures)


def session_stages() -> list[Stage[Any]]:
    """load → probe-tool-call → re-check, skipped or run as one. load starts the binary the plan
    stage's preflight found (its ``PlannedRun``), without looking again."""
    return [
        Stage("load", _load_stage, deps=("verify",), session=SERVER_SESSION, decode=decode_load,
              fingerprint=_load_fingerprint, figures=_load_figures),
        Stage("probe-tool-call", _probe_tool_call_stage, deps=("load",), session=SERVER_SESSION,
              decode=decode_probe_call, fingerprint=_probe_call_fingerprint, figures=_probe_call_figures),
        Stage("re-check", _recheck_stage, deps=("load", "probe-tool-call"), session=SERVER_SESSION,
              decode=decode_recheck, figures=_recheck_figures),
    ]

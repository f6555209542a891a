"""re-check hot allocation: what the opened session really holds.

Spec ("Selection and hot context"): after download and a tool-call check, setup reads the opened
session's hot allocation; an earlier estimate is not treated as a verified allocation. The reading
and its judgement against the plan are the backend's
(:meth:`backends.base.Session.allocation_report`: llama-server's ``/props``, ``/slots`` and KV log
records in :mod:`backends.llama_server.allocation`; OpenVINO's metrics after the first step and the
IR's KV geometry in :mod:`backends.openvino.allocation`). This stage fails closed on any problem
(:class:`AllocationMismatch`: a window below the plan or the agentic floor, KV bytes above the
estimate, another cache type or precision, an accelerator plan with KV on the host, an allocation
that cannot be read), writes ``recheck.json`` and logs the verdict.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from hotfit.backends.base import KV_EXCESS_TOLERANCE, KV_SHORTFALL_WARN_RATIO, AllocationReport, Session
from hotfit.backends.select import BACKENDS, backend_for
from hotfit.core.errors import AllocationMismatch, StageRecordError
from hotfit.core.log import get_logger
from hotfit.planner.plan import Plan
from hotfit.registry.select import MIN_AGENTIC_HOT_CONTEXT
from hotfit.stages.declaration import StageContext, StageDeclaration
from hotfit.stages.load import SERVER_SESSION, LoadResult

__all__ = [
    "KV_EXCESS_TOLERANCE",
    "KV_SHORTFALL_WARN_RATIO",
    "MIN_AGENTIC_HOT_CONTEXT",
    "RECHECK_FILE",
    "DECLARATION",
    "decode_recheck",
    "recheck_allocation",
]

log = get_logger()

RECHECK_FILE = "recheck.json"
RECHECK_TIMEOUT_S = 30.0


async def recheck_allocation(
    session: Session,
    plan: Plan | None = None,
    *,
    timeout_s: float = RECHECK_TIMEOUT_S,
    tolerance: float = KV_EXCESS_TOLERANCE,
    floor_tokens: int = MIN_AGENTIC_HOT_CONTEXT,
) -> AllocationReport:
    """Judge what ``session`` allocated against ``plan`` (default: the plan it was opened with);
    write ``recheck.json`` to the run directory; raise :class:`AllocationMismatch` on any problem."""
    plan = plan or session.plan
    report = await session.allocation_report(plan, floor_tokens=floor_tokens, tolerance=tolerance,
                                             timeout_s=timeout_s)
    path = session.run_dir / RECHECK_FILE
    path.write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
    facts = report.event_facts()
    for w in report.warnings:
        log.warning(report.warning_event(w), detail=w, **facts)
    if report.problems:
        log.error("recheck.failed", problems=list(report.problems), **facts)
        raise AllocationMismatch(
            f"the opened {session.server_name} session does not hold what was planned: " + "; ".join(report.problems),
            hint=("hotfit will not hand over a session it cannot verify; re-plan against the memory "
                  f"free now (`hotfit plan`), and see {path} and the {session.server_name} log {session.log_path}"),
            **report.to_json(),
        )
    log.info("recheck.passed", **facts)
    return report


# --------------------------------------------------------------------------- the stage


def decode_recheck_for_plan(record: Mapping[str, Any], plan: Plan) -> AllocationReport:
    """The re-check's record back, as the plan's backend writes its report."""
    return backend_for(plan.backend).decode_allocation(record)


def decode_recheck(record: Mapping[str, Any]) -> AllocationReport:
    """The re-check's record back without the plan (tests, tools): the report of the backend whose
    decoder takes it; when none does, the error that names a damaged field (its backend knew the
    record's keys), else the first."""
    errors: list[StageRecordError] = []
    for backend in BACKENDS.values():
        try:
            return backend.decode_allocation(record)
        except StageRecordError as exc:
            errors.append(exc)
    raise next((e for e in errors if e.details.get("field")), errors[0])


async def recheck_work(ctx: StageContext) -> AllocationReport:
    plan = ctx.require_plan()
    report = await recheck_allocation(ctx.result("load", LoadResult).live(), plan)
    opened = report.opened_context_tokens
    # contenox `auto`: an opened session holding less than half the estimate is worth a warning
    if opened is not None and opened * 2 < plan.hot_context_tokens:
        log.warning("recheck.below_half_estimate", opened_context_tokens=opened,
                    planned_hot_context_tokens=plan.hot_context_tokens)
    return report


def recheck_figures(report: AllocationReport) -> dict[str, Any]:
    return {"verdict": report.verdict, "opened_context_tokens": report.opened_figure(),
            "planned_hot_context_tokens": report.planned_hot_context_tokens,
            "estimated_kv_bytes": report.estimated_kv_bytes, "actual_kv_bytes": report.actual_kv_bytes,
            "ratio": round(report.ratio, 6) if report.ratio is not None else None}


# No fingerprint of its own: nothing downstream but the grade, which hashes the whole report.
DECLARATION = StageDeclaration(
    "re-check", recheck_work, deps=("load", "probe-tool-call"), session=SERVER_SESSION, decode=decode_recheck,
    decode_for_plan=decode_recheck_for_plan, figures=recheck_figures, version=1, result_type=AllocationReport)

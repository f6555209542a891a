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

from backends.base import KV_EXCESS_TOLERANCE, KV_SHORTFALL_WARN_RATIO, AllocationReport, Session
from core.errors import AllocationMismatch
from core.log import get_logger
from core.plan import Plan
from registry.select import MIN_AGENTIC_HOT_CONTEXT

__all__ = [
    "KV_EXCESS_TOLERANCE",
    "KV_SHORTFALL_WARN_RATIO",
    "MIN_AGENTIC_HOT_CONTEXT",
    "RECHECK_FILE",
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

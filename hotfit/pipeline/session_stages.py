"""The live session's stages in order: load → probe-tool-call → re-check (→ grade with
``hotfit auto --grade``).

They share one running session — a llama-server or an OpenVINO GenAI worker, opened through the
Backend boundary (:mod:`backends.base`) — and the engine skips or runs them together (their
declarations name ``session=SERVER_SESSION``). Each stage declares itself, decoder included, in its
``stages/<name>.py``; only the live handle (``LoadResult.session``) exists solely in the run that
opened it — and since the session's stages are reused as one, no stage that needs the handle ever
runs against a reused load.
"""

from __future__ import annotations

from typing import Any

from hotfit.pipeline.engine import Stage
from hotfit.stages import grade, load, probe_tool_call, recheck
from hotfit.stages.grade import GRADE_STAGE, GradeOptions, GradeResult
from hotfit.stages.load import SERVER_SESSION

__all__ = ["GRADE_STAGE", "SERVER_SESSION", "SESSION_STAGES", "GradeOptions", "grade_stage", "session_stages"]

SESSION_STAGES: tuple[str, ...] = ("load", "probe-tool-call", "re-check")


def grade_stage(options: GradeOptions) -> Stage[GradeResult]:
    """The grade after re-check, in the session, for ``options`` (stages/grade.py says why there)."""
    return grade.DECLARATION.with_job(options)


def session_stages() -> list[Stage[Any]]:
    """load → probe-tool-call → re-check, skipped or run as one. load starts the binary the plan
    stage's preflight found (its ``PlannedRun``), without looking again."""
    return [load.DECLARATION, probe_tool_call.DECLARATION, recheck.DECLARATION]

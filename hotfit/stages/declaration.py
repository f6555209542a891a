"""What a stage declares beside its work, and the context the work receives.

Each ``stages/<name>.py`` exports one :class:`StageDeclaration` (``DECLARATION``): the stage's name,
its work (an async function of a :class:`StageContext`), its result type, the decoder that turns
its record in ``state.db`` back into that type, the reuse check, the fingerprint downstream stages
hash, the figures of ``stage.done`` and a ``version``. The engine (:mod:`pipeline.engine`) runs
declarations; :mod:`pipeline.provision` and :mod:`pipeline.session_stages` only put them in order
(CONTRIBUTING.md, "Adding a stage").

Both types live here, in stages/, because stages/ may not import pipeline/ (the layers contract in
``pyproject.toml``) and they are about stages, not about the leaves in core/; the engine imports
them from here. Nothing here does anything: types only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager as AsyncContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from hotfit.planner.plan import Plan
from hotfit.core.settings import Settings

__all__ = ["EnterContext", "StageContext", "StageDeclaration", "to_json"]

T = TypeVar("T")
R = TypeVar("R")


class EnterContext(Protocol):
    """Enter an async context manager for the rest of the pipeline (closed when it ends, fails or is
    interrupted) and return what it yields: how load keeps its server up for the later stages."""

    def __call__(self, cm: AsyncContextManager[T], /) -> Awaitable[T]: ...


class StageContext(Protocol):
    """What a stage's work, its ``inputs`` and its job see of the run (read-only)."""

    @property
    def run_id(self) -> str: ...

    @property
    def run_dir(self) -> Path: ...

    @property
    def settings(self) -> Settings: ...

    @property
    def plan(self) -> Plan | None: ...  # set once the plan stage has run

    @property
    def results(self) -> Mapping[str, object]: ...  # stage name -> frozen result of an earlier stage

    @property
    def enter_context(self) -> EnterContext: ...

    def result(self, stage: str, kind: type[T]) -> T:
        """The result of an earlier ``stage``, which is a ``kind`` whether it ran or was reused."""
        ...

    def require_plan(self) -> Plan: ...

    def job(self, kind: type[T]) -> T:
        """What this run asked of the stage (its declaration's ``job``), which is a ``kind``."""
        ...


def to_json(result: Any) -> dict[str, Any] | None:
    """A result's record: its ``to_json()`` (a plain mapping as it is; None for no result)."""
    if result is None:
        return None
    if isinstance(result, Mapping):
        return dict(result)
    out: dict[str, Any] = result.to_json()
    return out


@dataclass(frozen=True)
class StageDeclaration(Generic[R]):
    """One stage, declared with its work. Only ``name`` and ``fn`` are needed to run; a stage of
    stages/ declares the rest too (tests/test_stage_declarations.py checks)."""

    name: str
    fn: Callable[[StageContext], Awaitable[R]]  # the stage's work
    deps: tuple[str, ...] = ()  # stages whose outputs are this stage's inputs
    # Extra inputs; default is the plan id (so a new plan re-runs the stage).
    inputs: Callable[[StageContext], Any] | None = None
    always_run: bool = False  # probe and plan: cheap, and the world may have changed
    session: str | None = None  # stages sharing a live resource: skipped or run as one
    # recorded outputs -> the result a fresh run returns (StageRecordError when damaged). None: the
    # stage's result is plain JSON, handed on as a read-only mapping either way.
    decode: Callable[[Mapping[str, Any]], R] | None = None
    # is a reused record's result still valid on disk? Handed the decoded result (one decode per
    # record per run), or the read-only mapping when the stage has no decoder.
    still_valid: Callable[[R], bool] | None = None
    encode: Callable[[R], dict[str, Any] | None] = to_json
    figures: Callable[[R], dict[str, Any]] | None = None  # key figures for stage.done
    # What downstream stages hash of this stage's result (default: its whole record). Lets volatile
    # facts (bytes transferred this run, a server's port) stay out of the inputs downstream.
    fingerprint: Callable[[R], Any] | None = None
    # The plan stage only: the Plan in its result, which later stages read as ``ctx.plan`` (None:
    # the result is the plan itself). Lets the stage hand more than the plan (its backend preflight).
    plan_of: Callable[[R], Plan] | None = None
    # Bumped when the result or its record changes: a record of another version is never reused
    # (it is part of the inputs hash). Records written before versions existed are version 1.
    version: int = 1
    result_type: type | None = None  # what ``fn`` returns and ``decode`` rebuilds
    # A decoder for a record whose shape is the plan's backend's (load, re-check); used instead of
    # ``decode`` once the plan is known.
    decode_for_plan: Callable[[Mapping[str, Any], Plan], R] | None = None
    job: object | None = None  # what this run asks of the stage (read through ``ctx.job``)

    def with_job(self, job: object) -> StageDeclaration[R]:
        """This stage, run for ``job`` (a fetch for a named entry, a grade tier, …)."""
        return replace(self, job=job)

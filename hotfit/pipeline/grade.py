"""The ``hotfit grade`` job for a model of this home: the provisioned one, or a named,
already pulled and verified one, opened through the same Backend as load and serve.

- no ``--model``: the manifest's plan and verified files, as ``hotfit serve`` reads them; the verdict
  is written back into the manifest (if it still names the same provisioning);
- ``--model NAME``: re-planned on this machine the way ``hotfit plan --model NAME`` does (probe → plan,
  nothing written), then the files in place re-confirmed from their verification receipts (nothing is
  downloaded: a model not pulled is refused naming ``hotfit pull NAME``).

Either way it runs through the pipeline's engine, ephemerally (nothing in ``state.db``, as ``auto
--dry-run``): [probe → plan →] grade-target → load → grade. The target stage is this command's own
(the manifest, or the pulled files; then the backend's preflight), load is ``hotfit auto``'s load
stage handed that target (:class:`stages.load.LoadJob`), and the grade stage grades the session
through ``session.chat_endpoint()`` (:func:`stages.grade.grade_session`); the engine always stops
the session. The home lock is held throughout, so a grade never loads a second model beside a
running ``hotfit auto`` nor rewrites the manifest under it (a second one exits 6 naming the holder).
The outcome then updates the grade evidence (:func:`pipeline.evidence.record_grade`): a FULL-tier
pass of a tool-chat model is recorded for ``--admit-graded``, a fail removes it.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from hotfit.backends.base import ModelFiles
from hotfit.backends.select import endpoint_at
from hotfit.core.entry import Entry
from hotfit.core.errors import UsageError
from hotfit.core.log import get_logger
from hotfit.core.settings import Settings
from hotfit.pipeline.engine import Runner, Stage, StageContext
from hotfit.pipeline.evidence import record_grade
from hotfit.pipeline.manifest import Manifest, grade_summary, plan_from_json, read_manifest, write_manifest
from hotfit.pipeline.provision import AutoOptions, planning_stages
from hotfit.planner.plan import Plan
from hotfit.stages import load
from hotfit.stages.grade import (
    GRADE_STAGE,
    GradeOptions,
    default_output_path,
    fresh_output_path,
    grade_endpoint,
    grade_session,
    write_report,
)
from hotfit.stages.load import LoadJob, LoadResult, OpenTarget, model_files, preflight
from hotfit.stages.plan import PlannedRun
from hotfit.stages.verify import verify
from hotfit.state.locks import FileLock

__all__ = ["TARGET_STAGE", "GradeTarget", "grade_model", "grade_server", "grade_stages"]

log = get_logger()

TARGET_STAGE = "grade-target"  # the engine's plan stage here: its result carries the plan load opens


@dataclass(frozen=True)
class GradeTarget(OpenTarget):
    """The model to grade: its plan, what load opens (files, the preflight's binary, the session's
    directory) and what is known of the files; ``ready_s``: when it was ready to open (monotonic
    seconds), from which the report's ``load_and_grade_wall_s`` counts."""

    plan: Plan
    model_sha256: str | None
    template_sha256: str | None
    manifest: Manifest | None  # set when grading the provisioned model (its verdict is written back)
    ready_s: float

    def to_json(self) -> dict[str, Any]:
        return {"model": self.plan.entry.name, "plan_id": self.plan.plan_id, "weights": str(self.files.weights),
                "provisioned": self.manifest is not None}


async def _ready(ctx: StageContext, plan: Plan, files: ModelFiles, model_sha256: str | None,
                 template_sha256: str | None, manifest: Manifest | None) -> GradeTarget:
    """The target once the backend's preflight found what serves ``plan``."""
    binary = await anyio.to_thread.run_sync(preflight, plan, ctx.settings)
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    run_dir = ctx.settings.runs_dir / f"grade-{stamp}-{plan.entry.name}"
    return GradeTarget(files, binary, run_dir, plan, model_sha256, template_sha256, manifest, time.monotonic())


async def _provisioned(ctx: StageContext) -> GradeTarget:
    settings = ctx.settings
    manifest = read_manifest(settings.manifest_path, strict=True)
    if manifest is None:
        raise UsageError(f"nothing is provisioned under {settings.home}, so there is no model to grade",
                         hint="run `hotfit auto` first, grade a pulled model with `hotfit grade --model NAME`, or a "
                              "running server with `hotfit grade --endpoint URL`")
    problems = manifest.files_in_place()
    if problems:
        raise UsageError(f"the provisioned files are not in place: {'; '.join(problems)}",
                         hint="run `hotfit auto` again; it re-fetches what is missing")
    plan = plan_from_json(manifest.plan, source=f"manifest {settings.manifest_path}")
    files = ModelFiles(Path(manifest.model_path), Path(manifest.template_path) if manifest.template_path else None)
    return await _ready(ctx, plan, files, manifest.model_sha256, manifest.template_sha256, manifest)


def _not_pulled(entry: Entry, settings: Settings) -> str | None:
    """Why ``entry`` has nothing in place to grade (None: something is; verify judges it)."""
    dest = settings.model_dir(entry.name)
    artifact = entry.artifact
    if artifact is None:
        return f"registry entry {entry.name} has no artifact"
    if artifact.file is None:  # a snapshot (OpenVINO): its directory
        return None if dest.is_dir() and any(dest.iterdir()) else f"nothing is pulled into {dest}"
    return None if (dest / artifact.file).is_file() else f"{dest / artifact.file} is not there"


async def _named(ctx: StageContext) -> GradeTarget:
    # the plan stage decided the window and device exactly as `hotfit plan --model NAME` would (exit 3
    # when it cannot open its window here); nothing is fetched
    plan = ctx.result("plan", PlannedRun).plan
    missing = _not_pulled(plan.entry, ctx.settings)
    if missing:
        name = plan.entry.name
        raise UsageError(f"model {name} is not pulled: {missing}",
                         hint=f"run `hotfit pull {name}` first (grade never downloads)", model=name)
    verified = await verify(plan.entry, ctx.settings.model_dir(plan.entry.name))  # receipts; IntegrityError when damaged
    return await _ready(ctx, plan, model_files(verified), verified.sha256, None, None)


def _target_plan(target: GradeTarget) -> Plan:
    return target.plan


def _target_stage(work: Callable[[StageContext], Awaitable[GradeTarget]]) -> Stage[GradeTarget]:
    return Stage(TARGET_STAGE, work, always_run=True, plan_of=_target_plan, result_type=GradeTarget)


@dataclass(frozen=True)
class GradedModel:
    """The grade stage's result: the whole report (transcripts included), written after the session stops."""

    report: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        v, score = self.report["verdict"], self.report["score"]
        return {"verdict": v["verdict"], "tier": self.report["tier"], **score}


async def _grade(ctx: StageContext) -> GradedModel:
    options = ctx.job(GradeOptions)
    target = ctx.result(TARGET_STAGE, GradeTarget)
    session = ctx.result("load", LoadResult).live()
    name = target.plan.entry.name
    report = await grade_session(
        session, label=f"model {name} ({session.server_name})", tier=options.tier, budget_s=options.budget_s,
        known={"model": name, "model_path": str(target.files.weights), "model_sha256": target.model_sha256,
               "chat_template_sha256": target.template_sha256})
    return GradedModel({**report, "model": name, "provisioned": target.manifest is not None,
                        "load_and_grade_wall_s": round(time.monotonic() - target.ready_s, 3)})


def grade_stages(model: str | None, options: GradeOptions, *, registry_file: Path | None,
                 probe_file: Path | None) -> list[Stage[Any]]:
    """[probe → plan →] grade-target → load → grade: ``model`` None grades the provisioned model."""
    planning = (planning_stages(AutoOptions(model=model, registry_file=registry_file, probe_file=probe_file),
                                check_backend=False) if model else [])
    return [*planning, _target_stage(_named if model else _provisioned),
            load.DECLARATION.with_job(LoadJob(TARGET_STAGE)),
            Stage(GRADE_STAGE, _grade, deps=(TARGET_STAGE, "load"), session=load.SERVER_SESSION,
                  result_type=GradedModel, job=options)]


async def grade_model(settings: Settings, *, model: str | None, registry_file: Path | None, tier: str,
                      budget_s: float | None, output: Path | None, probe_file: Path | None = None) -> dict[str, Any]:
    """Open the model, grade it, write the record (and the manifest's grade); return the report."""
    async with FileLock(settings.lock_path, wait=False, what=f"hotfit home {settings.home}").async_held():
        stages = grade_stages(model, GradeOptions(tier, budget_s), registry_file=registry_file,
                              probe_file=probe_file)
        outcome = await Runner(stages, None, settings, handle_signals=False, plan_stage=TARGET_STAGE).run()
        target = outcome.result(TARGET_STAGE, GradeTarget)
        plan = target.plan
        report = dict(outcome.result(GRADE_STAGE, GradedModel).report)
        path = output or fresh_output_path(settings.home, tier)
        report = {**report, "output": str(path)}
        try:
            await anyio.to_thread.run_sync(write_report, report, path)
        except OSError as exc:
            raise UsageError(f"cannot write the grade record to {path}: {exc.strerror}",
                             hint="pass a writable --output FILE") from None
        if target.manifest is not None:
            _record_in_manifest(settings, target.manifest, report, path)
        # a full-tier pass of a tool-chat model is evidence `--admit-graded` may count; a fail withdraws it
        v, score = report["verdict"], report["score"]
        evidence = await anyio.to_thread.run_sync(lambda: record_grade(
            settings, plan.entry, plan.placement.device.kind,
            {"verdict": v["verdict"], "tier": report["tier"], **score, "fingerprint": report["fingerprint"]},
            grade_record=str(path)))
        return {**report, "evidence": evidence}


def _api_key(path: str | None) -> str | None:
    if not path:
        return None
    try:
        lines = [ln.strip() for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]
    except OSError as exc:
        raise UsageError(f"cannot read --api-key-file {path}: {exc.strerror}",
                         hint="give a readable file whose first line is the API key") from None
    if not lines:
        raise UsageError(f"--api-key-file {path} is empty", hint="put the server's API key on its first line")
    return lines[0]


async def grade_server(settings: Settings, url: str, *, api_key_file: str | None, tier: str, budget_s: float | None,
                       output: Path | None) -> dict[str, Any]:
    """The ``hotfit grade --endpoint URL`` job: grade a server already running, whatever it is (an
    OpenAI-compatible endpoint, :func:`backends.select.endpoint_at`), and write the record to
    ``output`` (default: under ``<home>/grades/``). Returns the report with its ``output``."""
    api_key = _api_key(api_key_file)
    output = output or default_output_path(settings.home, tier)
    async with endpoint_at(url, api_key=api_key) as endpoint:
        report = await grade_endpoint(endpoint, endpoint_label=url, tier=tier, budget_s=budget_s)
    try:
        write_report({**report, "output": str(output)}, output)
    except OSError as exc:
        raise UsageError(f"cannot write the grade record to {output}: {exc.strerror}",
                         hint="pass a writable --output FILE") from None
    return {**report, "output": str(output)}


def _record_in_manifest(settings: Settings, graded: Manifest, report: dict[str, Any], path: Path) -> None:
    current = read_manifest(settings.manifest_path)
    if current is None or current.run_id != graded.run_id:  # cannot happen under the home lock; be safe
        log.warning("grade.manifest_changed", path=str(settings.manifest_path))
        return
    v, score = report["verdict"], report["score"]
    summary = grade_summary({**v, **score, "tier": report["tier"], "categories": report["categories"],
                             "speeds": report["speeds"], "fingerprint": report["fingerprint"], "path": str(path)},
                            run_id=None)
    write_manifest(settings.manifest_path, _with_grade(current, summary))
    log.info("manifest.written", path=str(settings.manifest_path), model=current.entry_name, grade=v["verdict"])


def _with_grade(manifest: Manifest, grade: dict[str, Any]) -> Manifest:
    return dataclasses.replace(manifest, grade=grade)

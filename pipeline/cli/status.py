"""hotfit status: each stage's state for the current run, the provisioned model, what a rerun would do.

Read-only: it never takes the pipeline lock (it reads who holds it) and reads the WAL database
while ``hotfit auto`` may be writing it.

Its exit code is an alerting check's answer: 0, or :data:`LAST_RUN_FAILED` (10) when the last
``hotfit auto`` failed or was interrupted — as ``<home>/metrics/last-run.json`` records it, or as
``state.db`` shows a run killed before it could record itself (docs/operations.md).
"""

from __future__ import annotations

import argparse
import datetime
import os
from typing import Any

from pipeline.cli.context import CliContext
from core.errors import UsageError
from pipeline.evidence import evidence_status
from pipeline.manifest import Manifest, read_manifest
from pipeline.metrics import read_last_run
from pipeline.registry_file import load_registry
from state.locks import read_holder
from state.store import RunRecord, StageRecord, SyncStateStore


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("status", parents=parents, help="show stage state and the provisioned model",
                       description="Each stage's state for the current run, the provisioned model, "
                                   "and what a rerun of `hotfit auto` would do.")
    p.add_argument("--registry", metavar="FILE",
                   help="registry whose tool-chat models' grade evidence is shown (default: the bundled one)")
    p.set_defaults(handler=handler)


LAST_RUN_FAILED = 10  # status: the last `hotfit auto` did not succeed (README exit codes)


def last_run_failed(last: dict[str, Any] | None, run: RunRecord | None, effective_status: str | None) -> bool:
    """Pure: did the last ``hotfit auto`` fail? Its own record says so; a state.db run that started
    after that record and ended failed or interrupted (killed before it could record) says so too."""
    failed = last is not None and last.get("exit_code") != 0
    if run is not None and effective_status in ("failed", "interrupted"):
        recorded_at = last.get("finished_at") if last is not None else None
        if not isinstance(recorded_at, (int, float)) or run.started_at > recorded_at:
            failed = True
    return failed


def _pid_alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lock_state(ctx: CliContext) -> dict[str, Any]:
    path = ctx.settings.lock_path
    if not path.exists():
        return {"held": False}
    holder = read_holder(path)  # the file is emptied on release; a dead PID is a kill -9 leftover
    if holder.pid is not None and holder.pid != os.getpid() and _pid_alive(holder.pid):
        return {"held": True, "holder_pid": holder.pid, "holder_command": holder.command}
    return {"held": False}


def rerun_would(run: RunRecord | None, stages: list[StageRecord], manifest_ok: bool,
                lock: dict[str, Any]) -> str:
    """Pure: one sentence on what `hotfit auto` would do now."""
    if lock.get("held"):
        return (f"another hotfit (PID {lock['holder_pid']}) is running on this home: a rerun exits "
                "with code 6, or queues behind it with --wait")
    if run is None:
        return "a fresh run: probe, plan, fetch-weights, fetch-template, verify, load, probe-tool-call, re-check"
    if run.status == "done" and manifest_ok:
        return ("nothing, if the probe still finds room for the provisioned model (a fast no-op, exit 0); "
                "--recheck re-runs load, probe-tool-call and re-check; --refresh selects afresh")
    reusable = [s.stage for s in stages if s.status in ("done", "skipped")]
    pending = [s.stage for s in stages if s.status not in ("done", "skipped")]
    if not pending:
        return "a new run that re-uses every stage whose inputs are unchanged"
    first = pending[0]
    if manifest_ok:
        return (f"nothing, if the provisioned model still holds (a fast no-op); otherwise resume run "
                f"{run.run_id} at {first}, re-using {', '.join(reusable) or 'nothing'} when unchanged")
    return (f"resume run {run.run_id} at {first} (it is {next(s.status for s in stages if s.stage == first)}); "
            f"re-use {', '.join(reusable) or 'nothing'} when their inputs are unchanged; partial downloads "
            "continue from their bytes on disk")


def last_grade(manifest: Manifest | None) -> dict[str, Any] | None:
    """The provisioned model's last grade, as the manifest keeps it (None: never graded)."""
    g = manifest.grade if manifest is not None else None
    if not g:
        return None
    return {"model": manifest.entry_name if manifest else None, "verdict": g.get("verdict"),
            "passed": g.get("passed"), "total": g.get("total"), "fraction": g.get("fraction"),
            "tier": g.get("tier"), "provisional": g.get("provisional"), "stack_problem": g.get("stack_problem"),
            "graded_at": g.get("graded_at"), "path": g.get("path")}


def evidence_lines(evidence: dict[str, Any]) -> list[str]:
    lines = [f"grade evidence ({evidence['path']}):"]
    if evidence["problem"]:
        return [*lines, f"  problem: {evidence['problem']}"]
    held = [m for m in evidence["models"] if m["status"] != "none"]
    for m in held:
        e = m["evidence"]
        what = (f"valid: full tier {e['passed']}/{e['total']}, {e['graded_at']}" if m["status"] == "valid"
                else f"{m['status']}: {m['reason']}")
        lines.append(f"  {m['model']:<28} {m['device_kind']:<8} {what}")
    others = sorted({m["model"] for m in evidence["models"]} - {m["model"] for m in held})
    if others:
        lines.append(f"  no evidence: {', '.join(others)} (tool-chat: curation-only until a full-tier grade passes)")
    return lines


def handler(args: argparse.Namespace, ctx: CliContext) -> int:
    settings = ctx.settings
    run: RunRecord | None = None
    stages: list[StageRecord] = []
    if settings.state_db.exists():
        store = SyncStateStore(settings.state_db, lock_path=settings.lock_path)
        try:
            run = store.latest_run()
            stages = store.stages(run.run_id) if run else []
        finally:
            store.close()
    try:
        manifest = read_manifest(settings.manifest_path, strict=True)
        problems = manifest.files_in_place() if manifest else []
    except UsageError as exc:  # a damaged manifest.json: say so (auto provisions again)
        manifest, problems = None, [exc.what]
    lock = lock_state(ctx)
    # A run still 'running' with nobody holding the lock was killed (kill -9, power cut).
    effective_status = run.status if run else None
    if run and run.status == "running" and not lock.get("held"):
        effective_status = "interrupted"
    rerun = rerun_would(run, stages, manifest is not None and not problems, lock)
    grade = last_grade(manifest)
    last = read_last_run(settings)
    failed = last_run_failed(last, run, effective_status)
    kinds = [str(manifest.device.get("kind"))] if manifest is not None and manifest.device.get("kind") else []
    evidence = evidence_status(settings, load_registry(args.registry).entries, kinds)
    data = {
        "home": str(settings.home),
        "lock": lock,
        "run": ({**run.to_json(), "status": effective_status} if run else None),
        "stages": [s.to_json() for s in stages],
        "provisioned": manifest.to_json() if manifest else None,
        "provisioned_problems": problems,
        "rerun": rerun,
        "last_grade": grade,
        "grade_evidence": evidence,
        "last_auto": last,
        "last_auto_failed": failed,
    }
    lines = [f"home: {settings.home}"]
    if lock.get("held"):
        lines.append(f"lock: held by PID {lock['holder_pid']} ({lock['holder_command']})")
    if run is None:
        lines.append("no run yet")
    else:
        lines.append(f"run {run.run_id}: {effective_status}" + (f" (plan {run.plan_id})" if run.plan_id else ""))
        for s in stages:
            status = "interrupted" if s.status == "running" and not lock.get("held") else s.status
            detail = ""
            if s.error and s.status in ("failed", "interrupted"):
                detail = f" — {s.error.get('message', '')}".splitlines()[0]
            attempts = f" ×{s.attempts}" if s.attempts > 1 else ""
            lines.append(f"  {s.stage:<16} {status}{attempts}{detail}")
    if manifest:
        opened = manifest.opened_context_tokens
        lines.append(
            f"provisioned: {manifest.entry_name} ({manifest.kv_cache_type} KV, "
            f"{opened if opened is not None else '?'} tokens opened at verification) → {manifest.model_path}"
        )
        lines += [f"  problem: {p}" for p in problems]
        if grade is not None:
            lines.append(f"  last grade: {str(grade['verdict']).upper()} {grade['passed']}/{grade['total']} "
                         f"({grade['tier']} tier) at {grade['graded_at']}"
                         + (f", {grade['stack_problem']}" if grade["stack_problem"] else "") + f" → {grade['path']}")
        if manifest.extra.get("admitted_by_grade"):
            lines.append("  admitted by grade (--admit-graded): tool-chat, selected on its grade evidence")
    else:
        lines.append("provisioned: nothing yet")
        lines += [f"  problem: {p}" for p in problems]
    lines += evidence_lines(evidence)
    if last is not None:
        error = last.get("error") or {}
        lines.append(f"last auto: {last.get('outcome')} (exit {last.get('exit_code')}) at "
                     f"{_when(last.get('finished_at'))}" + (f": {str(error.get('message', '')).splitlines()[0]}"
                                                            if error.get("message") else ""))
    lines.append(f"a rerun would: {rerun}")
    ctx.emit(data, "\n".join(lines))
    return LAST_RUN_FAILED if failed else 0


def _when(timestamp: Any) -> str:
    if not isinstance(timestamp, (int, float)):
        return "?"
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

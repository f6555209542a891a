"""hotfit status: each stage's state for the current run, the provisioned model, what a rerun would do.

Read-only: it never takes the pipeline lock (it reads who holds it) and reads the WAL database
while ``hotfit auto`` may be writing it.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from pipeline.cli.context import CliContext
from core.errors import UsageError
from pipeline.manifest import read_manifest
from state.locks import read_holder
from state.store import RunRecord, StageRecord, SyncStateStore


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("status", parents=parents, help="show stage state and the provisioned model",
                       description="Each stage's state for the current run, the provisioned model, "
                                   "and what a rerun of `hotfit auto` would do.")
    p.set_defaults(handler=handler)


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
    data = {
        "home": str(settings.home),
        "lock": lock,
        "run": ({**run.to_json(), "status": effective_status} if run else None),
        "stages": [s.to_json() for s in stages],
        "provisioned": manifest.to_json() if manifest else None,
        "provisioned_problems": problems,
        "rerun": rerun,
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
    else:
        lines.append("provisioned: nothing yet")
        lines += [f"  problem: {p}" for p in problems]
    lines.append(f"a rerun would: {rerun}")
    ctx.emit(data, "\n".join(lines))
    return 0

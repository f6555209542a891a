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
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipeline.cli.context import CliContext
from core.errors import UsageError
from pipeline.evidence import evidence_status
from pipeline.manifest import Manifest, read_manifest
from pipeline.metrics import read_last_run
from pipeline.registry_file import load_registry
from state.files import write_text_atomic
from state.locks import current_holder
from state.store import RunRecord, StageRecord, SyncStateStore


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("status", parents=parents, help="show stage state and the provisioned model",
                       description="Each stage's state for the current run, the provisioned model, "
                                   "and what a rerun of `hotfit auto` would do.")
    p.add_argument("--registry", metavar="FILE",
                   help="registry whose tool-chat models' grade evidence is shown (default: the bundled one)")
    p.add_argument("--nfd-features", metavar="FILE",
                   help="also write the provisioned model as Node Feature Discovery labels to FILE "
                        "(e.g. /etc/kubernetes/node-feature-discovery/features.d/hotfit), atomically")
    p.set_defaults(handler=handler)


LAST_RUN_FAILED = 10  # status: the last `hotfit auto` did not succeed (README exit codes)


def last_run_failed(last: dict[str, Any] | None, run: RunRecord | None, effective_status: str | None) -> bool:
    """Pure: did the last ``hotfit auto`` fail? Its own record says so; a state.db run that started
    after that record and ended failed or interrupted (killed before it could record) says so too."""
    failed = last is not None and last.get("exit_code") != 0
    if run is not None and effective_status in ("failed", "interrupted"):
        recorded_at = last.get("finished_at") if last is not None else None
        # a start time that did not read back (a damaged record) cannot clear the failure
        if not isinstance(recorded_at, (int, float)) or run.started_at is None or run.started_at > recorded_at:
            failed = True
    return failed


# Node Feature Discovery's local source reads `name=value` lines from features.d files; a
# namespaced name is published as is (docs/recipes.md, "Kubernetes").
NFD_PREFIX = "hotfit.io/"
_LABEL_VALUE_MAX = 63  # a Kubernetes label value: at most 63 characters,
_LABEL_BAD = re.compile(r"[^A-Za-z0-9._-]+")  # of these, starting and ending alphanumeric


def label_value(text: str) -> str:
    """Pure: ``text`` as a valid Kubernetes label value (other characters become '-')."""
    value = _LABEL_BAD.sub("-", text)[:_LABEL_VALUE_MAX]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)


def nfd_labels(manifest: Manifest | None, problems: list[str]) -> dict[str, str]:
    """Pure: the node labels for what is provisioned. Nothing usable → only ``provisioned=false``,
    so NFD drops the model labels a previous write published."""
    if manifest is None or problems:
        return {f"{NFD_PREFIX}provisioned": "false"}
    context = manifest.opened_context_tokens or manifest.planned_hot_context_tokens
    labels = {
        "provisioned": "true",
        "model": label_value(manifest.entry_name),
        "context": str(context),
        "kv-type": label_value(manifest.kv_cache_type),
        "backend": label_value(manifest.backend),
    }
    kind = manifest.device.get("kind")
    if kind:
        labels["device"] = label_value(str(kind))
    return {NFD_PREFIX + k: v for k, v in labels.items()}


def nfd_features_text(labels: dict[str, str]) -> str:
    return "# written by `hotfit status --nfd-features` (docs/recipes.md)\n" + "".join(
        f"{k}={v}\n" for k, v in labels.items())


def write_nfd_features(path: Path, labels: dict[str, str]) -> None:
    """Atomically (NFD's worker may read the file at any moment), naming the file on failure."""
    try:
        write_text_atomic(path, nfd_features_text(labels))
    except OSError as exc:
        raise UsageError(f"cannot write the NFD features file {path}: {exc.strerror or exc}",
                         hint="point --nfd-features at a writable file, e.g. under "
                              "/etc/kubernetes/node-feature-discovery/features.d/") from None


def lock_state(ctx: CliContext) -> dict[str, Any]:
    path = ctx.settings.lock_path
    if not path.exists():
        return {"held": False}
    # The file is emptied on release; after a kill -9 it names a PID that no longer holds the lock.
    holder = current_holder(path)
    if holder is not None:
        return {"held": True, "holder_pid": holder.pid, "holder_command": holder.command}
    return {"held": False}


def effective_stages(stages: list[StageRecord], lock: dict[str, Any]) -> list[StageRecord]:
    """A 'running' record with no live pipeline behind it was killed (kill -9, power cut): it is
    interrupted, as the next run will record it."""
    if lock.get("held"):
        return stages
    return [replace(s, status="interrupted") if s.status == "running" else s for s in stages]


def damaged_note(columns: tuple[str, ...]) -> str:
    """What a record that did not read back says in the human view (a rerun redoes such a stage)."""
    return f" [damaged record: {', '.join(columns)} unreadable]" if columns else ""


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
    shown = effective_stages(stages, lock)  # the JSON keeps the raw records; the run's status is effective
    rerun = rerun_would(run, shown, manifest is not None and not problems, lock)
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
        lines.append(f"run {run.run_id}: {effective_status}" + (f" (plan {run.plan_id})" if run.plan_id else "")
                     + damaged_note(run.damaged))
        for s in shown:
            detail = ""
            if s.error and s.status in ("failed", "interrupted"):
                detail = f" — {s.error.get('message', '')}".splitlines()[0]
            attempts = f" ×{s.attempts}" if s.attempts > 1 else ""
            lines.append(f"  {s.stage:<16} {s.status}{attempts}{detail}{damaged_note(s.damaged)}")
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
    if args.nfd_features:
        labels = nfd_labels(manifest, problems)
        write_nfd_features(Path(args.nfd_features), labels)
        data["nfd_features"] = {"path": str(Path(args.nfd_features).absolute()), "labels": labels}
        lines.append(f"NFD labels written to {args.nfd_features}: "
                     + " ".join(f"{k}={v}" for k, v in labels.items()))
    ctx.emit(data, "\n".join(lines))
    return LAST_RUN_FAILED if failed else 0


def _when(timestamp: Any) -> str:
    if not isinstance(timestamp, (int, float)):
        return "?"
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

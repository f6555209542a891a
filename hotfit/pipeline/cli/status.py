"""hotfit status: each stage's state for the current run, the provisioned model, what a rerun would do
(the job: :mod:`pipeline.status`).

Its exit code is an alerting check's answer: 0, or :data:`LAST_RUN_FAILED` (10) when the last
``hotfit auto`` failed or was interrupted — as ``<home>/metrics/last-run.json`` records it, or as
``state.db`` shows a run killed before it could record itself (docs/operations.md).
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path
from typing import Any

from hotfit.pipeline.cli.context import CliContext
from hotfit.pipeline.cli.render import speed_lines
from hotfit.pipeline.status import Status, read_status


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("status", parents=parents, help="show stage state and the provisioned model",
                       description="Each stage's state for the current run, the provisioned model, "
                                   "and what a rerun of `hotfit auto` would do.")
    p.add_argument("--registry", metavar="FILE",
                   help="registry whose tool-chat models' grade evidence is shown (default: the bundled one)")
    p.add_argument("--nfd-features", metavar="FILE",
                   help="also write the provisioned model as Node Feature Discovery labels to FILE "
                        "(e.g. /etc/kubernetes/node-feature-discovery/features.d/hotfit), atomically")
    p.set_defaults(handler=handler, reads_home_only=True)  # it reads a read-only home too (the CLI: _main)


LAST_RUN_FAILED = 10  # status: the last `hotfit auto` did not succeed (README exit codes)


def damaged_note(columns: tuple[str, ...]) -> str:
    """What a record that did not read back says in the human view (a rerun redoes such a stage)."""
    return f" [damaged record: {', '.join(columns)} unreadable]" if columns else ""


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
    status = read_status(ctx.settings, registry_file=args.registry,
                         nfd_features=Path(args.nfd_features) if args.nfd_features else None)
    ctx.emit(status.to_json(), status_text(status, nfd_file=args.nfd_features))
    return LAST_RUN_FAILED if status.failed else 0


def status_text(status: Status, *, nfd_file: str | None = None) -> str:
    """The human view of ``hotfit status`` (``nfd_file``: --nfd-features as given)."""
    run, lock, manifest, grade, last = status.run, status.lock, status.manifest, status.grade, status.last
    lines = [f"home: {status.home}"]
    if lock.get("held"):
        lines.append(f"lock: held by PID {lock['holder_pid']} ({lock['holder_command']})")
    if run is None:
        lines.append("no run yet")
    else:
        lines.append(f"run {run.run_id}: {status.effective_status}" + (f" (plan {run.plan_id})" if run.plan_id else "")
                     + damaged_note(run.damaged))
        for s in status.shown:
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
        lines += [f"  problem: {p}" for p in status.problems]
        lines += speed_lines(manifest.plan.get("speed_predicted") if manifest.plan else None, manifest.speed)
        if grade is not None:
            lines.append(f"  last grade: {str(grade['verdict']).upper()} {grade['passed']}/{grade['total']} "
                         f"({grade['tier']} tier) at {grade['graded_at']}"
                         + (f", {grade['stack_problem']}" if grade["stack_problem"] else "") + f" → {grade['path']}")
        if manifest.extra.get("admitted_by_grade"):
            lines.append("  admitted by grade (--admit-graded): tool-chat, selected on its grade evidence")
    else:
        lines.append("provisioned: nothing yet")
        lines += [f"  problem: {p}" for p in status.problems]
    lines += evidence_lines(status.evidence)
    if last is not None:
        error = last.get("error") or {}
        lines.append(f"last auto: {last.get('outcome')} (exit {last.get('exit_code')}) at "
                     f"{_when(last.get('finished_at'))}" + (f": {str(error.get('message', '')).splitlines()[0]}"
                                                            if error.get("message") else ""))
    lines.append(f"a rerun would: {status.rerun}")
    if status.nfd is not None:
        lines.append(f"NFD labels written to {nfd_file}: "
                     + " ".join(f"{k}={v}" for k, v in status.nfd["labels"].items()))
    return "\n".join(lines)


def _when(timestamp: Any) -> str:
    if not isinstance(timestamp, (int, float)):
        return "?"
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

"""The ``hotfit status`` job: each stage's state for the current run, the provisioned model, what a
rerun would do, the grade evidence and the last ``hotfit auto`` — read, never changed (but the
``--nfd-features`` file it is asked to write).

Read-only: it never takes the pipeline lock (it reads who holds it) and reads the WAL database
while ``hotfit auto`` may be writing it.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hotfit.core.errors import UsageError
from hotfit.core.settings import Settings
from hotfit.pipeline.evidence import evidence_status
from hotfit.pipeline.manifest import Manifest, read_manifest
from hotfit.pipeline.metrics import read_last_run
from hotfit.pipeline.registry_file import load_registry
from hotfit.pipeline.worker import read_worker_record, stale_reason
from hotfit.state.files import write_text_atomic
from hotfit.state.locks import current_holder
from hotfit.state.store import RunRecord, StageRecord, SyncStateStore

__all__ = ["Status", "label_value", "last_run_failed", "nfd_labels", "read_status", "rerun_would"]


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


def lock_state(settings: Settings) -> dict[str, Any]:
    path = settings.lock_path
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


@dataclass(frozen=True)
class Status:
    """What ``hotfit status`` reports (:meth:`to_json` is its ``--json`` document)."""

    home: Path
    lock: dict[str, Any]
    run: RunRecord | None
    effective_status: str | None  # a 'running' run nobody holds the lock for was killed: interrupted
    stages: list[StageRecord]  # as recorded
    shown: list[StageRecord]  # as they are: a 'running' stage with no live pipeline behind it is interrupted
    manifest: Manifest | None
    problems: list[str]
    rerun: str
    grade: dict[str, Any] | None
    evidence: dict[str, Any]
    last: dict[str, Any] | None
    failed: bool  # the last `hotfit auto` failed or was interrupted
    nfd: dict[str, Any] | None = None  # --nfd-features: the file written and its labels
    serving: dict[str, Any] | None = None  # the last `hotfit serve`'s record (serve.pid), alive or not

    def to_json(self) -> dict[str, Any]:
        run = self.run
        data = {
            "home": str(self.home),
            "lock": self.lock,
            "run": ({**run.to_json(), "status": self.effective_status} if run else None),
            "stages": [s.to_json() for s in self.stages],
            "provisioned": self.manifest.to_json() if self.manifest else None,
            "provisioned_problems": self.problems,
            "rerun": self.rerun,
            "last_grade": self.grade,
            "grade_evidence": self.evidence,
            "last_auto": self.last,
            "last_auto_failed": self.failed,
            "serving": self.serving,
        }
        return data | ({"nfd_features": self.nfd} if self.nfd is not None else {})


def read_status(settings: Settings, *, registry_file: str | None, nfd_features: Path | None) -> Status:
    """Read the state database, the lock, the manifest, the evidence and the last run's metrics; with
    ``nfd_features``, also write the provisioned model's node labels there (atomically)."""
    run: RunRecord | None = None
    stages: list[StageRecord] = []
    if settings.state_db.exists():
        # read-only: status writes nothing, and must read a home whose filesystem turned read-only
        store = SyncStateStore(settings.state_db, lock_path=settings.lock_path, read_only=True)
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
    lock = lock_state(settings)
    # A run still 'running' with nobody holding the lock was killed (kill -9, power cut).
    effective_status = run.status if run else None
    if run and run.status == "running" and not lock.get("held"):
        effective_status = "interrupted"
    shown = effective_stages(stages, lock)  # the JSON keeps the raw records; the run's status is effective
    rerun = rerun_would(run, shown, manifest is not None and not problems, lock)
    last = read_last_run(settings)
    failed = last_run_failed(last, run, effective_status)
    kinds = [str(manifest.device.get("kind"))] if manifest is not None and manifest.device.get("kind") else []
    evidence = evidence_status(settings, load_registry(registry_file).entries, kinds)
    nfd = None
    if nfd_features is not None:
        labels = nfd_labels(manifest, problems)
        write_nfd_features(nfd_features, labels)
        nfd = {"path": str(nfd_features.absolute()), "labels": labels}
    return Status(home=settings.home, lock=lock, run=run, effective_status=effective_status, stages=stages,
                  shown=shown, manifest=manifest, problems=problems, rerun=rerun, grade=last_grade(manifest),
                  evidence=evidence, last=last, failed=failed, nfd=nfd,
                  serving=serving_state(settings, manifest))


def serving_state(settings: Settings, manifest: Manifest | None) -> dict[str, Any] | None:
    """How the last `hotfit serve` listens (its serve.pid record), the machine's name for a server
    on every address, and whether that process still serves the provisioned model — what `hotfit
    fleet endpoints` reads (pipeline.endpoints). None: serve never ran here."""
    record = read_worker_record(settings.serve_pid_path)
    if record is None:
        return None
    why = stale_reason(record, manifest) if manifest is not None else "nothing is provisioned"
    return {"host": record.host, "port": record.port, "api_key_file": record.api_key_file,
            "model": record.entry_name, "context_tokens": record.context_tokens,
            "kv_cache_type": record.kv_cache_type, "machine": socket.getfqdn(), "alive": why is None,
            "not_serving_because": why}

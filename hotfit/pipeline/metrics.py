"""What the last ``hotfit auto`` did, for an operator's Prometheus and for ``hotfit status``.

After every ``hotfit auto`` (success, no-op or failure; not ``--dry-run``, which changes nothing)
the CLI writes two small files, each atomically (a temporary file renamed over the old one, so a
scraper never reads half of one):

- ``<home>/metrics/hotfit.prom``, in Prometheus' text exposition format, and a copy in
  node_exporter's textfile-collector directory when ``HOTFIT_TEXTFILE_DIR`` names one, under a
  name of this home's own (``hotfit-<home id>.prom``), every sample labelled with the home: homes
  sharing that directory write distinct files with distinct label sets, as the collector requires;
  a directory that does not exist is not created (node_exporter's package makes it, so a missing
  one is a typo) and is reported;
- ``<home>/metrics/last-run.json``: the exit code and error of that run, which ``hotfit status``
  turns into its own exit code (10 when the last run failed).

The run's own figures (stage durations, bytes downloaded) come from the events it emitted
(:func:`core.log.events_seen`, names in docs/events.md), so the metrics and the log never disagree;
the provisioned model's figures come from ``manifest.json``. Metric names and labels:
docs/operations.md.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hotfit.core.errors import HotfitError
from hotfit.core.settings import Settings
from hotfit.pipeline.manifest import Manifest, read_manifest
from hotfit.state.files import write_text_atomic

TEXTFILE_NAME = "hotfit.prom"
LAST_RUN_NAME = "last-run.json"
INTERRUPTED_EXIT = 130
# Events whose ``bytes_transferred`` are bytes fetched over the network by this run (one per file
# or snapshot, written once it is complete and verified).
_DOWNLOAD_EVENTS = ("fetch.done", "fetch.snapshot_done")
_STAGE_END_EVENTS = ("stage.done", "stage.fail", "stage.interrupted")


@dataclass(frozen=True)
class LastRun:
    """One ``hotfit auto`` as the metrics describe it (built by :func:`last_run` from its events)."""

    exit_code: int
    outcome: str  # provisioned | noop | failed | interrupted
    started_at: float
    finished_at: float
    error: Mapping[str, Any] | None = None  # HotfitError.to_json() of a failure
    model: str | None = None  # what the run planned (or kept, for a no-op)
    run_id: str | None = None  # state.db run (None: a no-op or a failure before one began)
    downloaded_bytes: int = 0
    stage_seconds: Mapping[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"command": "auto", "exit_code": self.exit_code, "outcome": self.outcome,
                "started_at": self.started_at, "finished_at": self.finished_at,
                "duration_s": round(self.finished_at - self.started_at, 3), "model": self.model,
                "run_id": self.run_id, "downloaded_bytes": self.downloaded_bytes,
                "stage_seconds": dict(self.stage_seconds), "error": dict(self.error) if self.error else None}


def last_run(exit_code: int, error: Mapping[str, Any] | None, events: Iterable[Mapping[str, Any]], *,
             started_at: float, finished_at: float) -> LastRun:
    """Pure: the run's facts from its exit code, its error and the events it emitted."""
    model: str | None = None
    run_id: str | None = None
    noop = False
    downloaded = 0
    stages: dict[str, float] = {}
    for event in events:
        name = event.get("event")
        run_id = event.get("run_id") or run_id
        if name == "run.noop":
            noop, model = True, event.get("model") or model
        elif name in _STAGE_END_EVENTS and event.get("stage"):
            stages[str(event["stage"])] = float(event.get("duration_s") or 0.0)
            if name == "stage.done" and event.get("stage") == "plan" and event.get("model"):
                model = str(event["model"])
        elif name == "stage.skip" and event.get("stage"):
            stages[str(event["stage"])] = 0.0
        elif name in _DOWNLOAD_EVENTS:
            downloaded += int(event.get("bytes_transferred") or 0)
        elif name == "manifest.written":
            model = event.get("model") or model
    if exit_code == 0:
        outcome = "noop" if noop else "provisioned"
    else:
        outcome = "interrupted" if exit_code == INTERRUPTED_EXIT else "failed"
    return LastRun(exit_code=exit_code, outcome=outcome, started_at=started_at, finished_at=finished_at,
                   error=error, model=model, run_id=run_id, downloaded_bytes=downloaded, stage_seconds=stages)


def _label(value: Any) -> str:
    text = "" if value is None else str(value)
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float | int) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    return "NaN" if math.isnan(value) else repr(float(value))


class _Exposition:
    """Prometheus text format: one HELP/TYPE block per metric family, then its samples, each sample
    with the ``common`` labels first."""

    def __init__(self, common: Mapping[str, str]) -> None:
        self.lines: list[str] = []
        self.common = dict(common)

    def gauge(self, name: str, help_text: str, samples: Sequence[tuple[Mapping[str, Any], Any]]) -> None:
        # a figure the manifest lacks (or holds as something else) is left out, not written as 0
        shown = [(labels, value) for labels, value in samples if isinstance(value, (int, float))]
        if not shown:
            return
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        for labels, value in shown:
            assert value is not None
            inner = ",".join(f'{k}="{_label(v)}"' for k, v in (self.common | dict(labels)).items())
            self.lines.append(f"{name}{{{inner}}} {_number(value)}" if inner else f"{name} {_number(value)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render(run: LastRun, manifest: Manifest | None, home: str | None = None) -> str:
    """Pure: the textfile for ``run`` and the standing provisioning ``manifest`` (None: nothing provisioned);
    with ``home``, every sample carries it as the ``home`` label (see :func:`home_identity`)."""
    x = _Exposition({"home": home} if home is not None else {})
    x.gauge("hotfit_last_run_timestamp_seconds", "When the last hotfit auto ended (Unix time).",
            [({}, round(run.finished_at, 3))])
    x.gauge("hotfit_last_run_duration_seconds", "How long the last hotfit auto took.",
            [({}, round(run.finished_at - run.started_at, 3))])
    x.gauge("hotfit_last_run_exit_code", "Exit code of the last hotfit auto (0 success; README exit codes).",
            [({}, run.exit_code)])
    x.gauge("hotfit_last_run_success", "1 if the last hotfit auto exited 0 (provisioned or no-op), else 0.",
            [({}, int(run.exit_code == 0))])
    x.gauge("hotfit_last_run_info", "The last hotfit auto: outcome (provisioned, noop, failed, interrupted), "
            "error code, and the model it planned or kept.",
            [({"outcome": run.outcome, "error_code": (run.error or {}).get("code", ""), "model": run.model or ""}, 1)])
    x.gauge("hotfit_last_run_downloaded_bytes", "Bytes the last hotfit auto downloaded (completed files).",
            [({}, run.downloaded_bytes)])
    x.gauge("hotfit_last_run_stage_duration_seconds",
            "Seconds each stage of the last hotfit auto took (0: reused from an earlier run).",
            [({"stage": stage}, round(seconds, 3)) for stage, seconds in run.stage_seconds.items()])
    x.gauge("hotfit_provisioned", "1 if a provisioning stands (manifest.json), else 0.", [({}, int(manifest is not None))])
    if manifest is not None:
        measured = manifest.measured
        x.gauge("hotfit_provisioned_info", "The provisioned model, its backend, KV cache type and device kind.",
                [({"model": manifest.entry_name, "backend": manifest.backend, "kv_cache_type": manifest.kv_cache_type,
                   "device_kind": manifest.device.get("kind") or ""}, 1)])
        x.gauge("hotfit_provisioned_planned_context_tokens", "Hot context the plan chose, in tokens.",
                [({}, manifest.planned_hot_context_tokens)])
        x.gauge("hotfit_provisioned_opened_context_tokens", "Context the verified session opened, in tokens.",
                [({}, manifest.opened_context_tokens)])
        x.gauge("hotfit_provisioned_kv_estimated_bytes", "KV cache bytes the plan estimated for the window.",
                [({}, measured.get("estimated_kv_bytes"))])
        x.gauge("hotfit_provisioned_kv_actual_bytes", "KV cache bytes the opened session allocated (re-check).",
                [({}, measured.get("actual_kv_bytes"))])
        x.gauge("hotfit_provisioned_written_timestamp_seconds", "When the standing provisioning was written.",
                [({}, _timestamp(manifest.written_at))])
        predicted = (manifest.plan or {}).get("speed_predicted")
        if isinstance(predicted, Mapping):
            x.gauge("hotfit_provisioned_speed_predicted", "The plan's predicted speed for an agent prompt of "
                    "prompt_tokens (registry/speed.py): prefill and generation tokens/s, first-token seconds.",
                    [({"figure": k, "prompt_tokens": predicted.get("prompt_tokens")}, predicted.get(k))
                     for k in ("prefill_tokens_per_s", "decode_tokens_per_s", "first_token_s")])
        speed = manifest.speed or {}
        seen = speed.get("measured")
        if isinstance(seen, Mapping):
            x.gauge("hotfit_provisioned_speed_measured", "The opened session's measured speed on an agent-sized "
                    "prompt (measure-speed): prefill and generation tokens/s, first-token seconds.",
                    [({"figure": k, "prompt_tokens": seen.get("prompt_tokens")}, seen.get(k))
                     for k in ("prefill_tokens_per_s", "decode_tokens_per_s", "first_token_s",
                               "follow_up_first_token_s")])
            x.gauge("hotfit_provisioned_speed_ratio", "Predicted / measured speed, per figure.",
                    [({"figure": k}, v) for k, v in (speed.get("ratio") or {}).items()])
        grade = manifest.grade or {}
        if grade:
            x.gauge("hotfit_grade_info", "The provisioned model's last multi-turn tool-use grade: verdict and tier.",
                    [({"verdict": grade.get("verdict") or "", "tier": grade.get("tier") or ""}, 1)])
            x.gauge("hotfit_grade_score_ratio", "Fraction of grade scenarios passed (0 to 1).",
                    [({}, grade.get("fraction"))])
            x.gauge("hotfit_grade_passed_scenarios", "Grade scenarios passed.", [({}, grade.get("passed"))])
            x.gauge("hotfit_grade_scenarios", "Grade scenarios run.", [({}, grade.get("total"))])
    return x.text()


def _timestamp(iso: str | None) -> float | None:
    if not iso:
        return None
    from datetime import datetime

    try:
        return round(datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp(), 3)
    except ValueError:
        return None


def home_identity(settings: Settings) -> str:
    """The home as the ``home`` label names it: its real absolute path (a home reached through a
    symlink is the same home)."""
    return os.path.realpath(settings.home)


def shared_textfile_name(settings: Settings) -> str:
    """This home's file in node_exporter's shared directory: ``hotfit-<12 hex digits>.prom``, the start
    of the sha256 of :func:`home_identity` (a path may hold anything, a file name may not)."""
    digest = hashlib.sha256(home_identity(settings).encode("utf-8", "surrogateescape")).hexdigest()
    return f"hotfit-{digest[:12]}.prom"


def _missing_textfile_dir(where: Path) -> OSError | None:
    """HOTFIT_TEXTFILE_DIR when it is not an existing directory: never created here, since node_exporter's
    package creates the real one and a missing one is most likely a typo (docs/operations.md, "Metrics")."""
    if where.is_dir():
        return None
    what = "is not a directory" if where.exists() else "does not exist"
    return OSError(errno.ENOTDIR if where.exists() else errno.ENOENT,
                   f"HOTFIT_TEXTFILE_DIR={where} {what}; hotfit does not create it (node_exporter's package does): "
                   "correct the path, or create the directory node_exporter's --collector.textfile.directory names")


def record_run(settings: Settings, run: LastRun) -> list[tuple[Path, str]]:
    """Write the textfile(s) and last-run.json atomically; the paths that could not be written, each
    with why.

    Not durable (no fsync): a power cut loses at most the last run's figures, and the run that
    follows writes them again; the rename still keeps a reader from seeing half a file. A path that
    cannot be written — a full disk (DiskSpaceError), a read-only one, a ``HOTFIT_TEXTFILE_DIR``
    that is a file (the path check's UsageError) — never changes the run's exit code
    (docs/operations.md, "Metrics"): it is returned, and the others are still written.
    """
    text = render(run, read_manifest(settings.manifest_path), home_identity(settings))
    failed: list[tuple[Path, str]] = []
    writes = [(settings.metrics_dir / LAST_RUN_NAME, json.dumps(run.to_json(), indent=2, default=str) + "\n")]
    writes += [(settings.metrics_dir / TEXTFILE_NAME, text)]
    if settings.textfile_dir is not None:
        shared = settings.textfile_dir / shared_textfile_name(settings)
        missing = _missing_textfile_dir(settings.textfile_dir)
        if missing is None:
            writes.append((shared, text))
        else:
            failed.append((shared, missing.strerror or str(missing)))
    for path, content in writes:
        try:
            write_text_atomic(path, content, durable=False, what="the metrics file")
        except HotfitError as exc:  # the writer's own mapping: disk full, not a directory, a symlink
            failed.append((path, exc.what))
        except OSError as exc:
            failed.append((path, f"{exc.strerror or exc} ({errno.errorcode.get(exc.errno or 0, exc.errno)})"))
    return failed


def read_last_run(settings: Settings) -> dict[str, Any] | None:
    """``last-run.json`` as written (None: no ``hotfit auto`` yet, or the file is unreadable)."""
    try:
        data = json.loads((settings.metrics_dir / LAST_RUN_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("exit_code"), int) else None

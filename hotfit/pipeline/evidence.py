"""Earning a place by grade: record a grade's evidence, and check it before the planner
may count it.

The effectful side of :mod:`state.evidence` (the file and its pure rules) — the selector stays pure
and only takes the admitted names (``registry.select.select_auto(admitted=...)``):

- :func:`record_grade` runs after every grade of a model of this home (``hotfit grade``, ``auto
  --grade``): a FULL-tier pass of a tool-chat llama-server model writes its evidence with the
  fingerprint of what was graded; a fail removes it; a quick-tier pass never counts (docs/grade.md,
  "Earning a place") and an inconclusive grade (a stack problem, not the model) changes nothing.
- :func:`admission` (``plan``/``auto --admit-graded``) recomputes, for each probed device, the
  fingerprint of what would be served now — the weights' receipt sha256, the chat template's sha256,
  the llama-server build found now for that device (build facts and the binary's sha256), this
  hotfit's grade version and full scenario pack — and admits an entry only when it is the one its
  evidence was graded under; otherwise it says which part changed.

Why the binary's sha256 besides build-info.json: a rebuild of the same llama.cpp version (other flags,
another compiler) is another build, and greedy decoding is only reproducible on the same one (§4.10).
An OpenVINO snapshot has no single model sha256 (verify records per-file hashes), so OpenVINO grades
are not recorded as evidence.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

from hotfit.backends.base import BuildUnavailable
from hotfit.backends.select import backend_for
from hotfit.core.entry import Entry
from hotfit.core.errors import UsageError
from hotfit.core.log import get_logger
from hotfit.core.model_files import TEMPLATE_FILENAME
from hotfit.planner.probe import ProbeResult
from hotfit.core.settings import Settings
from hotfit.grading.report import GRADE_VERSION
from hotfit.grading.scenarios import FULL, pack_hash, scenarios_for
from hotfit.pipeline.manifest import utc_now_iso
from hotfit.planner.devices import Admission
from hotfit.state.evidence import (
    AgenticEvidence,
    EvidenceFile,
    GradeFingerprint,
    evidence_path,
    read_evidence_file,
    stale_reason,
    write_evidence_file,
)
from hotfit.state.receipts import read_receipt, receipt_matches

__all__ = ["ADMIT_FLAG", "admission", "backend_build", "current_fingerprint", "evidence_status", "record_grade"]

ADMIT_FLAG = "--admit-graded"

log = get_logger()


class EvidenceUnavailable(Exception):
    """Internal signal, never raised to the operator: a fingerprint part cannot be read now; ``what``
    is the reason ``plan --json`` and ``hotfit status`` report."""

    def __init__(self, what: str, *, hint: str | None = None) -> None:
        super().__init__(what)
        self.what = what
        self.hint = hint


def backend_build(entry: Entry, device_kind: str, settings: Settings) -> tuple[str, str]:
    """(identity, description) of the build that would serve ``entry`` on a ``device_kind`` device now,
    asked of its backend (for llama-server: the binary the load stage would start, its build facts
    and bytes)."""
    try:
        return backend_for(entry.backend).grade_build(entry, device_kind, settings)
    except BuildUnavailable as exc:
        raise EvidenceUnavailable(exc.what, hint=exc.hint) from None


def _model_sha256(entry: Entry, settings: Settings) -> str:
    artifact = entry.artifact
    if artifact is None or artifact.file is None:
        raise EvidenceUnavailable(f"{entry.name} has no single weights file (no artifact pinned, or a snapshot)")
    dest = settings.model_dir(entry.name)
    receipt = read_receipt(dest, artifact.file)
    if not receipt_matches(receipt, artifact, dest / artifact.file):
        raise EvidenceUnavailable(f"no verified {artifact.file} for the registry's pin is in place under {dest}",
                                  hint=f"run `hotfit pull {entry.name}` (then grade it again if the file changed)")
    assert receipt is not None and receipt.sha256 is not None  # receipt_matches vouches for it
    return receipt.sha256


def _template_sha256(entry: Entry, settings: Settings) -> str | None:
    if entry.chat_template is None:
        return None  # the GGUF's own template: part of the model's sha256
    path = settings.model_dir(entry.name) / TEMPLATE_FILENAME
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()  # a few KiB: hashed, not trusted by receipt
    except OSError as exc:
        raise EvidenceUnavailable(f"the chat template {path} cannot be read ({exc.strerror})",
                                  hint=f"run `hotfit pull {entry.name}`") from None


def current_fingerprint(entry: Entry, device_kind: str, settings: Settings) -> GradeFingerprint:
    """The fingerprint a FULL grade of ``entry`` on a ``device_kind`` device would have now; raises
    :class:`EvidenceUnavailable` naming the part that cannot be read."""
    build, described = backend_build(entry, device_kind, settings)
    return GradeFingerprint(
        model_sha256=_model_sha256(entry, settings), template_sha256=_template_sha256(entry, settings),
        backend_build=build, backend_build_described=described, grade_version=GRADE_VERSION,
        scenario_pack_sha256=pack_hash(scenarios_for(FULL), grade_version=GRADE_VERSION))


def _read(settings: Settings, *, strict: bool) -> EvidenceFile:
    path = evidence_path(settings.home)
    try:
        return read_evidence_file(path)
    except UsageError as exc:
        if strict:
            raise
        log.warning("evidence.damaged", path=str(path), error=exc.to_json())  # rewritten from scratch
        return EvidenceFile()


def record_grade(settings: Settings, entry: Entry, device_kind: str, grade: Mapping[str, Any], *,
                 grade_record: str) -> dict[str, Any]:
    """Update the evidence after a grade of ``entry`` (``grade``: verdict, tier, passed, total,
    fraction, fingerprint — a report's or a grade stage record's summary). Returns what happened, for
    the report: ``{"recorded": bool, "removed": bool, "why": ..., "path": ..., "evidence": ...}``."""
    path = evidence_path(settings.home)
    verdict, tier = grade.get("verdict"), grade.get("tier")
    out: dict[str, Any] = {"recorded": False, "removed": False, "path": str(path), "evidence": None}

    def done(why: str, **extra: Any) -> dict[str, Any]:
        result = {**out, **extra, "why": why}
        log.info("grade.evidence", model=entry.name, device_kind=device_kind, recorded=result["recorded"],
                 removed=result["removed"], why=why)
        return result

    if verdict == "fail":
        current = _read(settings, strict=False)
        if current.find(entry.name, device_kind) is None:
            return done("a failed grade is never evidence")
        write_evidence_file(path, current.without(entry.name, device_kind))
        return done("a failed grade removes the model's evidence", removed=True)
    if verdict != "pass":
        return done("an inconclusive grade names a stack problem, not the model: the evidence is unchanged")
    if tier != FULL:
        return done(f"a {tier}-tier pass is provisional: only a full-tier pass can admit a model "
                    f"(`hotfit grade --tier full`)")
    if entry.agentic_tier != "tool-chat":
        return done(f"{entry.name} is {entry.agentic_tier} by curation: grade evidence only admits tool-chat models")
    try:
        now = current_fingerprint(entry, device_kind, settings)
    except EvidenceUnavailable as exc:
        return done(f"not recorded: {exc.what}")
    graded = grade.get("fingerprint") or {}
    for key in ("model_sha256", "grade_version", "scenario_pack_sha256"):
        if graded.get(key) != getattr(now, key):  # the files changed under the grade: cannot vouch for them
            return done(f"not recorded: the graded {key} {graded.get(key)!r} is not the one in place now")
    evidence = AgenticEvidence(
        model=entry.name, device_kind=device_kind, verdict="pass", tier=FULL, passed=int(grade["passed"]),
        total=int(grade["total"]), fraction=float(grade["fraction"]), graded_at=utc_now_iso(),
        grade_record=grade_record, fingerprint=now)
    write_evidence_file(path, _read(settings, strict=False).with_evidence(evidence))
    return done(f"a full-tier pass: {entry.name} may be selected automatically with {ADMIT_FLAG} while this "
                "fingerprint holds", recorded=True, evidence=evidence.to_json())


def _judge(item: AgenticEvidence | None, entry: Entry, device_kind: str, settings: Settings,
           builds: dict[tuple[str, str], Any]) -> tuple[str, str | None]:
    """(status, reason): "valid"; "stale" (a part changed); "unusable" (a part cannot be read); "none"."""
    if item is None:
        return "none", f"no full-tier pass of {entry.name} on a {device_kind} device is recorded"
    key = (entry.name, device_kind)
    if key not in builds:
        try:
            builds[key] = current_fingerprint(entry, device_kind, settings)
        except EvidenceUnavailable as exc:
            builds[key] = exc
    now = builds[key]
    if isinstance(now, EvidenceUnavailable):
        return "unusable", f"evidence unusable: {now.what}"
    reason = stale_reason(item.fingerprint, now)
    return ("stale", reason) if reason else ("valid", None)


def admission(settings: Settings, entries: Iterable[Entry], probe: ProbeResult) -> Admission:
    """``--admit-graded``: for each probed device, the tool-chat entries whose evidence holds now.
    A damaged evidence file is the UsageError naming it (the operator asked for it to count)."""
    evidence = _read(settings, strict=True)
    tool_chat = [e for e in entries if e.agentic_tier == "tool-chat"]
    builds: dict[tuple[str, str], Any] = {}
    admitted: dict[int, frozenset[str]] = {}
    report: list[dict[str, Any]] = []
    for device in probe.devices:
        names: set[str] = set()
        for entry in tool_chat:
            item = evidence.find(entry.name, device.kind)
            if item is None:
                continue  # only models with evidence are reported; the rest stay curation-only
            status, reason = _judge(item, entry, device.kind, settings, builds)
            if status == "valid":
                names.add(entry.name)
            report.append({"model": entry.name, "device_index": device.index, "device_kind": device.kind,
                           "status": status, "reason": reason, "evidence": item.to_json()})
            log.info("plan.evidence", model=entry.name, device_index=device.index, status=status, reason=reason)
        admitted[device.index] = frozenset(names)
    return Admission(admitted=admitted, report=tuple(report), evidence_file=str(evidence_path(settings.home)))


def evidence_status(settings: Settings, entries: Iterable[Entry], device_kinds: Iterable[str]) -> dict[str, Any]:
    """``hotfit status``: per tool-chat model, whether it holds valid evidence on each device kind
    (never raises: a damaged file is reported as such)."""
    path = evidence_path(settings.home)
    try:
        evidence = read_evidence_file(path)
    except UsageError as exc:
        return {"path": str(path), "problem": exc.what, "models": []}
    builds: dict[tuple[str, str], Any] = {}
    models: list[dict[str, Any]] = []
    for entry in (e for e in entries if e.agentic_tier == "tool-chat"):
        kinds = sorted({*device_kinds, *(x.device_kind for x in evidence.for_model(entry.name))})
        if not kinds:  # nothing provisioned, nothing graded: no device to name
            models.append({"model": entry.name, "device_kind": None, "status": "none", "reason": None,
                           "evidence": None})
        for kind in kinds:
            item = evidence.find(entry.name, kind)
            status, reason = _judge(item, entry, kind, settings, builds) if item else ("none", None)
            models.append({"model": entry.name, "device_kind": kind, "status": status, "reason": reason,
                           "evidence": None if item is None else item.to_json()})
    return {"path": str(path), "problem": None, "models": models}

"""Grade evidence: the file that lets a tool-chat model earn its place, with its one decoder.

``<home>/grades/evidence.json`` (``schema`` 1) holds one :class:`AgenticEvidence` per (model, device
kind): a passing FULL-tier grade of that model run on this machine, with the fingerprint it was
graded under — model sha256 (its verification receipt), chat template sha256,
backend build, grade version, scenario-pack hash. The planner's caller (``--admit-graded``) counts it
only while the fingerprint of what would be served *now* is the same (:func:`stale_reason`); a quick
tier pass is never written (§4.13: only a full-tier pass counts), a failed grade removes the entry.

Pure apart from :func:`read_evidence_file` / :func:`write_evidence_file`. A damaged file is a
UsageError naming the file and the field (:func:`decode_evidence_file`), never a traceback.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from hotfit.core.errors import HotfitError, UsageError
from hotfit.core.records import Fields, parse_json
from hotfit.state.files import read_text_document, write_text_atomic

__all__ = ["EVIDENCE_FILENAME", "EVIDENCE_SCHEMA", "AgenticEvidence", "EvidenceFile", "GradeFingerprint",
           "decode_evidence_file", "evidence_path", "read_evidence_file", "stale_reason", "write_evidence_file"]

EVIDENCE_SCHEMA = 1
EVIDENCE_FILENAME = "evidence.json"  # in <home>/grades/, beside the grade records it points to


def evidence_path(home: Path) -> Path:
    return home / "grades" / EVIDENCE_FILENAME


@dataclass(frozen=True)
class GradeFingerprint:
    """What a grade's result depends on and the planner can check again before trusting it."""

    model_sha256: str  # the weights' verification receipt
    template_sha256: str | None  # chat_template.jinja beside the weights; None = the GGUF's own (in model_sha256)
    backend_build: str  # sha256 over the build facts and the binary (pipeline.evidence.backend_build)
    backend_build_described: str  # for people: "llama.cpp 0.5.0-dev, commit 0c1e570, cpu backend, native build"
    grade_version: str
    scenario_pack_sha256: str

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class AgenticEvidence:
    """A passing full-tier grade of ``model`` on a ``device_kind`` device of this machine."""

    model: str
    device_kind: str
    verdict: str  # always "pass": nothing else is written
    tier: str  # always "full"
    passed: int
    total: int
    fraction: float
    graded_at: str  # UTC, ISO 8601 ("2026-12-01T14:23:00Z")
    grade_record: str  # the grade's own JSON file (transcripts), under <home>/grades/
    fingerprint: GradeFingerprint

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "fingerprint": self.fingerprint.to_json()}


@dataclass(frozen=True)
class EvidenceFile:
    evidence: tuple[AgenticEvidence, ...] = ()

    def find(self, model: str, device_kind: str) -> AgenticEvidence | None:
        return next((e for e in self.evidence if e.model == model and e.device_kind == device_kind), None)

    def for_model(self, model: str) -> tuple[AgenticEvidence, ...]:
        return tuple(e for e in self.evidence if e.model == model)

    def with_evidence(self, item: AgenticEvidence) -> EvidenceFile:
        """This file with ``item`` in place of the same (model, device kind)'s, names in order."""
        kept = [e for e in self.evidence if (e.model, e.device_kind) != (item.model, item.device_kind)]
        return replace(self, evidence=tuple(sorted([*kept, item], key=lambda e: (e.model, e.device_kind))))

    def without(self, model: str, device_kind: str) -> EvidenceFile:
        return replace(self, evidence=tuple(e for e in self.evidence
                                            if (e.model, e.device_kind) != (model, device_kind)))

    def to_json(self) -> dict[str, Any]:
        return {"schema": EVIDENCE_SCHEMA, "evidence": [e.to_json() for e in self.evidence]}


_FINGERPRINT_KEYS = ("model_sha256", "template_sha256", "backend_build", "backend_build_described",
                     "grade_version", "scenario_pack_sha256")
_EVIDENCE_KEYS = ("model", "device_kind", "verdict", "tier", "passed", "total", "fraction", "graded_at",
                  "grade_record", "fingerprint")
_HINT = "delete it and grade again (`hotfit grade --model NAME --tier full`): it is rewritten by every full grade"


def _document_fail(path: Path | str) -> Callable[..., HotfitError]:
    """The error of a fault in the file as a whole (unreadable, not JSON, not an object), naming it."""

    def fail(problem: str, hint: str, **details: Any) -> HotfitError:
        return UsageError(f"grade evidence {path}: {problem}", hint=f"{hint}; or {_HINT}", path=str(path), **details)

    return fail


def decode_evidence_file(text: str, *, path: Path | str) -> EvidenceFile:
    """The one parser of ``evidence.json``: every field checked, the error naming the file and field."""

    def fail(field: str, problem: str, hint: str) -> HotfitError:
        return UsageError(f"grade evidence {path}: field {field!r} {problem}", hint=f"{hint}; or {_HINT}",
                          path=str(path), field=field)

    raw = parse_json(text, _document_fail(path), kind="a grade evidence file", shape='{"schema": 1, "evidence": [...]}')
    f = Fields(fail, noun="grade evidence")
    top = f.object(raw, "", ("schema", "evidence"))
    f.equal(top["schema"], "schema", EVIDENCE_SCHEMA, "this file was written by another hotfit version")
    items: list[AgenticEvidence] = []
    for i, value in enumerate(f.items(top["evidence"], "evidence", what="the evidence records")):
        e = f.at(f"evidence[{i}]")
        obj = e.object(value, "", _EVIDENCE_KEYS)
        fp = e.at("fingerprint")
        fpo = fp.object(obj["fingerprint"], "", _FINGERPRINT_KEYS)
        passed = e.integer(obj["passed"], "passed", minimum=0)
        total = e.integer(obj["total"], "total")
        if passed > total:
            raise e.fail("passed", f"is {passed}, more than total {total}", "write the grade's own score")
        items.append(AgenticEvidence(
            model=e.string(obj["model"], "model"),
            device_kind=e.string(obj["device_kind"], "device_kind"),
            verdict=e.choice(obj["verdict"], "verdict", ("pass",)),
            tier=e.choice(obj["tier"], "tier", ("full",)),
            passed=passed, total=total,
            fraction=e.number(obj["fraction"], "fraction", what="fraction"),
            graded_at=e.string(obj["graded_at"], "graded_at"),
            grade_record=e.string(obj["grade_record"], "grade_record"),
            fingerprint=GradeFingerprint(
                model_sha256=fp.string(fpo["model_sha256"], "model_sha256"),
                template_sha256=fp.string(fpo["template_sha256"], "template_sha256", nullable=True),
                backend_build=fp.string(fpo["backend_build"], "backend_build"),
                backend_build_described=fp.string(fpo["backend_build_described"], "backend_build_described"),
                grade_version=fp.string(fpo["grade_version"], "grade_version"),
                scenario_pack_sha256=fp.string(fpo["scenario_pack_sha256"], "scenario_pack_sha256"),
            ),
        ))
    seen = [(x.model, x.device_kind) for x in items]
    dup = next((k for k in seen if seen.count(k) > 1), None)
    if dup is not None:
        raise fail("evidence", f"holds {dup[0]} on {dup[1]} twice", "keep one record per model and device kind")
    return EvidenceFile(tuple(items))


def read_evidence_file(path: Path) -> EvidenceFile:
    """The evidence under ``path``; an empty file object when there is none yet."""
    text = read_text_document(path, _document_fail(path), missing_ok=True)
    return EvidenceFile() if text is None else decode_evidence_file(text, path=path)


def write_evidence_file(path: Path, evidence: EvidenceFile) -> None:
    """Atomic, durable replace (a reader sees the old file or the new one)."""
    write_text_atomic(path, json.dumps(evidence.to_json(), indent=2, sort_keys=True) + "\n")


# the parts in the order a reason names the first that differs, with the words it uses
_PARTS: tuple[tuple[str, str], ...] = (
    ("model_sha256", "model file changed"),
    ("template_sha256", "chat template changed"),
    ("backend_build", "backend build changed"),
    ("grade_version", "grade version changed"),
    ("scenario_pack_sha256", "scenario pack changed"),
)


def stale_reason(graded: GradeFingerprint, now: GradeFingerprint) -> str | None:
    """Pure: None when ``now`` is the fingerprint the evidence was graded under, else why not
    ("evidence stale: backend build changed (graded with ..., found now ...)")."""
    for key, words in _PARTS:
        a, b = getattr(graded, key), getattr(now, key)
        if a != b:
            if key == "backend_build":
                shown = f"graded with {graded.backend_build_described}, found now {now.backend_build_described}"
                if graded.backend_build_described == now.backend_build_described:
                    shown += "; same version, different binary"
            else:
                shown = f"graded {_short(a)}, now {_short(b)}"
            return f"evidence stale: {words} ({shown})"
    return None


def _short(value: str | None) -> str:
    if value is None:
        return "none (the GGUF's own template)"
    return value[:12] if len(value) == 64 else value

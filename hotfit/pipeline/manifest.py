"""The manifest: what the last successful ``hotfit auto`` provisioned, for ``serve`` and operators.

Written once, after every stage passed, atomically (temp file, fsync, rename,
fsync of the directory), so ``<home>/manifest.json`` is either the previous provisioning or the
new one, never half of either.

It records the facts ``serve`` needs (model path, template path, projector, KV type, the entry's
registry record, the device planned for) and the *measurements* of the verified session: the
window llama-server opened, the KV bytes it allocated, the tool-call verdict and the speeds. The
opened window is a measurement, not a setting to freeze: contenox writes no context window into
configuration because a measured figure would freeze one reading of free memory
(contenox-auto-facts.md, "The `auto` command"); ``serve`` checks it against the device as it is
when it starts and re-plans when it must.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any, Mapping

from hotfit.core.entry import DEFAULT_BACKEND, WEIGHTS_LAYOUTS, backend_names
from hotfit.core.errors import UsageError
from hotfit.planner.plan import Plan
from hotfit.planner.probe import Device
from hotfit.core.records import Fields, parse_json
from hotfit.planner.plan import REPROVISION_HINT, decode_plan_fields
from hotfit.state.files import read_text_document, rehome_paths, same_directory, write_text_atomic

SCHEMA = 1
_OLD_BUILD_FIELD = "llama_cpp"
_TOP_FIELDS = ("schema", "run_id", "plan_id", "written_at", "entry_name", "model_path", "model_size_bytes",
               "model_sha256", "template_path", "projector_path", "kv_cache_type", "planned_hot_context_tokens",
               "measured", "probe_verdict", "device", "plan")
# written only when set; backend: since OpenVINO; grade: the last multi-turn grade of this model;
# speed: predicted and measured (measure-speed).
# backend_build: the backend's build facts, written as "llama_cpp" before a third backend could
# have any (a manifest with that name still reads)
_OPTIONAL_FIELDS = ("extra", "template_sha256", "backend", "grade", "backend_build", _OLD_BUILD_FIELD, "speed")


def _build(doc: Mapping[str, Any], f: Fields) -> Mapping[str, Any]:
    """The backend's build facts, under either name (one of them is required, not both)."""
    names = [k for k in ("backend_build", _OLD_BUILD_FIELD) if k in doc]
    if not names:
        raise f.fail("backend_build", "is missing", "record every field; use null for a fact that could not be verified")
    if len(names) > 1:
        raise f.fail(_OLD_BUILD_FIELD, "is the old name of backend_build; a manifest has one of them",
                     "remove one; `hotfit auto` rewrites the manifest")
    return f.mapping(doc[names[0]], names[0], nullable=True)


@dataclass(frozen=True)
class Manifest:
    run_id: str
    plan_id: str
    written_at: str
    entry_name: str
    model_path: str
    model_size_bytes: int | None
    model_sha256: str | None
    template_path: str | None
    projector_path: str | None
    kv_cache_type: str
    planned_hot_context_tokens: int
    measured: Mapping[str, Any]  # opened window, KV bytes estimated/actual/ratio (a measurement)
    probe_verdict: Mapping[str, Any]  # tool-call probe: passed, tool, speeds
    backend_build: Mapping[str, Any]  # what the backend says of its build (llama-server: path, version, commit)
    device: Mapping[str, Any]  # what the plan was made for
    plan: Mapping[str, Any]  # the full frozen plan (entry facts serve needs to re-plan)
    extra: Mapping[str, Any] = field(default_factory=dict)
    template_sha256: str | None = None  # of the verified template text (edited → not in place)
    backend: str = DEFAULT_BACKEND  # its layout says whether model_path is one file or a snapshot directory
    # the last grade of this provisioning (`auto --grade` or `hotfit grade`): verdict, score, tier,
    # fingerprint, the record's path, when; None: never graded
    grade: Mapping[str, Any] | None = None
    # read from a home copied (cp -a) or moved from this one: its paths were re-rooted here (not written)
    rehomed_from: str | None = None
    # predicted (the plan's) and measured (measure-speed) speed for an agent prompt, and their ratio
    speed: Mapping[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "run_id": self.run_id,
            "plan_id": self.plan_id,
            "written_at": self.written_at,
            "entry_name": self.entry_name,
            "model_path": self.model_path,
            "model_size_bytes": self.model_size_bytes,
            "model_sha256": self.model_sha256,
            "template_path": self.template_path,
            "projector_path": self.projector_path,
            "kv_cache_type": self.kv_cache_type,
            "planned_hot_context_tokens": self.planned_hot_context_tokens,
            "measured": dict(self.measured),
            "probe_verdict": dict(self.probe_verdict),
            "backend_build": dict(self.backend_build),
            "device": dict(self.device),
            "plan": dict(self.plan),
            **({"extra": dict(self.extra)} if self.extra else {}),
            **({"template_sha256": self.template_sha256} if self.template_sha256 else {}),
            "backend": self.backend,
            **({"grade": dict(self.grade)} if self.grade is not None else {}),
            **({"speed": dict(self.speed)} if self.speed is not None else {}),
        }

    @classmethod
    def decode(cls, data: Any, f: Fields) -> Manifest:
        """The one decoder of the manifest document (what :meth:`to_json` writes); errors come from ``f``.

        The plan stays the JSON object it was written as (``serve`` and the worker judge decode it
        with :func:`plan_from_json` when they need it; a manifest whose plan is unusable still names
        what was provisioned, for ``status``)."""
        doc = f.object(data, "", _TOP_FIELDS, optional=_OPTIONAL_FIELDS)
        f.equal(doc["schema"], "schema", SCHEMA, REPROVISION_HINT)

        def text(key: str, *, nullable: bool = False) -> Any:
            return f.string(doc.get(key), key, nullable=nullable, blank=True)

        return cls(
            run_id=text("run_id"), plan_id=text("plan_id"), written_at=text("written_at"),
            entry_name=text("entry_name"), model_path=text("model_path"),
            model_size_bytes=f.integer(doc["model_size_bytes"], "model_size_bytes", minimum=0, nullable=True),
            model_sha256=text("model_sha256", nullable=True),
            template_path=text("template_path", nullable=True),
            projector_path=text("projector_path", nullable=True),
            kv_cache_type=text("kv_cache_type"),
            planned_hot_context_tokens=f.integer(doc["planned_hot_context_tokens"], "planned_hot_context_tokens"),
            measured=f.mapping(doc["measured"], "measured", nullable=True),
            probe_verdict=f.mapping(doc["probe_verdict"], "probe_verdict", nullable=True),
            backend_build=_build(doc, f),
            device=f.mapping(doc["device"], "device", nullable=True),
            plan=f.mapping(doc["plan"], "plan", nullable=True),
            extra=f.mapping(doc.get("extra"), "extra", nullable=True),
            template_sha256=text("template_sha256", nullable=True),
            # manifests written before OpenVINO have no backend: llama's
            backend=f.choice(doc.get("backend"), "backend", backend_names(), nullable=True) or DEFAULT_BACKEND,
            grade=f.mapping(doc.get("grade"), "grade", nullable=True) if doc.get("grade") is not None else None,
            speed=f.mapping(doc.get("speed"), "speed", nullable=True) if doc.get("speed") is not None else None,
        )

    @property
    def opened_context_tokens(self) -> int | None:
        value = self.measured.get("opened_context_tokens")
        return int(value) if value is not None else None

    def files_in_place(self) -> list[str]:
        """What is missing or the wrong size on disk ([] = all in place)."""
        problems: list[str] = []
        model = Path(self.model_path)
        if WEIGHTS_LAYOUTS[self.backend].snapshot:  # the verified snapshot directory: its files, at their total size
            size = sum(p.stat().st_size for p in model.rglob("*") if p.is_file()) if model.is_dir() else None
            if size is None:
                problems.append(f"model snapshot directory missing: {model}")
            elif self.model_size_bytes is not None and size != self.model_size_bytes:
                problems.append(f"model snapshot holds {size} bytes, expected {self.model_size_bytes}")
        elif not model.is_file():
            problems.append(f"model file missing: {model}")
        elif self.model_size_bytes is not None and model.stat().st_size != self.model_size_bytes:
            problems.append(f"model file has {model.stat().st_size} bytes, expected {self.model_size_bytes}")
        if self.template_path and not Path(self.template_path).is_file():
            problems.append(f"chat template missing: {self.template_path}")
        elif self.template_path and self.template_sha256 and hashlib.sha256(
                Path(self.template_path).read_bytes()).hexdigest() != self.template_sha256:
            problems.append(f"chat template changed since it was verified: {self.template_path}")
        if self.projector_path and not Path(self.projector_path).is_file():
            problems.append(f"projector missing: {self.projector_path}")
        return problems


def utc_now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def grade_summary(grade: Mapping[str, Any], *, run_id: str | None) -> dict[str, Any]:
    """What the manifest keeps of a grade (a stage record or a report): verdict, score, tier, record path."""
    return {"verdict": grade.get("verdict"), "stack_problem": grade.get("stack_problem"),
            "provisional": grade.get("provisional"), "passed": grade.get("passed"), "total": grade.get("total"),
            "fraction": grade.get("fraction"), "tier": grade.get("tier"), "categories": grade.get("categories"),
            "speeds": grade.get("speeds"), "fingerprint": grade.get("fingerprint"), "path": grade.get("path"),
            "graded_at": utc_now_iso(), "graded_by_run": run_id}


def write_manifest(path: Path, manifest: Manifest) -> None:
    """Atomic, durable replace: a reader (or a power cut) sees the old file or the new one."""
    write_text_atomic(path, json.dumps(manifest.to_json(), indent=2, sort_keys=True, default=str) + "\n",
                      what="the manifest")


def recorded_home(data: Any) -> str | None:
    """The home a manifest document was written in, from its model path (``<home>/models/<entry>/…``,
    Settings.model_dir); None when it does not say."""
    if not isinstance(data, dict) or not isinstance(data.get("model_path"), str):
        return None
    model = PurePath(data["model_path"])
    for parent in model.parents:
        if parent.name == data.get("entry_name") and parent.parent.name == "models":
            return str(parent.parent.parent)
    return None


def read_manifest(path: Path, *, strict: bool = False) -> Manifest | None:
    """The last provisioning, or None when there is none.

    An unreadable file (damaged, hand-edited, another version's) is treated as none, so ``auto``
    provisions again; with ``strict`` it is a :class:`UsageError` naming the file and the field
    (``serve``, ``status``).
    """

    def fail_document(problem: str, hint: str, **details: Any) -> UsageError:
        return UsageError(f"manifest {path} is unreadable: {problem}", hint=REPROVISION_HINT,
                          manifest=str(path), field=None, **details)

    def fail(field_path: str, problem: str, hint: str) -> UsageError:
        return UsageError(f"manifest {path} is unreadable: field {field_path!r} {problem}", hint=REPROVISION_HINT,
                          manifest=str(path), field=field_path)

    try:
        text = read_text_document(path, fail_document, missing_ok=True)
        if text is None:
            return None
        data = parse_json(text, fail_document, kind="a manifest", shape=REPROVISION_HINT)
        here, recorded = os.path.abspath(path.parent), recorded_home(data)
        if recorded is None or same_directory(recorded, here) or not (
                Path(here) / "models" / str(data.get("entry_name"))).is_dir():
            return Manifest.decode(data, Fields(fail, noun="manifest"))
        # A copied home (cp -a, an image cloned to many machines: the model's directory came along):
        # its files, not the original's (docs/faults-state.md, "A copied home").
        moved = Manifest.decode(rehome_paths(data, recorded, here), Fields(fail, noun="manifest"))
        return dataclasses.replace(moved, rehomed_from=recorded)
    except UsageError:
        if strict:
            raise
        return None


# -- the frozen plan in the manifest (serve re-plans from the manifest alone) -------------------


def plan_from_json(data: Any, *, source: str = "the manifest") -> Plan:
    """Inverse of ``Plan.to_json`` (its ``plan_id`` comes out the same): the entry through the
    registry's own entry decoder, the probe through the probe file's. A damaged plan is a
    :class:`UsageError` naming ``source`` and the field ('entry.artifact.revision')."""

    def fail(field_path: str, problem: str, hint: str) -> UsageError:
        return UsageError(f"{source} holds no usable plan: field {field_path!r} {problem}",
                          hint=REPROVISION_HINT, field=field_path)

    return decode_plan_fields(data, Fields(fail, noun="plan"))


def provisioned_device(manifest: Manifest) -> Device | None:
    """The device the manifest's plan was made for (None when the plan is unreadable: then the
    previous model is kept on whichever device it still qualifies)."""
    try:
        return plan_from_json(manifest.plan).placement.device
    except UsageError:  # plan_from_json names the damaged field
        return None

"""The manifest: what the last successful ``hotfit auto`` provisioned, for ``serve`` and operators.

Written once, after every stage passed (issue 6, item 7), atomically (temp file, fsync, rename,
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

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from core.errors import UsageError
from state.files import write_text_atomic

SCHEMA = 1


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
    llama_cpp: Mapping[str, Any]  # binary, version, commit
    device: Mapping[str, Any]  # what the plan was made for
    plan: Mapping[str, Any]  # the full frozen plan (entry facts serve needs to re-plan)
    extra: Mapping[str, Any] = field(default_factory=dict)
    template_sha256: str | None = None  # of the verified template text (edited → not in place)
    backend: str = "llama"  # "openvino": model_path is the IR snapshot directory, served by OVMS

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
            "llama_cpp": dict(self.llama_cpp),
            "device": dict(self.device),
            "plan": dict(self.plan),
            **({"extra": dict(self.extra)} if self.extra else {}),
            **({"template_sha256": self.template_sha256} if self.template_sha256 else {}),
            "backend": self.backend,
        }

    @classmethod
    def from_json(cls, data: Any) -> "Manifest":
        """ValueError naming the field when ``data`` is not a manifest this version wrote."""
        if not isinstance(data, Mapping):
            raise ValueError(f"the top level is {type(data).__name__}, not an object")
        if data.get("schema") != SCHEMA:
            raise ValueError(f"manifest schema {data.get('schema')!r} is not {SCHEMA}")

        def text(key: str, *, optional: bool = False) -> Any:
            value = data.get(key)
            if (value is None and optional) or isinstance(value, str):
                return value
            raise ValueError(f"{key} is {type(value).__name__}, not a string")

        def integer(key: str, *, optional: bool = False) -> Any:
            value = data.get(key)
            if (value is None and optional) or (isinstance(value, int) and not isinstance(value, bool)):
                return value
            raise ValueError(f"{key} is {type(value).__name__}, not an integer")

        def mapping(key: str) -> Mapping[str, Any]:
            value = data.get(key) or {}
            if not isinstance(value, Mapping):
                raise ValueError(f"{key} is {type(value).__name__}, not an object")
            return value

        return cls(
            run_id=text("run_id"), plan_id=text("plan_id"), written_at=text("written_at"),
            entry_name=text("entry_name"), model_path=text("model_path"),
            model_size_bytes=integer("model_size_bytes", optional=True),
            model_sha256=text("model_sha256", optional=True),
            template_path=text("template_path", optional=True),
            projector_path=text("projector_path", optional=True),
            kv_cache_type=text("kv_cache_type"),
            planned_hot_context_tokens=integer("planned_hot_context_tokens"),
            measured=mapping("measured"), probe_verdict=mapping("probe_verdict"),
            llama_cpp=mapping("llama_cpp"), device=mapping("device"),
            plan=mapping("plan"), extra=mapping("extra"),
            template_sha256=text("template_sha256", optional=True),
            backend=text("backend", optional=True) or "llama",  # manifests before OpenVINO: llama
        )

    @property
    def opened_context_tokens(self) -> int | None:
        value = self.measured.get("opened_context_tokens")
        return int(value) if value is not None else None

    def files_in_place(self) -> list[str]:
        """What is missing or the wrong size on disk ([] = all in place)."""
        problems: list[str] = []
        model = Path(self.model_path)
        if self.backend == "openvino":  # the verified snapshot directory: its files, at their total size
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


def write_manifest(path: Path, manifest: Manifest) -> None:
    """Atomic, durable replace: a reader (or a power cut) sees the old file or the new one."""
    write_text_atomic(path, json.dumps(manifest.to_json(), indent=2, sort_keys=True, default=str) + "\n")


def read_manifest(path: Path, *, strict: bool = False) -> Manifest | None:
    """The last provisioning, or None when there is none.

    An unreadable file (damaged, hand-edited, another version's) is treated as none, so ``auto``
    provisions again; with ``strict`` it is a :class:`UsageError` saying why (``serve``, ``status``).
    """
    try:
        return Manifest.from_json(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        if not strict:
            return None
        raise UsageError(
            f"manifest {path} is unreadable: {exc}",
            hint="run `hotfit auto` to provision again; it rewrites the manifest and reuses completed downloads",
            manifest=str(path),
        ) from None


# -- rebuilding the frozen plan from its JSON (serve re-plans from the manifest alone) ----------


def entry_from_json(d: Mapping[str, Any]) -> Any:
    """Inverse of ``dataclasses.asdict(Entry)`` (as ``Plan.to_json`` writes it)."""
    from core.entry import Artifact, Entry, Evidence, LayerGroup, SourceConfig, TemplateSource

    def artifact(a: Mapping[str, Any] | None) -> Artifact | None:
        return None if a is None else Artifact(**a)

    cfg = dict(d["config"])
    groups = cfg.get("layer_groups")
    cfg["layer_groups"] = None if groups is None else tuple(LayerGroup(**g) for g in groups)
    fields = dict(d)
    fields.update(
        evidence=tuple(Evidence(**e) for e in d.get("evidence") or ()),
        artifact=artifact(d.get("artifact")),
        projector=artifact(d.get("projector")),
        chat_template=None if d.get("chat_template") is None else TemplateSource(**d["chat_template"]),
        config=SourceConfig(**cfg),
    )
    return Entry(**fields)


def plan_from_json(d: Mapping[str, Any]) -> Any:
    """Inverse of ``Plan.to_json`` (its ``plan_id`` comes out the same)."""
    from core.plan import BudgetBreakdown, Device, Plan, ProbeResult

    probe = d["probe"]
    return Plan(
        entry=entry_from_json(d["entry"]),
        probe=ProbeResult(devices=tuple(Device(**dev) for dev in probe["devices"]),
                          selected=probe["selected"], notes=tuple(probe.get("notes") or ())),
        kv_cache_type=d["kv_cache_type"],
        kv_cache_type_source=d["kv_cache_type_source"],
        hot_context_tokens=d["hot_context_tokens"],
        estimated_kv_bytes=d["estimated_kv_bytes"],
        budget=BudgetBreakdown(**d["budget"]),
        origin=d.get("origin"),
        reused_previous=d.get("reused_previous", False),
        explicit_model=d.get("explicit_model", False),
    )

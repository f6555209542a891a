"""Load the curated registry and check it against its schema (pure core + one file read).

The bundled registry is ``registry/data/curated.json`` (package data)::

    {"schema": 1, "description": "...", "entries": [ {<every field of core.entry.Entry>}, ... ]}

Every entry records every field, ``null`` where a fact could not be verified (spec: "Unknown context
or KV metadata excludes a model from automatic selection"). The checks below refuse a file that
would let an unverified model be picked automatically:

* types and enums (backend, origin, agentic tier, evidence kind, ineligibility cause), 40-hex
  revisions, 64-hex sha256, positive integer sizes/layer counts/context, unique names;
* ``auto_eligible`` requires a permissive licence (Apache-2.0 or MIT), a pinned artifact revision
  with its exact size, a chat-template source, a known context ceiling and KV geometry (and, on the
  llama backend, a ``.gguf`` file and a llama.cpp architecture); a non-eligible entry says why;
* an ``agentic`` entry carries its evidence (measured result or training provenance, with source).

A broken file raises ``RegistryError`` naming the file, the entry, the field and what to do.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Mapping

from core.errors import RegistryError, UsageError
from core.entry import (
    AGENTIC_TIERS,
    BACKENDS,
    INELIGIBLE_CAUSES,
    ORIGINS,
    PERMISSIVE_LICENSES,
    Artifact,
    Entry,
    Evidence,
    LayerGroup,
    SourceConfig,
    TemplateSource,
)

SCHEMA_VERSION = 1
BUNDLED_RESOURCE = "data/curated.json"
EVIDENCE_KINDS = ("measured", "provenance")

_ENTRY_FIELDS = (
    "name", "display_name", "backend", "origin", "license", "params_total_b", "params_active_b",
    "release_date", "architecture", "agentic_tier", "evidence", "auto_eligible", "ineligible_reason",
    "ineligible_cause", "artifact", "projector", "chat_template", "config", "context_limit",
    "tool_parser", "notes",
)
_ARTIFACT_FIELDS = ("repo", "revision", "file", "size_bytes", "sha256")
_TEMPLATE_FIELDS = ("repo", "revision", "file")
_CONFIG_FIELDS = ("n_layers", "layer_groups", "mla", "recurrent", "source")
_GROUP_FIELDS = ("count", "n_kv_heads", "head_dim_k", "head_dim_v", "window_tokens")
_EVIDENCE_FIELDS = ("kind", "summary", "source")

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]*$")
_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*/[A-Za-z0-9][A-Za-z0-9._\-]*$")
_REVISION_RE = re.compile(r"^[0-9a-f]{40}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_DATE_RE = re.compile(r"^(\d{4})-(\d{2})(?:-(\d{2}))?$")


@dataclass(frozen=True)
class Registry:
    """The curated catalog: entries in file order, plus where they came from."""

    entries: tuple[Entry, ...]
    source: str

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    def get(self, name: str) -> Entry:
        """The entry called ``name``; an unknown name is a usage error listing close ones."""
        for entry in self.entries:
            if entry.name == name:
                return entry
        close = difflib.get_close_matches(name, self.names, n=5, cutoff=0.5)
        suggestion = f"did you mean: {', '.join(close)}?" if close else f"known: {', '.join(self.names)}"
        raise UsageError(
            f"no curated model named {name!r} in {self.source} ({suggestion})",
            hint="run 'hotfit registry list' to see every curated entry",
            name=name,
            close_matches=close,
        )

    def filter(self, *, backend: str | None = None, origin: str | None = None) -> tuple[Entry, ...]:
        """Entries of one backend and/or origin (``None`` or ``"auto"`` origin = all)."""
        return tuple(
            e for e in self.entries
            if (backend is None or e.backend == backend)
            and (origin in (None, "", "auto") or e.origin == origin)
        )


def bundled_registry_path() -> Path:
    """Filesystem path of the bundled registry (what ``registry lock`` updates by default)."""
    return Path(str(resources.files("registry").joinpath(BUNDLED_RESOURCE)))


def load_registry(path: Path | str | None = None) -> Registry:
    """Read and check a registry file; ``None`` = the bundled one (importlib.resources)."""
    if path is None:
        resource = resources.files("registry").joinpath(BUNDLED_RESOURCE)
        label = f"registry/{BUNDLED_RESOURCE} (bundled)"
        try:
            text = resource.read_text(encoding="utf-8")
        except OSError as exc:
            raise RegistryError(f"{label}: cannot be read ({exc})",
                                hint="reinstall hotfit; the package data is missing", file=label) from None
    else:
        label = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise RegistryError(f"{label}: cannot be read ({exc.strerror or exc})",
                                hint="pass an existing registry file with --registry", file=label) from None
        except UnicodeDecodeError as exc:
            raise RegistryError(f"{label}: not UTF-8 text (byte {exc.start}); a registry is a JSON file",
                                hint="pass the registry JSON file with --registry", file=label) from None
    return parse_registry_text(text, label)


def parse_registry_text(text: str, source: str) -> Registry:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RegistryError(
            f"{source}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})",
            hint="fix the JSON syntax at that position", file=source, line=exc.lineno, column=exc.colno,
        ) from None
    except RecursionError:
        raise RegistryError(f"{source}: not a registry (JSON nested too deeply)",
                            hint='a registry is {"schema": 1, "entries": [...]}', file=source) from None
    return parse_registry(data, source)


def parse_registry(data: Any, source: str) -> Registry:
    """Check a decoded registry document and build frozen entries (pure)."""
    if not isinstance(data, dict):
        raise RegistryError(f"{source}: the top level must be an object with 'schema' and 'entries'",
                            hint='start the file with {"schema": 1, "entries": [...]}', file=source)
    if data.get("schema") != SCHEMA_VERSION:
        raise RegistryError(
            f"{source}: field 'schema' is {data.get('schema')!r}; this hotfit reads schema {SCHEMA_VERSION}",
            hint=f'set "schema": {SCHEMA_VERSION} (or upgrade hotfit for a newer registry)', file=source,
        )
    raw_entries = data.get("entries")
    if not isinstance(raw_entries, list) or not raw_entries:
        raise RegistryError(f"{source}: field 'entries' must be a non-empty list",
                            hint="list the curated models under \"entries\"", file=source)
    entries: list[Entry] = []
    seen: dict[str, int] = {}
    for index, raw in enumerate(raw_entries):
        entry = _parse_entry(raw, index, source)
        if entry.name in seen:
            raise RegistryError(
                f"{source}: entry {entry.name!r} (#{index}): field 'name' repeats entry #{seen[entry.name]}",
                hint="give every entry a unique name", file=source, entry=entry.name, field="name",
            )
        seen[entry.name] = index
        entries.append(entry)
    return Registry(entries=tuple(entries), source=source)


# --------------------------------------------------------------------------- entry checks


class _Checker:
    """Collects the context (file, entry) every error message names."""

    def __init__(self, source: str, index: int, name: str | None) -> None:
        self.source = source
        self.index = index
        self.name = name

    def fail(self, field: str, problem: str, hint: str) -> RegistryError:
        who = f"entry {self.name!r} (#{self.index})" if self.name else f"entry #{self.index}"
        return RegistryError(f"{self.source}: {who}: field {field!r} {problem}", hint=hint,
                             file=self.source, entry=self.name, index=self.index, field=field)

    def fields(self, obj: Any, expected: tuple[str, ...], where: str) -> Mapping[str, Any]:
        if not isinstance(obj, dict):
            raise self.fail(where, f"must be an object, got {type(obj).__name__}",
                            f"write {where} as a JSON object with keys {', '.join(expected)}")
        missing = [k for k in expected if k not in obj]
        if missing:
            key = f"{where}.{missing[0]}" if where != "entry" else missing[0]
            raise self.fail(key, "is missing",
                            "record every field; use null for a fact that could not be verified")
        extra = sorted(set(obj) - set(expected))
        if extra:
            key = f"{where}.{extra[0]}" if where != "entry" else extra[0]
            raise self.fail(key, "is not a registry field",
                            f"remove it (known fields: {', '.join(expected)})")
        return obj

    def string(self, value: Any, field: str, *, nullable: bool = False) -> str | None:
        if value is None and nullable:
            return None
        if not isinstance(value, str) or not value.strip():
            raise self.fail(field, f"must be a non-empty string{' or null' if nullable else ''}, got {value!r}",
                            "write the value as text" + (" (null if unknown)" if nullable else ""))
        return value

    def boolean(self, value: Any, field: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(field, f"must be true or false, got {value!r}", "write a JSON boolean")
        return value

    def positive_int(self, value: Any, field: str, *, nullable: bool = False) -> int | None:
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.fail(field, f"must be a positive whole number{' or null' if nullable else ''}, got {value!r}",
                            "write an exact integer (bytes, tokens or a count), never a rounded figure"
                            + ("; null if unknown" if nullable else ""))
        return value

    def positive_number(self, value: Any, field: str) -> float | None:
        if value is None:
            return None
        # not (value > 0) also refuses NaN, which json.loads accepts; inf is no parameter count either
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise self.fail(field, f"must be a positive number of billions or null, got {value!r}",
                            "write e.g. 8.92 (billions of parameters), or null if unknown")
        return float(value)

    def choice(self, value: Any, field: str, allowed: Iterable[str]) -> str:
        allowed = tuple(allowed)
        if value not in allowed:
            raise self.fail(field, f"is {value!r}, not one of {', '.join(allowed)}",
                            f"use one of: {', '.join(allowed)}")
        return value


def _parse_entry(raw: Any, index: int, source: str) -> Entry:
    name_hint = raw.get("name") if isinstance(raw, dict) and isinstance(raw.get("name"), str) else None
    c = _Checker(source, index, name_hint)
    obj = c.fields(raw, _ENTRY_FIELDS, "entry")
    name = c.string(obj["name"], "name")
    assert name is not None
    if not _NAME_RE.match(name):
        raise c.fail("name", f"is {name!r}: only lower-case letters, digits, '.' and '-' are allowed",
                     "rename it, e.g. 'qwen3.5-9b'")
    display_name = c.string(obj["display_name"], "display_name")
    backend = c.choice(obj["backend"], "backend", BACKENDS)
    origin = c.choice(obj["origin"], "origin", ORIGINS)
    license_ = c.string(obj["license"], "license", nullable=True)
    params_total = c.positive_number(obj["params_total_b"], "params_total_b")
    params_active = c.positive_number(obj["params_active_b"], "params_active_b")
    if params_active is not None and (params_total is None or params_active > params_total):
        raise c.fail("params_active_b", f"({params_active}) exceeds params_total_b ({params_total})",
                     "active parameters are a subset of the total; record both or neither")
    release_date = _release_date(c, obj["release_date"])
    architecture = c.string(obj["architecture"], "architecture", nullable=True)
    tier = c.choice(obj["agentic_tier"], "agentic_tier", AGENTIC_TIERS)
    evidence = _evidence(c, obj["evidence"])
    auto_eligible = c.boolean(obj["auto_eligible"], "auto_eligible")
    reason = c.string(obj["ineligible_reason"], "ineligible_reason", nullable=True)
    cause = obj["ineligible_cause"]
    if cause is not None:
        c.choice(cause, "ineligible_cause", INELIGIBLE_CAUSES)
    artifact = _artifact(c, obj["artifact"], "artifact", nullable=True)
    projector = _artifact(c, obj["projector"], "projector", nullable=True)
    template = _template(c, obj["chat_template"])
    config = _config(c, obj["config"])
    context_limit = c.positive_int(obj["context_limit"], "context_limit", nullable=True)
    tool_parser = c.string(obj["tool_parser"], "tool_parser", nullable=True)
    notes = c.string(obj["notes"], "notes", nullable=True)

    entry = Entry(
        name=name, display_name=display_name or name, backend=backend, origin=origin,  # type: ignore[arg-type]
        license=license_, params_total_b=params_total, params_active_b=params_active,
        release_date=release_date, architecture=architecture, agentic_tier=tier,  # type: ignore[arg-type]
        evidence=evidence, auto_eligible=auto_eligible, ineligible_reason=reason, artifact=artifact,
        projector=projector, chat_template=template, config=config, context_limit=context_limit,
        tool_parser=tool_parser, notes=notes, ineligible_cause=cause,
    )
    _check_rules(c, entry)
    return entry


def _release_date(c: _Checker, value: Any) -> str | None:
    if value is None:
        return None
    match = _DATE_RE.match(value) if isinstance(value, str) else None
    ok = False
    if match:
        month = int(match.group(2))
        day = int(match.group(3)) if match.group(3) else 1
        ok = 1 <= month <= 12 and 1 <= day <= 31
    if not ok:
        raise c.fail("release_date", f"is {value!r}, not an ISO date",
                     "write YYYY-MM-DD (or YYYY-MM when the source gives only the month), or null")
    return value


def _evidence(c: _Checker, value: Any) -> tuple[Evidence, ...]:
    if not isinstance(value, list):
        raise c.fail("evidence", f"must be a list, got {type(value).__name__}",
                     'write [] or [{"kind": "measured"|"provenance", "summary": ..., "source": ...}]')
    out = []
    for i, item in enumerate(value):
        where = f"evidence[{i}]"
        obj = c.fields(item, _EVIDENCE_FIELDS, where)
        kind = c.choice(obj["kind"], f"{where}.kind", EVIDENCE_KINDS)
        summary = c.string(obj["summary"], f"{where}.summary")
        src = c.string(obj["source"], f"{where}.source")
        out.append(Evidence(kind=kind, summary=summary or "", source=src or ""))  # type: ignore[arg-type]
    return tuple(out)


def _artifact(c: _Checker, value: Any, where: str, *, nullable: bool) -> Artifact | None:
    if value is None and nullable:
        return None
    obj = c.fields(value, _ARTIFACT_FIELDS, where)
    repo = _repo(c, obj["repo"], f"{where}.repo")
    revision = _revision(c, obj["revision"], f"{where}.revision")
    file = c.string(obj["file"], f"{where}.file", nullable=True)
    size = c.positive_int(obj["size_bytes"], f"{where}.size_bytes", nullable=True)
    sha = obj["sha256"]
    if sha is not None and (not isinstance(sha, str) or not _SHA256_RE.match(sha)):
        raise c.fail(f"{where}.sha256", f"is {sha!r}, not 64 lower-case hex digits",
                     "copy the Hub's LFS oid (sha256) exactly, or null if unknown")
    return Artifact(repo=repo, revision=revision, file=file, size_bytes=size, sha256=sha)


def _template(c: _Checker, value: Any) -> TemplateSource | None:
    if value is None:
        return None
    obj = c.fields(value, _TEMPLATE_FIELDS, "chat_template")
    repo = _repo(c, obj["repo"], "chat_template.repo")
    revision = _revision(c, obj["revision"], "chat_template.revision")
    file = c.string(obj["file"], "chat_template.file")
    assert file is not None
    if not (file.endswith(".jinja") or file.rsplit("/", 1)[-1] == "tokenizer_config.json"):
        raise c.fail("chat_template.file", f"is {file!r}: a chat template comes from a .jinja file or tokenizer_config.json",
                     "point at the repository's chat_template.jinja (or tokenizer_config.json)")
    return TemplateSource(repo=repo, revision=revision, file=file)


def _config(c: _Checker, value: Any) -> SourceConfig:
    obj = c.fields(value, _CONFIG_FIELDS, "config")
    n_layers = c.positive_int(obj["n_layers"], "config.n_layers", nullable=True)
    groups_raw = obj["layer_groups"]
    groups: tuple[LayerGroup, ...] | None = None
    if groups_raw is not None:
        if not isinstance(groups_raw, list) or not groups_raw:
            raise c.fail("config.layer_groups", "must be a non-empty list or null",
                         "list the KV layer groups, or null when the geometry is not verified")
        parsed = []
        for i, g in enumerate(groups_raw):
            where = f"config.layer_groups[{i}]"
            gobj = c.fields(g, _GROUP_FIELDS, where)
            parsed.append(LayerGroup(
                count=c.positive_int(gobj["count"], f"{where}.count") or 0,
                n_kv_heads=c.positive_int(gobj["n_kv_heads"], f"{where}.n_kv_heads") or 0,
                head_dim_k=c.positive_int(gobj["head_dim_k"], f"{where}.head_dim_k") or 0,
                head_dim_v=c.positive_int(gobj["head_dim_v"], f"{where}.head_dim_v") or 0,
                window_tokens=c.positive_int(gobj["window_tokens"], f"{where}.window_tokens", nullable=True),
            ))
        groups = tuple(parsed)
    mla = c.boolean(obj["mla"], "config.mla")
    recurrent = c.boolean(obj["recurrent"], "config.recurrent")
    src = c.string(obj["source"], "config.source", nullable=True)
    if groups is not None:
        if n_layers is None:
            raise c.fail("config.n_layers", "is null while layer_groups are recorded",
                         "record the layer count from the same config.json")
        covered = sum(g.count for g in groups)
        if covered > n_layers:
            raise c.fail("config.layer_groups", f"cover {covered} layers but n_layers is {n_layers}",
                         "make the group counts add up to the model's layers")
        if covered != n_layers and not (mla or recurrent):
            raise c.fail("config.layer_groups", f"cover {covered} of {n_layers} layers",
                         "list every attention layer (only hybrid/recurrent models may list fewer)")
        if src is None:
            raise c.fail("config.source", "is null while geometry is recorded",
                         "cite the config.json the geometry was read from")
    return SourceConfig(n_layers=n_layers, layer_groups=groups, mla=mla, recurrent=recurrent, source=src)


def _repo(c: _Checker, value: Any, field: str) -> str:
    if not isinstance(value, str) or not _REPO_RE.match(value):
        raise c.fail(field, f"is {value!r}, not a Hub repository id", "write it as owner/name")
    return value


def _revision(c: _Checker, value: Any, field: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _REVISION_RE.match(value):
        raise c.fail(field, f"is {value!r}, not a 40-hex commit id",
                     "pin the full commit sha (a branch or tag moves); null if not yet pinned ('hotfit registry lock')")
    return value


def _check_rules(c: _Checker, e: Entry) -> None:
    """Cross-field rules: what automatic selection may rely on (spec, 'Selection and hot context')."""
    if e.agentic_tier == "agentic" and not e.evidence:
        raise c.fail("evidence", "is empty for an agentic entry",
                     "record the measured multi-turn result or training provenance (with its source), or lower the tier")
    if e.projector is not None and e.projector.file is None:
        raise c.fail("projector.file", "is null", "name the projector file (e.g. mmproj-F16.gguf)")
    if e.backend == "llama" and e.artifact is not None and e.artifact.file is not None \
            and not e.artifact.file.endswith(".gguf"):
        raise c.fail("artifact.file", f"is {e.artifact.file!r}, not a .gguf file",
                     "llama entries download one GGUF file")
    if not e.auto_eligible:
        if e.ineligible_reason is None or e.ineligible_cause is None:
            field = "ineligible_reason" if e.ineligible_reason is None else "ineligible_cause"
            raise c.fail(field, "is null for an entry that is not auto-eligible",
                         "say why it is excluded (ineligible_reason) and classify it (ineligible_cause: "
                         + ", ".join(INELIGIBLE_CAUSES) + ")")
        return
    if e.ineligible_reason is not None or e.ineligible_cause is not None:
        field = "ineligible_reason" if e.ineligible_reason is not None else "ineligible_cause"
        raise c.fail(field, "is set on an auto-eligible entry", "set it to null, or set auto_eligible to false")
    if e.license not in PERMISSIVE_LICENSES:
        raise c.fail("license", f"is {e.license!r}; automatic selection requires {' or '.join(PERMISSIVE_LICENSES)}",
                     "set auto_eligible to false with the licence as its reason")
    art = e.artifact
    if art is None:
        raise c.fail("artifact", "is null on an auto-eligible entry", "record the artifact or set auto_eligible to false")
    # Spec ("Publisher and artifact evidence"): GGUF downloads are pinned to verified revisions;
    # OpenVINO repository downloads follow their current snapshots (the fetch records the commit),
    # so an OpenVINO entry needs its checked snapshot size but no pinned revision.
    required = [("artifact.size_bytes", art.size_bytes)]
    if e.backend == "llama":
        required.insert(0, ("artifact.revision", art.revision))
    for field, value in required:
        if value is None:
            raise c.fail(field, "is null on an auto-eligible entry",
                         "pin it ('hotfit registry lock') or set auto_eligible to false with this as the reason")
    if e.backend == "llama":
        if art.file is None:
            raise c.fail("artifact.file", "is null on an auto-eligible llama entry", "name the GGUF file")
        if e.architecture is None:
            raise c.fail("architecture", "is null on an auto-eligible llama entry",
                         "record the llama.cpp architecture name (src/llama-arch.cpp)")
    if e.projector is not None and (e.projector.revision is None or e.projector.size_bytes is None):
        raise c.fail("projector", "has no pinned revision or size on an auto-eligible entry",
                     "pin the projector or drop it")
    if e.chat_template is None:
        raise c.fail("chat_template", "is null on an auto-eligible entry",
                     "name the ChatTemplateURL (spec: a missing template costs the model its tool calls)")
    if e.context_limit is None:
        raise c.fail("context_limit", "is null on an auto-eligible entry",
                     "record the verified context ceiling or set auto_eligible to false (unknown context excludes)")
    if e.config.layer_groups is None:
        raise c.fail("config.layer_groups", "is null on an auto-eligible entry",
                     "record the KV geometry or set auto_eligible to false (unknown KV metadata excludes)")


# --------------------------------------------------------------------------- serialisation


def download_blocker(entry: Entry) -> str | None:
    """Why ``hotfit pull`` cannot fetch this entry as recorded, or None when it can.

    A GGUF is fetched only at a pinned 40-hex commit; an OpenVINO snapshot (``file`` null) follows
    the repository's current commit (spec, 'Publisher and artifact evidence'), so an open revision
    does not block it."""
    art = entry.artifact
    if art is None:
        return "no artifact is recorded for it"
    if art.file is not None and not _REVISION_RE.match(art.revision or ""):
        return (f"its file {art.repo}/{art.file} is not pinned to a commit (revision {art.revision!r}); "
                "pin it with `hotfit registry lock` after reviewing the source")
    return None


def entry_summary(entry: Entry) -> dict[str, Any]:
    """The facts ``registry list`` shows for one entry (JSON-ready)."""
    art = entry.artifact
    blocker = download_blocker(entry)
    return {
        "name": entry.name,
        "display_name": entry.display_name,
        "backend": entry.backend,
        "origin": entry.origin,
        "agentic_tier": entry.agentic_tier,
        "license": entry.license,
        "params_total_b": entry.params_total_b,
        "params_active_b": entry.params_active_b,
        "download_bytes": entry.weights_bytes,
        "context_limit": entry.context_limit,
        "auto_eligible": entry.auto_eligible,
        "ineligible_reason": entry.ineligible_reason,
        "repo": art.repo if art else None,
        "revision": art.revision if art else None,
        "file": art.file if art else None,
        "downloadable": blocker is None,
        "download_blocker": blocker,
    }

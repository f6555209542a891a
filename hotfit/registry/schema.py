"""The one schema of a registry entry, and its one decoder (pure).

A registry entry is written in JSON as ``dataclasses.asdict(core.entry.Entry)``: every field of
the entry, ``null`` where a fact could not be verified (spec: "Unknown context or KV metadata
excludes a model from automatic selection"). The curated registry (registry/catalog.py) and the
manifest's frozen plan (pipeline/manifest.py) both decode it with :func:`decode_entry`, so an
entry means the same wherever it is read:

* shape: types and enums (backend, origin, agentic tier, evidence kind, ineligibility cause),
  40-hex revisions, 64-hex sha256, positive integer sizes/layer counts/context, ISO dates, layer
  groups that add up to the layers;
* rules (:func:`check_rules`, which a registry file always passes): ``auto_eligible`` requires a
  permissive licence (Apache-2.0 or MIT), a pinned artifact revision with its exact size, a
  chat-template source, a known context ceiling and KV geometry (and, on the llama backend, a
  ``.gguf`` file and a llama.cpp architecture); a non-eligible entry says why; an ``agentic``
  entry carries its evidence (measured result or training provenance, with source).

Errors come from the caller's :class:`core.records.Fields` reader, so they name the caller's file
and the path to the field ('artifact.revision', 'entry.artifact.revision').
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from hotfit.core.entry import (
    AGENTIC_TIERS,
    INELIGIBLE_CAUSES,
    ORIGINS,
    PERMISSIVE_LICENSES,
    TEMPLATE_PIN_FIELDS,
    Artifact,
    Entry,
    Evidence,
    LayerGroup,
    SourceConfig,
    TemplateSource,
    backend_names,
    safe_relpath,
)
from hotfit.core.records import Fields

EVIDENCE_KINDS = ("measured", "provenance")

ENTRY_FIELDS = tuple(f.name for f in dataclasses.fields(Entry))
_ARTIFACT_FIELDS = tuple(f.name for f in dataclasses.fields(Artifact))
_TEMPLATE_FIELDS = tuple(f.name for f in dataclasses.fields(TemplateSource) if f.name not in TEMPLATE_PIN_FIELDS)
_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(SourceConfig))
_GROUP_FIELDS = tuple(f.name for f in dataclasses.fields(LayerGroup))
_EVIDENCE_FIELDS = tuple(f.name for f in dataclasses.fields(Evidence))

NAME_RE = re.compile(r"[a-z0-9][a-z0-9.\-]*")
REPO_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]*/[A-Za-z0-9][A-Za-z0-9._\-]*")
REVISION_RE = re.compile(r"[0-9a-f]{40}")
SHA256_RE = re.compile(r"[0-9a-f]{64}")
_DATE_RE = re.compile(r"(\d{4})-(\d{2})(?:-(\d{2}))?")

_PIN_HINT = "pin the full commit sha (a branch or tag moves); null if not yet pinned ('hotfit registry lock')"


def decode_entry(raw: Any, f: Fields, *, rules: bool = True) -> Entry:
    """Check one entry object and build the frozen :class:`Entry`; errors name ``f``'s file and field.

    ``rules``: also the registry's cross-field rules (:func:`check_rules`). A registry file always
    applies them; the manifest's plan decodes with ``rules=False``, since its entry passed them when
    it was selected (and a plan built in code from an entry of its own never went through a file)."""
    obj = f.object(raw, "", ENTRY_FIELDS)
    name = f.string(obj["name"], "name")
    if not NAME_RE.fullmatch(name):
        raise f.fail("name", f"is {name!r}: only lower-case letters, digits, '.' and '-' are allowed",
                     "rename it, e.g. 'qwen3.5-9b'")
    billions: dict[str, Any] = {"nullable": True, "what": "number of billions",
                                "hint": "write e.g. 8.92 (billions of parameters), or null if unknown"}
    params_total = f.number(obj["params_total_b"], "params_total_b", **billions)
    params_active = f.number(obj["params_active_b"], "params_active_b", **billions)
    if params_active is not None and (params_total is None or params_active > params_total):
        raise f.fail("params_active_b", f"({params_active}) exceeds params_total_b ({params_total})",
                     "active parameters are a subset of the total; record both or neither")
    entry = Entry(
        name=name,
        display_name=f.string(obj["display_name"], "display_name"),
        backend=f.choice(obj["backend"], "backend", backend_names()),
        origin=f.choice(obj["origin"], "origin", ORIGINS),
        license=f.string(obj["license"], "license", nullable=True),
        params_total_b=params_total,
        params_active_b=params_active,
        release_date=_release_date(f, obj["release_date"]),
        architecture=f.string(obj["architecture"], "architecture", nullable=True),
        agentic_tier=f.choice(obj["agentic_tier"], "agentic_tier", AGENTIC_TIERS),
        evidence=_evidence(f, obj["evidence"]),
        auto_eligible=f.boolean(obj["auto_eligible"], "auto_eligible"),
        ineligible_reason=f.string(obj["ineligible_reason"], "ineligible_reason", nullable=True),
        ineligible_cause=f.choice(obj["ineligible_cause"], "ineligible_cause", INELIGIBLE_CAUSES, nullable=True),
        artifact=_artifact(f, obj["artifact"], "artifact"),
        projector=_artifact(f, obj["projector"], "projector"),
        chat_template=_template(f, obj["chat_template"]),
        config=_config(f.at("config"), obj["config"]),
        context_limit=f.integer(obj["context_limit"], "context_limit", nullable=True),
        tool_parser=f.string(obj["tool_parser"], "tool_parser", nullable=True),
        notes=f.string(obj["notes"], "notes", nullable=True),
    )
    if rules:
        check_rules(f, entry)
    return entry


def _release_date(f: Fields, value: Any) -> str | None:
    if value is None:
        return None
    match = _DATE_RE.fullmatch(value) if isinstance(value, str) else None
    if not (match and 1 <= int(match.group(2)) <= 12 and 1 <= int(match.group(3) or 1) <= 31):
        raise f.fail("release_date", f"is {value!r}, not an ISO date",
                     "write YYYY-MM-DD (or YYYY-MM when the source gives only the month), or null")
    return match.group(0)  # the whole value (a full match)


def _evidence(f: Fields, value: Any) -> tuple[Evidence, ...]:
    if not isinstance(value, (list, tuple)):
        raise f.fail("evidence", f"must be a list, got {type(value).__name__}",
                     'write [] or [{"kind": "measured"|"provenance", "summary": ..., "source": ...}]')
    out = []
    for i, item in enumerate(value):
        where = f"evidence[{i}]"
        obj = f.object(item, where, _EVIDENCE_FIELDS)
        out.append(Evidence(kind=f.choice(obj["kind"], f"{where}.kind", EVIDENCE_KINDS),
                            summary=f.string(obj["summary"], f"{where}.summary"),
                            source=f.string(obj["source"], f"{where}.source")))
    return tuple(out)


def _repo_file(f: Fields, file: str | None, where: str) -> str | None:
    """A file name inside a Hub repository, through the one path check (core.entry.safe_relpath):
    refused here, at load, so no request is ever built from it."""
    if file is None:
        return None
    try:
        return safe_relpath(file)
    except ValueError:
        raise f.fail(where, f"is {file!r}, which would leave the model directory (absolute, '..', '.', an empty "
                            "part, a backslash or NUL)",
                     "write the file's path inside its repository, e.g. chat_template.jinja or sub/model.gguf") from None


def _artifact(f: Fields, value: Any, where: str) -> Artifact | None:
    if value is None:
        return None
    obj = f.object(value, where, _ARTIFACT_FIELDS)
    return Artifact(
        repo=f.matching(obj["repo"], f"{where}.repo", REPO_RE, "a Hub repository id", "write it as owner/name"),
        revision=f.matching(obj["revision"], f"{where}.revision", REVISION_RE, "a 40-hex commit id", _PIN_HINT,
                            nullable=True),
        file=_repo_file(f, f.string(obj["file"], f"{where}.file", nullable=True), f"{where}.file"),
        size_bytes=f.integer(obj["size_bytes"], f"{where}.size_bytes", nullable=True),
        sha256=f.matching(obj["sha256"], f"{where}.sha256", SHA256_RE, "64 lower-case hex digits",
                          "copy the Hub's LFS oid (sha256) exactly, or null if unknown", nullable=True),
    )


def _template(f: Fields, value: Any) -> TemplateSource | None:
    if value is None:
        return None
    obj = f.object(value, "chat_template", _TEMPLATE_FIELDS, optional=TEMPLATE_PIN_FIELDS)
    repo = f.matching(obj["repo"], "chat_template.repo", REPO_RE, "a Hub repository id", "write it as owner/name")
    revision = f.matching(obj["revision"], "chat_template.revision", REVISION_RE, "a 40-hex commit id", _PIN_HINT,
                          nullable=True)
    file = _repo_file(f, f.string(obj["file"], "chat_template.file"), "chat_template.file")
    assert file is not None
    if not (file.endswith(".jinja") or file.rsplit("/", 1)[-1] == "tokenizer_config.json"):
        raise f.fail("chat_template.file",
                     f"is {file!r}: a chat template comes from a .jinja file or tokenizer_config.json",
                     "point at the repository's chat_template.jinja (or tokenizer_config.json)")
    size = f.integer(obj.get("size_bytes"), "chat_template.size_bytes", minimum=1, nullable=True)
    sha256 = f.matching(obj.get("sha256"), "chat_template.sha256", SHA256_RE, "64 lower-case hex digits",
                        "copy the file's sha256 exactly, or null if unknown", nullable=True)
    return TemplateSource(repo=repo, revision=revision, file=file, size_bytes=size, sha256=sha256)


def _config(f: Fields, value: Any) -> SourceConfig:
    """``f`` reads below 'config' (its paths are 'config.n_layers', ...)."""
    obj = f.object(value, "", _CONFIG_FIELDS)
    n_layers = f.integer(obj["n_layers"], "n_layers", nullable=True)
    groups: tuple[LayerGroup, ...] | None = None
    if obj["layer_groups"] is not None:
        if not isinstance(obj["layer_groups"], (list, tuple)) or not obj["layer_groups"]:
            raise f.fail("layer_groups", "must be a non-empty list or null",
                         "list the KV layer groups, or null when the geometry is not verified")
        parsed = []
        for i, raw in enumerate(obj["layer_groups"]):
            g = f.at(f"layer_groups[{i}]")
            gobj = g.object(raw, "", _GROUP_FIELDS)
            parsed.append(LayerGroup(
                count=g.integer(gobj["count"], "count"), n_kv_heads=g.integer(gobj["n_kv_heads"], "n_kv_heads"),
                head_dim_k=g.integer(gobj["head_dim_k"], "head_dim_k"),
                head_dim_v=g.integer(gobj["head_dim_v"], "head_dim_v"),
                window_tokens=g.integer(gobj["window_tokens"], "window_tokens", nullable=True),
            ))
        groups = tuple(parsed)
    mla = f.boolean(obj["mla"], "mla")
    recurrent = f.boolean(obj["recurrent"], "recurrent")
    src = f.string(obj["source"], "source", nullable=True)
    if groups is not None:
        if n_layers is None:
            raise f.fail("n_layers", "is null while layer_groups are recorded",
                         "record the layer count from the same config.json")
        covered = sum(g.count for g in groups)
        if covered > n_layers:
            raise f.fail("layer_groups", f"cover {covered} layers but n_layers is {n_layers}",
                         "make the group counts add up to the model's layers")
        if covered != n_layers and not (mla or recurrent):
            raise f.fail("layer_groups", f"cover {covered} of {n_layers} layers",
                         "list every attention layer (only hybrid/recurrent models may list fewer)")
        if src is None:
            raise f.fail("source", "is null while geometry is recorded",
                         "cite the config.json the geometry was read from")
    return SourceConfig(n_layers=n_layers, layer_groups=groups, mla=mla, recurrent=recurrent, source=src)


def check_rules(f: Fields, e: Entry) -> None:
    """Cross-field rules: what automatic selection may rely on (spec, 'Selection and hot context')."""
    if e.agentic_tier == "agentic" and not e.evidence:
        raise f.fail("evidence", "is empty for an agentic entry",
                     "record the measured multi-turn result or training provenance (with its source), or lower the tier")
    if e.projector is not None and e.projector.file is None:
        raise f.fail("projector.file", "is null", "name the projector file (e.g. mmproj-F16.gguf)")
    layout = e.layout
    if layout.file_suffix is not None and e.artifact is not None and e.artifact.file is not None \
            and not e.artifact.file.endswith(layout.file_suffix):
        raise f.fail("artifact.file", f"is {e.artifact.file!r}, not a {layout.file_suffix} file",
                     f"{e.backend} entries download one {layout.file_format} file")
    art, tpl = e.artifact, e.chat_template
    # A template inside the snapshot is read from the snapshot fetch-weights brings (stages/fetch_template.py):
    # pinned to another commit than the snapshot's it would be fetched from a snapshot that is not loaded.
    if layout.snapshot and art is not None and tpl is not None and tpl.repo == art.repo \
            and tpl.revision is not None and tpl.revision != art.revision:
        raise f.fail("chat_template.revision",
                     f"is {tpl.revision} while its snapshot ({art.repo}) is "
                     + (f"pinned at {art.revision}" if art.revision else "unpinned (it follows main)"),
                     "pin the template to the artifact's revision, or leave both null ('hotfit registry lock' "
                     "pins them together)")
    if not e.auto_eligible:
        if e.ineligible_reason is None or e.ineligible_cause is None:
            field = "ineligible_reason" if e.ineligible_reason is None else "ineligible_cause"
            raise f.fail(field, "is null for an entry that is not auto-eligible",
                         "say why it is excluded (ineligible_reason) and classify it (ineligible_cause: "
                         + ", ".join(INELIGIBLE_CAUSES) + ")")
        return
    if e.ineligible_reason is not None or e.ineligible_cause is not None:
        field = "ineligible_reason" if e.ineligible_reason is not None else "ineligible_cause"
        raise f.fail(field, "is set on an auto-eligible entry", "set it to null, or set auto_eligible to false")
    if e.license not in PERMISSIVE_LICENSES:
        raise f.fail("license", f"is {e.license!r}; automatic selection requires {' or '.join(PERMISSIVE_LICENSES)}",
                     "set auto_eligible to false with the licence as its reason")
    if art is None:
        raise f.fail("artifact", "is null on an auto-eligible entry", "record the artifact or set auto_eligible to false")
    # Spec ("Publisher and artifact evidence"): GGUF downloads are pinned to verified revisions;
    # OpenVINO repository downloads follow their current snapshots (the fetch records the commit),
    # so an OpenVINO entry needs its checked snapshot size but no pinned revision.
    required: list[tuple[str, int | str | None]] = [("artifact.size_bytes", art.size_bytes)]
    if not layout.snapshot:
        required.insert(0, ("artifact.revision", art.revision))
    for field, value in required:
        if value is None:
            raise f.fail(field, "is null on an auto-eligible entry",
                         "pin it ('hotfit registry lock') or set auto_eligible to false with this as the reason")
    if not layout.snapshot and art.file is None:
        raise f.fail("artifact.file", f"is null on an auto-eligible {e.backend} entry",
                     f"name the {layout.file_format} file")
    if layout.architecture_required and e.architecture is None:
        raise f.fail("architecture", f"is null on an auto-eligible {e.backend} entry",
                     "record the llama.cpp architecture name (src/llama-arch.cpp)")
    if e.projector is not None and (e.projector.revision is None or e.projector.size_bytes is None):
        raise f.fail("projector", "has no pinned revision or size on an auto-eligible entry",
                     "pin the projector or drop it")
    if e.chat_template is None:
        raise f.fail("chat_template", "is null on an auto-eligible entry",
                     "name the ChatTemplateURL (spec: a missing template costs the model its tool calls)")
    if e.context_limit is None:
        raise f.fail("context_limit", "is null on an auto-eligible entry",
                     "record the verified context ceiling or set auto_eligible to false (unknown context excludes)")
    if e.config.layer_groups is None:
        raise f.fail("config.layer_groups", "is null on an auto-eligible entry",
                     "record the KV geometry or set auto_eligible to false (unknown KV metadata excludes)")

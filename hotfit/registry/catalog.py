"""The curated registry document: ``{"schema": 1, "entries": [...]}`` checked and turned into a
:class:`Registry` (pure: text or decoded JSON in, frozen entries out; no file I/O).

The bundled registry is ``registry/data/curated.json`` (package data; read by
pipeline/registry_file.py, which also reads ``--registry FILE``)::

    {"schema": 1, "description": "...", "entries": [ {<every field of core.entry.Entry>}, ... ]}

Each entry is decoded by registry/schema.py (the one entry decoder, shared with the manifest);
this module adds the document's rules (schema version, a non-empty list, unique names). A broken
file raises ``RegistryError`` naming the file, the entry, the field and what to do.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from hotfit.core.entry import Entry
from hotfit.core.errors import RegistryError, UsageError
from hotfit.core.records import Fields, parse_json
from hotfit.registry.schema import REVISION_RE, decode_entry

SCHEMA_VERSION = 1
BUNDLED_RESOURCE = "data/curated.json"  # inside the registry package


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


def parse_registry_text(text: str, source: str) -> Registry:
    """Parse a registry file's text; ``source`` is how errors name the file."""
    return parse_registry(parse_json(text, _document_fail(source), kind="a registry",
                                     shape='a registry is {"schema": 1, "entries": [...]}'), source)


def parse_registry(data: Any, source: str) -> Registry:
    """Check a decoded registry document and build frozen entries (pure)."""
    if not isinstance(data, dict):
        raise RegistryError(f"{source}: the top level must be an object with 'schema' and 'entries'",
                            hint='start the file with {"schema": 1, "entries": [...]}', file=source)
    doc = Fields(_document_field_fail(source), noun="registry")
    doc.equal(data.get("schema"), "schema", SCHEMA_VERSION,
              f'set "schema": {SCHEMA_VERSION} (or upgrade hotfit for a newer registry)')
    raw_entries = doc.items(data.get("entries"), "entries", non_empty=True, what="the curated models")
    entries: list[Entry] = []
    seen: dict[str, int] = {}
    for index, raw in enumerate(raw_entries):
        entry = decode_entry(raw, entry_fields(source, index, raw))
        if entry.name in seen:
            raise RegistryError(
                f"{source}: entry {entry.name!r} (#{index}): field 'name' repeats entry #{seen[entry.name]}",
                hint="give every entry a unique name", file=source, entry=entry.name, field="name",
            )
        seen[entry.name] = index
        entries.append(entry)
    return Registry(entries=tuple(entries), source=source)


def entry_fields(source: str, index: int, raw: Any) -> Fields:
    """The reader for entry ``index`` of ``source``: its errors name the file, the entry and the field."""
    name = raw.get("name") if isinstance(raw, dict) and isinstance(raw.get("name"), str) else None
    who = f"entry {name!r} (#{index})" if name else f"entry #{index}"

    def fail(field: str, problem: str, hint: str) -> RegistryError:
        return RegistryError(f"{source}: {who}: field {field!r} {problem}", hint=hint,
                             file=source, entry=name, index=index, field=field)

    return Fields(fail, noun="registry", record="entry")


def _document_field_fail(source: str) -> Any:
    def fail(field: str, problem: str, hint: str) -> RegistryError:
        return RegistryError(f"{source}: field {field!r} {problem}", hint=hint, file=source, field=field)
    return fail


def _document_fail(source: str) -> Any:
    def fail(problem: str, hint: str, **details: Any) -> RegistryError:
        return RegistryError(f"{source}: {problem}", hint=hint, file=source, **details)
    return fail


# --------------------------------------------------------------------------- serialisation


def download_blocker(entry: Entry) -> str | None:
    """Why ``hotfit pull`` cannot fetch this entry as recorded, or None when it can.

    A GGUF is fetched only at a pinned 40-hex commit; an OpenVINO snapshot (``file`` null) follows
    the repository's current commit (spec, 'Publisher and artifact evidence'), so an open revision
    does not block it."""
    art = entry.artifact
    if art is None:
        return "no artifact is recorded for it"
    if art.file is not None and not REVISION_RE.fullmatch(art.revision or ""):
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

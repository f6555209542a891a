"""Typed readers for hotfit's JSON files (pure): one toolkit, one wording, every format's own errors.

Each file format (registry, manifest, probe file; later the download sidecar and the receipts)
decodes its document with a :class:`Fields` reader. A reader checks one value at a time and, when
it is wrong, raises the format's own error (a ``core.errors`` type) naming the file and the field
path, what is wrong with the value, and what to do::

    fields = Fields(fail)                      # fail(field, problem, hint) -> HotfitError
    size = fields.integer(obj["size_bytes"], "artifact.size_bytes", nullable=True)
    entry = fields.at("plan.entry")            # paths below this one: 'plan.entry.artifact.repo'

``fail`` is where a format puts its prefix ("curated.json: entry 'x' (#3): field ...", "probe file
p: ...") and its error class; the problem wording ("must be a positive whole number, got 0") is the
one the curated registry has always given, so every format reads alike.

Why hand-written and not msgspec/pydantic (issue 11, item 6): the checks that matter here are
cross-field rules (an auto-eligible entry needs a pinned revision, free ≤ total) that a schema
library leaves to hand-written code anyway, and msgspec's own messages ("Expected `int | null`,
got `float` - at `$.entries[0].artifact.size_bytes`") drop the value, the entry's name and the fix,
accept ``inf`` as a positive float, and refuse ``NaN`` as "JSON is malformed" without the field.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from core.errors import HotfitError


class FieldFail(Protocol):
    """Builds the format's error for one bad field: ``field`` is the full path ('devices[0].kind')."""

    def __call__(self, field: str, problem: str, hint: str) -> HotfitError: ...


class DocumentFail(Protocol):
    """Builds the format's error for a document that is not there or not JSON at all."""

    def __call__(self, problem: str, hint: str, **details: Any) -> HotfitError: ...


def parse_json(text: str, fail: DocumentFail, *, kind: str, shape: str) -> Any:
    """``json.loads`` whose failures are the format's error; ``kind`` names the format ('a registry'),
    ``shape`` is the hint for a document that is not one ('a registry is {"schema": 1, ...}')."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise fail(f"not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})",
                   "fix the JSON syntax at that position", line=exc.lineno, column=exc.colno) from None
    except RecursionError:
        # json.loads recurses per nesting level: a hostile file is an error, not a traceback
        raise fail(f"not {kind} (JSON nested too deeply)", shape) from None


class Fields:
    """Typed field readers that raise the format's error naming the field path (see module doc)."""

    def __init__(self, fail: FieldFail, *, noun: str, prefix: str = "", record: str = "(document)") -> None:
        self._fail = fail
        self.noun = noun  # the format, in "'x' is not a registry field"
        self.prefix = prefix
        self.record = record  # what the object itself is called when the path is empty ('entry')

    def at(self, prefix: str) -> Fields:
        """A reader for a nested object: its fields' paths start with ``prefix``."""
        return Fields(self._fail, noun=self.noun, prefix=self.path(prefix), record=self.record)

    def path(self, field: str) -> str:
        if not field:
            return self.prefix or self.record
        if not self.prefix:
            return field
        return f"{self.prefix}{field}" if field.startswith("[") else f"{self.prefix}.{field}"

    def fail(self, field: str, problem: str, hint: str) -> HotfitError:
        return self._fail(self.path(field), problem, hint)

    # -- shape --------------------------------------------------------------------------------

    def object(self, value: Any, field: str, keys: Iterable[str], *, optional: Iterable[str] = (),
               extra: bool = False) -> Mapping[str, Any]:
        """An object with every key of ``keys`` and only those (plus ``optional``; any with ``extra``)."""
        keys = tuple(keys)
        allowed = (*keys, *optional)
        if not isinstance(value, dict):
            raise self.fail(field, f"must be an object, got {type(value).__name__}",
                            f"write {self.path(field)} as a JSON object with keys {', '.join(keys)}")
        missing = [k for k in keys if k not in value]
        if missing:
            raise self.fail(_join(field, missing[0]), "is missing",
                            "record every field; use null for a fact that could not be verified")
        unknown = [] if extra else sorted(set(value) - set(allowed))
        if unknown:
            raise self.fail(_join(field, unknown[0]), f"is not a {self.noun} field",
                            f"remove it (known fields: {', '.join(allowed)})")
        return value

    def items(self, value: Any, field: str, *, non_empty: bool = False, what: str = "the items") -> list[Any]:
        """A JSON list (or the tuple a frozen record's ``to_json`` leaves before it is serialised)."""
        if not isinstance(value, (list, tuple)) or (non_empty and not value):
            got = "got an empty list" if isinstance(value, (list, tuple)) else f"got {type(value).__name__}"
            raise self.fail(field, f"must be a {'non-empty ' if non_empty else ''}list, {got}",
                            f"list {what} under {self.path(field)!r}")
        return list(value)

    def mapping(self, value: Any, field: str, *, nullable: bool = False) -> Mapping[str, Any]:
        """Any JSON object (free-form facts: measurements, figures); null = {} when ``nullable``."""
        if value is None and nullable:
            return {}
        if not isinstance(value, dict):
            raise self.fail(field, f"must be an object, got {type(value).__name__}", "write a JSON object")
        return value

    # -- scalars ------------------------------------------------------------------------------

    def string(self, value: Any, field: str, *, nullable: bool = False, blank: bool = False) -> Any:
        if value is None and nullable:
            return None
        if not isinstance(value, str) or (not blank and not value.strip()):
            kind = "a string" if blank else "a non-empty string"
            raise self.fail(field, f"must be {kind}{' or null' if nullable else ''}, got {value!r}",
                            "write the value as text" + (" (null if unknown)" if nullable else ""))
        return value

    def strings(self, value: Any, field: str) -> tuple[str, ...]:
        if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
            raise self.fail(field, f"must be a list of strings, got {value!r}", 'write ["...", ...]')
        return tuple(value)

    def boolean(self, value: Any, field: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(field, f"must be true or false, got {value!r}", "write a JSON boolean")
        return value

    def integer(self, value: Any, field: str, *, minimum: int | None = 1, nullable: bool = False) -> Any:
        """A whole number ≥ ``minimum`` (None: any); JSON's true/false and 12.0 are not whole numbers here."""
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
            bound = ("a whole number" if minimum is None else "a positive whole number" if minimum == 1
                     else f"a whole number ≥ {minimum}")
            raise self.fail(field, f"must be {bound}{' or null' if nullable else ''}, got {value!r}",
                            "write an exact integer (bytes, tokens or a count), never a rounded figure"
                            + ("; null if unknown" if nullable else ""))
        return value

    def number(self, value: Any, field: str, *, nullable: bool = False, what: str = "number",
               hint: str = "write a finite number") -> Any:
        """A positive finite number (json.loads accepts NaN and Infinity; neither is a figure)."""
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value > 0):
            raise self.fail(field, f"must be a positive {what}{' or null' if nullable else ''}, got {value!r}", hint)
        return float(value)

    def choice(self, value: Any, field: str, allowed: Iterable[str], *, nullable: bool = False) -> Any:
        allowed = tuple(allowed)
        if value is None and nullable:
            return None
        if value not in allowed:
            raise self.fail(field, f"is {value!r}, not one of {', '.join(allowed)}",
                            f"use one of: {', '.join(allowed)}" + (" (or null)" if nullable else ""))
        return value

    def matching(self, value: Any, field: str, pattern: re.Pattern[str], what: str, hint: str, *,
                 nullable: bool = False) -> Any:
        """A string matching ``pattern`` in full; ``what`` says what it should be ('a 40-hex commit id')."""
        if value is None and nullable:
            return None
        if not isinstance(value, str) or not pattern.fullmatch(value):
            raise self.fail(field, f"is {value!r}, not {what}", hint)
        return value

    def equal(self, value: Any, field: str, expected: Any, hint: str) -> Any:
        """A format's version marker ('schema': 1)."""
        if value != expected or isinstance(value, bool):
            raise self.fail(field, f"is {value!r}; this hotfit reads {field} {expected!r}", hint)
        return value


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key

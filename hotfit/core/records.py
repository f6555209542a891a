"""Typed readers for hotfit's JSON files (pure): one toolkit, one wording, every format's own errors.

Each file format (registry, manifest, probe file, receipts, download sidecar, serve's worker
record) decodes its document with a :class:`Fields` reader, and every stage record is decoded by
:func:`decode_record`, which walks the result dataclass's annotations with the same readers. A
reader checks one value at a time and, when it is wrong, raises the format's own error (a
``core.errors`` type) naming the file and the field path, what is wrong with the value, and what
to do::

    fields = Fields(fail)                      # fail(field, problem, hint) -> HotfitError
    size = fields.integer(obj["size_bytes"], "artifact.size_bytes", nullable=True)
    entry = fields.at("plan.entry")            # paths below this one: 'plan.entry.artifact.repo'

``fail`` is where a format puts its prefix ("curated.json: entry 'x' (#3): field ...", "probe file
p: ...", "receipt r is damaged: ...") and its error class; the problem wording ("must be a positive
whole number, got 0") is the one the curated registry has always given, so every format reads
alike. A stage record (state.db) names the wrong value's kind instead of the value ("got str"):
what a damaged record holds may be long, and it goes into the event log.

The way back is shared too: a result whose JSON is its fields is a :class:`JsonRecord`
(``to_json`` = ``dataclasses.asdict``, ``decode`` = :func:`decode_record`), and a record whose
JSON renames or drops a field builds it from :func:`field_dict`.

Why hand-written and not msgspec/pydantic: the checks that matter here are
cross-field rules (an auto-eligible entry needs a pinned revision, free ≤ total) that a schema
library leaves to hand-written code anyway, and msgspec's own messages ("Expected `int | null`,
got `float` - at `$.entries[0].artifact.size_bytes`") drop the value, the entry's name and the fix,
accept ``inf`` as a positive float, and refuse ``NaN`` as "JSON is malformed" without the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol, Self, TypeVar, Union

from hotfit.core.errors import HotfitError, StageRecordError

T = TypeVar("T")


class FieldFail(Protocol):
    """Builds the format's error for one bad field: ``field`` is the full path ('devices[0].kind')."""

    def __call__(self, field: str, problem: str, hint: str, /) -> HotfitError: ...


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
    except ValueError as exc:  # an integer too long to convert (Python's int-digits limit)
        raise fail(f"not {kind} ({exc})", shape) from None


def parse_own_file(text: str, damaged: Callable[[str], HotfitError], *, kind: str,
                   noun: str) -> tuple[Any, Fields]:
    """For a file hotfit writes and re-reads (receipt, sidecar, worker record), whose every fault is
    one error — ``damaged(why)``, e.g. "receipt r is damaged: <why>": the parsed JSON, and a reader
    whose errors are ``damaged("<field> <problem>")``. ``kind`` names the format ('a receipt')."""
    doc = parse_json(text, lambda problem, hint, **details: damaged(problem), kind=kind,
                     shape=f"{kind} is a JSON object")
    return doc, Fields(lambda field, problem, hint: damaged(f"{field} {problem}"), noun=noun, record="top level")


class Fields:
    """Typed field readers that raise the format's error naming the field path (see module doc)."""

    def __init__(self, fail: FieldFail, *, noun: str, prefix: str = "", record: str = "(document)",
                 values: bool = True) -> None:
        self._fail = fail
        self.noun = noun  # the format, in "'x' is not a registry field"
        self.prefix = prefix
        self.record = record  # what the object itself is called when the path is empty ('entry')
        self.values = values  # a wrong value is shown as itself ('got 0'); False: by its kind ('got str')

    def at(self, prefix: str) -> Fields:
        """A reader for a nested object: its fields' paths start with ``prefix``."""
        return Fields(self._fail, noun=self.noun, prefix=self.path(prefix), record=self.record, values=self.values)

    def got(self, value: Any) -> str:
        return repr(value) if self.values else _kind(value)

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
            raise self.fail(field, f"must be an object, got {_kind(value)}",
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

    def items(self, value: Any, field: str, *, non_empty: bool = False, what: str = "the items",
              length: int | None = None) -> list[Any]:
        """A JSON list (or the tuple a frozen record's ``to_json`` leaves before it is serialised);
        ``length``: exactly that many items (a pair)."""
        if not isinstance(value, (list, tuple)) or (non_empty and not value):
            got = "got an empty list" if isinstance(value, (list, tuple)) else f"got {_kind(value)}"
            raise self.fail(field, f"must be a {'non-empty ' if non_empty else ''}list, {got}",
                            f"list {what} under {self.path(field)!r}")
        if length is not None and len(value) != length:
            raise self.fail(field, f"must hold {length} items, got {len(value)}", f"list {what} under "
                            f"{self.path(field)!r}")
        return list(value)

    def mapping(self, value: Any, field: str, *, nullable: bool = False) -> Mapping[str, Any]:
        """Any JSON object (free-form facts: measurements, figures); null = {} when ``nullable``."""
        if value is None and nullable:
            return {}
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise self.fail(field, f"must be an object, got {_kind(value)}", "write a JSON object")
        return value

    # -- scalars ------------------------------------------------------------------------------

    def string(self, value: Any, field: str, *, nullable: bool = False, blank: bool = False) -> Any:
        if value is None and nullable:
            return None
        if not isinstance(value, str) or (not blank and not value.strip()):
            kind = "a string" if blank else "a non-empty string"
            raise self.fail(field, f"must be {kind}{' or null' if nullable else ''}, got {self.got(value)}",
                            "write the value as text" + (" (null if unknown)" if nullable else ""))
        return value

    def strings(self, value: Any, field: str) -> tuple[str, ...]:
        if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
            raise self.fail(field, f"must be a list of strings, got {self.got(value)}", 'write ["...", ...]')
        return tuple(value)

    def boolean(self, value: Any, field: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(field, f"must be true or false, got {self.got(value)}", "write a JSON boolean")
        return value

    def integer(self, value: Any, field: str, *, minimum: int | None = 1, nullable: bool = False) -> Any:
        """A whole number ≥ ``minimum`` (None: any); JSON's true/false and 12.0 are not whole numbers here."""
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
            bound = ("a whole number" if minimum is None else "a positive whole number" if minimum == 1
                     else f"a whole number ≥ {minimum}")
            raise self.fail(field, f"must be {bound}{' or null' if nullable else ''}, got {self.got(value)}",
                            "write an exact integer (bytes, tokens or a count), never a rounded figure"
                            + ("; null if unknown" if nullable else ""))
        return value

    def number(self, value: Any, field: str, *, nullable: bool = False, what: str = "number",
               hint: str = "write a finite number", positive: bool = True) -> Any:
        """A positive finite number (json.loads accepts NaN and Infinity; neither is a figure);
        ``positive`` False: any number (a measurement a stage recorded)."""
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and not (
                math.isfinite(value) and value > 0)):
            sign = "positive " if positive else ""
            raise self.fail(field, f"must be a {sign}{what}{' or null' if nullable else ''}, got {self.got(value)}",
                            hint)
        return float(value)

    def choice(self, value: Any, field: str, allowed: Iterable[str], *, nullable: bool = False) -> Any:
        allowed = tuple(allowed)
        if value is None and nullable:
            return None
        if value not in allowed:
            names = ", ".join(map(str, allowed))
            raise self.fail(field, f"is {value!r}, not one of {names}",
                            f"use one of: {names}" + (" (or null)" if nullable else ""))
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


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


# -- stage records ----------------------------------------------------------------------------
# A reused stage hands downstream the same frozen dataclass a fresh run returns, decoded from its
# record by the dataclass's own annotations: str, int, float, bool, None, Path, ``X | None``,
# ``Literal[...]``, ``tuple[X, ...]``, ``tuple[X, Y]``, ``list[X]``, ``dict[str, X]``, ``Any`` and
# nested dataclasses. Anything else in a record — a missing field, a field of the wrong kind, a key
# the type does not have (a record from another version is not half-trusted) — is a
# StageRecordError naming the field path, which the runner turns into "rerun the stage".


def stage_record_fail(field: str, problem: str, hint: str) -> StageRecordError:
    """The :class:`FieldFail` of stage records: '<field>: <problem>', the field in the details (the
    runner's own hint, "the stage runs again", replaces the format's)."""
    where = "" if field == "(document)" else field
    return StageRecordError(f"{where or '(record)'}: {problem}", field=where or None)


_RECORD = Fields(stage_record_fail, noun="record", record="", values=False)
_hints_cache: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _hints_cache:
        _hints_cache[cls] = typing.get_type_hints(cls)
    return _hints_cache[cls]


def _value(tp: Any, value: Any, path: str, extra_keys: frozenset[str]) -> Any:
    f = _RECORD
    if tp is Any or tp is object:
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # ``X | None``: X's own error names the field
            return _value(options[0], value, path, extra_keys)
        errors: list[str] = []
        for option in options:
            try:
                return _value(option, value, path, extra_keys)
            except StageRecordError as exc:
                errors.append(exc.what)
        raise f.fail(path, f"fits none of {tp} ({'; '.join(errors)})", "")
    if origin is Literal:
        return f.choice(value, path, tuple(args))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_value(args[0], v, f"{path}[{i}]", extra_keys) for i, v in enumerate(f.items(value, path)))
        items = f.items(value, path, length=len(args))
        return tuple(_value(a, v, f"{path}[{i}]", extra_keys) for i, (a, v) in enumerate(zip(args, items)))
    if origin is list:
        return [_value(args[0], v, f"{path}[{i}]", extra_keys) for i, v in enumerate(f.items(value, path))]
    if origin is dict:
        return {k: _value(args[1], v, _join(path, k), extra_keys) for k, v in f.mapping(value, path).items()}
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return decode_record(tp, value, extra_keys=extra_keys, path=path)
    readers: dict[Any, Any] = {
        bool: f.boolean,
        int: lambda v, p: f.integer(v, p, minimum=None),
        float: lambda v, p: f.number(v, p, positive=False),  # a whole figure may come back as an int
        str: lambda v, p: f.string(v, p, blank=True),
        Path: lambda v, p: Path(f.string(v, p)),  # recorded as its text
    }
    if tp in readers:
        return readers[tp](value, path)
    if tp is type(None):
        if value is not None:
            raise f.fail(path, f"must be null, got {_kind(value)}", "")
        return None
    raise TypeError(f"decode_record cannot decode a field of type {tp!r} ({path})")  # a programming error


def decode_record(cls: type[T], data: Any, *, extra_keys: frozenset[str] = frozenset(), path: str = "") -> T:
    """``data`` (a stage record's JSON) as a ``cls`` instance; :class:`StageRecordError` naming the field
    when it does not fit. ``extra_keys``: keys a record may carry that are not fields (ignored)."""
    if isinstance(data, Mapping) and not isinstance(data, dict):
        data = dict(data)
    # T is any record dataclass (unbounded: a bound would not admit the frozen results' own types)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    required = [n for n, f in fields.items() if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
    record = _RECORD.object(data, path, required, extra=True)
    unknown = sorted(set(record) - set(fields) - extra_keys)
    if unknown:
        raise _RECORD.fail(path, f"has keys {cls.__name__} does not: {', '.join(unknown)}", "")
    hints = _hints(cls)
    values = {name: _value(hints[name], record[name], _join(path, name), extra_keys)
              for name in fields if name in record}
    return cls(**values)


# --------------------------------------------------------------------------- the way back: to JSON


def field_dict(record: Any, *, omit: Iterable[str] = ()) -> dict[str, Any]:
    """A dataclass's fields by name, in declaration order, values as they are (shallow, unlike
    ``dataclasses.asdict``): the JSON of a record whose keys are its field names, less ``omit``."""
    skip = frozenset(omit)
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if f.name not in skip}


class JsonRecord:
    """Mixin of a frozen result dataclass whose JSON is its fields: ``to_json`` is
    ``dataclasses.asdict`` and ``decode`` is :func:`decode_record`, so a record written by one reads
    back through the other (a stage reused from ``state.db`` hands on the type a fresh one does)."""

    if typing.TYPE_CHECKING:  # what @dataclass adds to each subclass: asdict(self) then type-checks
        __dataclass_fields__: typing.ClassVar[dict[str, dataclasses.Field[Any]]]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def decode(cls, data: Mapping[str, Any]) -> Self:
        return decode_record(cls, data)


def canonical_json(value: Any) -> str:
    """One JSON text per value (sorted keys, no spaces): what content hashes are taken of."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)

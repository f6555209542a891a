"""Decode a stage's recorded outputs (JSON) back into the frozen dataclass a fresh run returns.

A stage that is reused hands downstream the same type a fresh run does, so no caller branches on
"dict or dataclass". The decoder is driven by the dataclass's own field annotations: str, int,
float, bool, None, ``Path``, ``X | None``, ``Literal[...]``, ``tuple[X, ...]``, ``tuple[X, Y]``,
``dict[str, X]``, ``Any`` and nested dataclasses. Anything else in a record — a missing field,
a field of the wrong kind, a key the type does not have — is a :class:`StageRecordError` naming
the field path, which the runner turns into "rerun the stage". (The probe and the plan, which have
their one decoder on the ``core.records`` toolkit, decode their stage records with it and
:func:`stage_record_fail`.) Unknown keys are refused (a record
from another version is not half-trusted) unless listed in ``extra_keys`` (e.g. a ``schema`` tag).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

from core.errors import StageRecordError

T = TypeVar("T")

_hints_cache: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _hints_cache:
        _hints_cache[cls] = typing.get_type_hints(cls)
    return _hints_cache[cls]


def _fail(path: str, problem: str) -> StageRecordError:
    return StageRecordError(f"{path or '(record)'}: {problem}", field=path or None)


def stage_record_fail(field: str, problem: str, hint: str) -> StageRecordError:
    """A ``core.records.FieldFail`` for stage records: where a format already has its one decoder on
    the records toolkit (the probe, the plan), a stage record is decoded with it and this error."""
    return _fail("" if field == "(document)" else field, problem)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _value(tp: Any, value: Any, path: str, extra_keys: frozenset[str]) -> Any:
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
        raise _fail(path, f"fits none of {tp} ({'; '.join(errors)})")
    if origin is Literal:
        if value not in args:
            raise _fail(path, f"must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _fail(path, f"must be a list, got {_kind(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_value(args[0], v, f"{path}[{i}]", extra_keys) for i, v in enumerate(value))
        if len(args) != len(value):
            raise _fail(path, f"must hold {len(args)} items, got {len(value)}")
        return tuple(_value(a, v, f"{path}[{i}]", extra_keys) for i, (a, v) in enumerate(zip(args, value)))
    if origin is list:
        if not isinstance(value, list):
            raise _fail(path, f"must be a list, got {_kind(value)}")
        return [_value(args[0], v, f"{path}[{i}]", extra_keys) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _fail(path, f"must be an object, got {_kind(value)}")
        return {k: _value(args[1], v, f"{path}.{k}", extra_keys) for k, v in value.items()}
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return decode_record(tp, value, extra_keys=extra_keys, path=path)
    if tp is bool:
        if not isinstance(value, bool):
            raise _fail(path, f"must be true or false, got {_kind(value)}")
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _fail(path, f"must be a whole number, got {_kind(value)}")
        return value
    if tp is float:  # JSON writes 2.0 as 2.0 but a whole figure may come back as an int
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _fail(path, f"must be a number, got {_kind(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _fail(path, f"must be a string, got {_kind(value)}")
        return value
    if tp is Path:  # recorded as its text
        if not isinstance(value, str) or not value:
            raise _fail(path, f"must be a path (a non-empty string), got {_kind(value)}")
        return Path(value)
    if tp is type(None):
        if value is not None:
            raise _fail(path, f"must be null, got {_kind(value)}")
        return None
    raise TypeError(f"decode_record cannot decode a field of type {tp!r} ({path})")  # a programming error


def decode_record(cls: type[T], data: Any, *, extra_keys: frozenset[str] = frozenset(), path: str = "") -> T:
    """``data`` (a stage record's JSON) as a ``cls`` instance; :class:`StageRecordError` naming the field
    when it does not fit. ``extra_keys``: keys a record may carry that are not fields (ignored)."""
    if not isinstance(data, Mapping):
        raise _fail(path, f"must be an object, got {_kind(data)}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields) - extra_keys)
    if unknown:
        raise _fail(path, f"has keys {cls.__name__} does not: {', '.join(unknown)}")
    values: dict[str, Any] = {}
    for name, f in fields.items():
        where = f"{path}.{name}" if path else name
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _fail(where, "is missing")
            continue
        values[name] = _value(hints[name], data[name], where, extra_keys)
    return cls(**values)

"""A small JSON-Schema subset validator for the grade's flat tool schemas (pure).

The grade's tools use only ``type: object`` with scalar properties, ``enum``, ``minimum``,
``required`` and ``additionalProperties: false``, so this checks exactly that and no more:
a full JSON-Schema engine is a dependency the grade does not need. An argument the schema does
not name is an error (NexusBench's "too much information" lesson: an invented key is a defect).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["validate_arguments"]

_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
}


def _type_ok(value: Any, type_name: str) -> bool:
    if type_name in ("integer", "number") and isinstance(value, bool):
        return False  # JSON true is not a number, though Python's bool is an int
    if type_name == "number" and isinstance(value, float) and math.isnan(value):
        return False
    return isinstance(value, _TYPES[type_name])


def validate_arguments(schema: Mapping[str, Any], args: Any) -> str | None:
    """None when ``args`` satisfies ``schema``; else one sentence naming the first problem."""
    if not isinstance(args, dict):
        return f"arguments must be a JSON object, got {type(args).__name__}"
    props: Mapping[str, Any] = schema.get("properties", {})
    for name in schema.get("required", ()):
        if name not in args:
            return f"missing required argument {name!r}"
    for name, value in args.items():
        if name not in props:
            if schema.get("additionalProperties", True) is False:
                return f"unknown argument {name!r} (allowed: {', '.join(sorted(props)) or 'none'})"
            continue
        spec = props[name]
        type_name = spec.get("type")
        if type_name and not _type_ok(value, type_name):
            return f"argument {name!r} must be of type {type_name}, got {json_type(value)}"
        if type_name == "array" and "items" in spec:
            item_type = spec["items"].get("type")
            if item_type and not all(_type_ok(v, item_type) for v in value):
                return f"every item of {name!r} must be of type {item_type}"
        if "enum" in spec and value not in spec["enum"]:
            return f"argument {name!r} must be one of {spec['enum']}, got {value!r}"
        if "minimum" in spec and value < spec["minimum"]:
            return f"argument {name!r} must be at least {spec['minimum']}, got {value!r}"
    return None


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"

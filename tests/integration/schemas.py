"""The JSON schemas structured outputs are tested with, shared by the offline engine's tests
(test_structured_outputs.py) and the cluster checks (structured_checks.py): at least 20, covering
nested objects, arrays with item bounds, enums, ``anyOf``, string patterns and formats, and
numbers with bounds. Strings are short and arrays small, so outputs stay short.

``validate`` is the one check a reply must pass: JSON, valid by ``jsonschema`` with its
``FormatChecker`` (so ``date``, ``uuid`` and ``ipv4`` are checked, not only typed).
"""

from __future__ import annotations

import json

import jsonschema

S = {"type": "string", "maxLength": 12}
INT = {"type": "integer", "minimum": 0, "maximum": 999}


def obj(**properties) -> dict:
    """An object schema that requires every property it lists."""
    return {"type": "object", "properties": properties, "required": list(properties)}


def pattern(regex: str) -> dict:
    return {"type": "string", "pattern": regex}


def fmt(name: str) -> dict:
    return {"type": "string", "format": name}


def array(items: dict, lo: int, hi: int) -> dict:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


SCHEMAS = [
    obj(name=S, age=INT),
    {**obj(city=S, population={"type": "integer", "minimum": 1000, "maximum": 99999}), "additionalProperties": False},
    obj(user=obj(id=INT, email=pattern("^[a-z]{1,8}@[a-z]{1,8}\\.com$"))),
    obj(tags=array(S, 1, 3)),
    obj(scores=array(INT, 2, 4)),
    obj(color={"enum": ["red", "green", "blue"]}),
    obj(status={"type": "string", "enum": ["active", "inactive", "banned"]},
        level={"type": "integer", "enum": [1, 2, 3]}),
    {"anyOf": [obj(kind={"const": "circle"}, r=INT), obj(kind={"const": "square"}, side=INT)]},
    obj(value={"anyOf": [INT, {"type": "null"}, {"type": "boolean"}]}),
    obj(code=pattern("^[A-Z]{3}-[0-9]{3}$")),
    obj(zip=pattern("^[0-9]{5}$"), state=pattern("^[A-Z]{2}$")),
    obj(date=fmt("date")),
    obj(id=fmt("uuid")),
    obj(ip=fmt("ipv4")),
    obj(price={"type": "number", "minimum": 0, "maximum": 100},
        qty={"type": "integer", "exclusiveMinimum": 0, "maximum": 10}),
    obj(temp={"type": "number", "minimum": -50, "maximum": 50}),
    obj(items=array(obj(sku=S, n=INT), 1, 2)),
    obj(a=obj(b=obj(c=INT))),
    array({"type": "boolean"}, 2, 3),
    obj(ok={"type": "boolean"}, note={"type": ["string", "null"], "maxLength": 10}),
    obj(title={"type": "string", "minLength": 2, "maxLength": 8},
        year={"type": "integer", "minimum": 1900, "maximum": 2100}),
]


def validate(text: str, schema: dict) -> None:
    """``text`` is JSON valid by ``schema``, formats included (raises otherwise)."""
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())

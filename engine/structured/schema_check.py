"""Which JSON-schema keywords a constraint may use: the ones the grammar engine enforces.

xgrammar 0.2.8 compiles a schema that uses a keyword it cannot enforce without complaint (or
with a line on stderr), and the output may then violate the schema. Measured on this model
(``/tmp`` probe in the commit message): ``not``, ``allOf`` with several subschemas, a ``$ref`` to
anything but this document, and an unknown ``format`` are not enforced; everything else that
JSON Schema validates (types, ``properties``/``required``/``additionalProperties``,
``patternProperties``, ``propertyNames``, ``min/maxProperties``, ``dependentRequired``, ``if``/
``then``, ``items``/``prefixItems``/``min/maxItems``/``uniqueItems``/``contains``, ``enum``/
``const``, ``anyOf``/``oneOf``, string ``pattern``/``min/maxLength``/the formats below, numeric
bounds and ``multipleOf``) is. ``oneOf`` whose branches overlap is enforced as ``anyOf``.

``unsupported_keyword(schema)`` is pure: the first keyword the engine would not enforce, with
its JSON pointer, or None. ``check_schema(params)`` raises it as the error a request gets; it
needs no grammar engine, so a router runs it before any worker sees the request.
"""

from __future__ import annotations

from typing import Any

from engine.structured.errors import StructuredOutputError
from engine.structured.params import StructuredOutputsParams

UNSUPPORTED = {
    "not": "'not' is not enforced by the grammar engine",
    "$dynamicRef": "'$dynamicRef' is not supported",
    "$recursiveRef": "'$recursiveRef' is not supported",
    "dependentSchemas": "'dependentSchemas' is not enforced by the grammar engine",
    "unevaluatedItems": "'unevaluatedItems' is not enforced by the grammar engine",
}
FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "uri", "uri-reference",
                     "uri-template", "uuid", "ipv4", "ipv6", "hostname"})
# keywords whose value is a schema, a list of schemas, or a map of names to schemas
_SCHEMA = ("items", "additionalProperties", "contains", "propertyNames", "if", "then", "else",
           "unevaluatedProperties", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def unsupported_keyword(schema: Any, pointer: str = "") -> tuple[str, str] | None:
    """(JSON pointer, why) of the first keyword ``schema`` uses that would not be enforced."""
    if not isinstance(schema, dict):
        return None
    for keyword, why in UNSUPPORTED.items():
        if keyword in schema:
            return f"{pointer}/{keyword}", why
    ref = schema.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        return f"{pointer}/$ref", f"only references inside the schema ('#/...') are supported, got {ref!r}"
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return f"{pointer}/allOf", "'allOf' with more than one subschema is not enforced by the grammar engine"
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in FORMATS:
        return f"{pointer}/format", f"format {fmt!r} is not supported; supported: {sorted(FORMATS)}"
    for keyword in _SCHEMA:
        found = unsupported_keyword(schema.get(keyword), f"{pointer}/{keyword}")
        if found:
            return found
    for keyword in _SCHEMA_LISTS:
        for i, sub in enumerate(schema.get(keyword) or ()):
            found = unsupported_keyword(sub, f"{pointer}/{keyword}/{i}")
            if found:
                return found
    for keyword in _SCHEMA_MAPS:
        subs = schema.get(keyword)
        for name, sub in (subs.items() if isinstance(subs, dict) else ()):
            found = unsupported_keyword(sub, f"{pointer}/{keyword}/{name}")
            if found:
                return found
    return None


def check_schema(params: StructuredOutputsParams) -> None:
    """StructuredOutputError naming ``params.field_name`` when its JSON schema (kind 'json')
    uses a keyword the engine would not enforce; other kinds pass."""
    if params.kind != "json":
        return
    found = unsupported_keyword(params.schema())
    if found is not None:
        pointer, why = found
        raise StructuredOutputError(params.field_name, f"unsupported schema keyword at '{pointer or '/'}': {why}")

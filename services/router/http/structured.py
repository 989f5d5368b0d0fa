"""The structured-output fields of an OpenAI request body -> one StructuredOutputsParams.

    response_format {"type": "json_object"}                       field "response_format"
    response_format {"type": "json_schema",                       field "response_format.json_schema"
                     "json_schema": {"name", "schema", "strict"}}
    guided_json | guided_regex | guided_choice | guided_grammar   field: its own name (vLLM's extras)
    structured_outputs {json | regex | choice | grammar |         field "structured_outputs.<kind>"
                        json_object}                              (vLLM's newer form)

``response_format {"type": "text"}`` is no constraint. A request takes at most one constraint:
two are refused naming both. Only the shape of each field is checked here (InvalidRequest
naming it); its content (a schema's keywords) is checked by the Frontend and compiled by the
engine, whose errors name the same field. ``json_schema.strict`` unset is strict (the output
writes only the properties the schema declares; OpenAI's strict schemas ask for that anyway).
Pure functions, no I/O.
"""

from __future__ import annotations

from typing import Any

from engine.structured.params import StructuredOutputsParams
from services.router.errors import InvalidRequest

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def structured_outputs_of(body: dict[str, Any]) -> StructuredOutputsParams | None:
    """The one constraint ``body`` asks for, or None."""
    found: list[StructuredOutputsParams] = []
    response_format = _response_format(body.get("response_format"))
    if response_format is not None:
        found.append(response_format)
    for name, kind in GUIDED_FIELDS.items():
        if body.get(name) is not None:
            found.append(_constraint(kind, body[name], name))
    found.extend(_structured_outputs(body.get("structured_outputs")))
    if len(found) > 1:
        fields = [str(so.field) for so in found]
        raise InvalidRequest(f"{fields[0]} and {fields[1]} are both set; a request takes one output "
                             "constraint", fields[0])
    return found[0] if found else None


def _response_format(value: Any) -> StructuredOutputsParams | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, field="response_format")
    if kind != "json_schema":
        raise InvalidRequest("response_format must be {'type': 'text'}, {'type': 'json_object'} or "
                             f"{{'type': 'json_schema', 'json_schema': {{...}}}}, got {value!r:.80}",
                             "response_format")
    field = "response_format.json_schema"
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest(f"{field} must be an object with the schema under 'schema', got {spec!r:.60}", field)
    schema, strict = spec.get("schema"), spec.get("strict")
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{field}.schema must be a JSON schema (an object), got {schema!r:.60}", field)
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest(f"{field}.strict must be a boolean, got {strict!r:.60}", field)
    return StructuredOutputsParams(json=schema, strict=True if strict is None else strict, field=field)


def _structured_outputs(value: Any) -> list[StructuredOutputsParams]:
    if value is None:
        return []
    if not isinstance(value, dict):
        raise InvalidRequest(f"structured_outputs must be an object, got {value!r:.60}", "structured_outputs")
    unknown = sorted(set(value) - set(_STRUCTURED_KINDS))
    if unknown:
        raise InvalidRequest(f"structured_outputs: unknown keys {unknown}; known: {list(_STRUCTURED_KINDS)}",
                             "structured_outputs")
    return [_constraint(kind, value[kind], f"structured_outputs.{kind}") for kind in _STRUCTURED_KINDS
            if value.get(kind) not in (None, False)]


def _constraint(kind: str, value: Any, field: str) -> StructuredOutputsParams:
    """One constraint of ``kind``; the types a JSON body could get wrong are refused here."""
    if kind == "json" and not isinstance(value, (dict, str)):
        raise InvalidRequest(f"{field} must be a JSON schema (an object, or its JSON text), got {value!r:.60}", field)
    if kind == "choice" and not (isinstance(value, list) and all(isinstance(c, str) for c in value)):
        raise InvalidRequest(f"{field} must be a list of strings, got {value!r:.60}", field)
    if kind in ("regex", "grammar") and not isinstance(value, str):
        raise InvalidRequest(f"{field} must be a string, got {value!r:.60}", field)
    if kind == "json_object" and value is not True:
        raise InvalidRequest(f"{field} must be true, got {value!r:.60}", field)
    return StructuredOutputsParams(**{kind: value}, field=field)

"""StructuredOutputsParams: the constraint a request's output must match, as the request gave it.

Torch-free and free of any grammar engine: the router builds and validates it, the wire carries
its fields, and the engine compiles it (``compiler.py``). Exactly one kind is set::

    json         a JSON schema (a dict, or its JSON text); ``strict`` forbids properties and
                 items the schema does not declare (OpenAI's ``json_schema.strict``; a tool's
                 argument schema is just this)
    json_object  any JSON object (``response_format: {"type": "json_object"}``)
    regex        a regular expression the whole output matches
    choice       one of these strings, exactly
    grammar      an EBNF grammar in GBNF syntax (llama.cpp / xgrammar: ``root ::= ...``)

``field`` is the request field the constraint came from, for error messages
(``StructuredOutputError.field``); None names it by its kind (``structured_outputs.regex``).
Names follow vLLM's ``StructuredOutputsParams``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from engine.structured.errors import StructuredOutputError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SOURCE_CHARS = 256 * 1024  # a schema, regex or grammar longer than this is refused unread


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    strict: bool = True
    field: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, list):
            object.__setattr__(self, "choice", list(self.choice))

    @classmethod
    def of(cls, value: StructuredOutputsParams | dict[str, Any]) -> StructuredOutputsParams:
        """From itself or from the JSON object a request carried (its keys are the fields)."""
        if isinstance(value, StructuredOutputsParams):
            return value
        if not isinstance(value, dict):
            raise StructuredOutputError("structured_outputs", f"must be an object, got {type(value).__name__}")
        unknown = sorted(set(value) - {*KINDS, "strict", "field"})
        if unknown:
            raise StructuredOutputError("structured_outputs", f"unknown keys {unknown}; known: {list(KINDS)}")
        return cls(**value)

    @property
    def kind(self) -> str:
        """Which of ``KINDS`` is set (``validate`` checks there is exactly one)."""
        return self._set_kinds()[0]

    @property
    def field_name(self) -> str:
        return self.field or f"structured_outputs.{self._set_kinds()[0] if self._set_kinds() else 'json'}"

    def _set_kinds(self) -> list[str]:
        return [k for k in KINDS if getattr(self, k) not in (None, False)]

    def validate(self) -> None:
        """Raise StructuredOutputError for a shape no grammar engine could take (compiling is
        the engine's check of the content)."""
        kinds = self._set_kinds()
        if len(kinds) != 1:
            raise StructuredOutputError(self.field or "structured_outputs",
                                        f"set exactly one of {list(KINDS)}, got {kinds or 'none'}")
        field, kind = self.field_name, kinds[0]
        if kind == "json":
            if not isinstance(self.json, (dict, str)):
                raise StructuredOutputError(field, f"a JSON schema is an object, got {type(self.json).__name__}")
            self.schema()  # parses it
        elif kind == "choice":
            assert self.choice is not None
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise StructuredOutputError(field, "choice must be a non-empty list of non-empty strings")
        elif kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise StructuredOutputError(field, f"{kind} must be a non-empty string")
        if len(self.source) > MAX_SOURCE_CHARS:
            raise StructuredOutputError(field, f"is {len(self.source)} characters; at most {MAX_SOURCE_CHARS}")
        if not isinstance(self.strict, bool):
            raise StructuredOutputError(field, f"strict must be true or false, got {self.strict!r}")

    def schema(self) -> dict[str, Any]:
        """The JSON schema (kind 'json') as a dict; StructuredOutputError if its text is not JSON."""
        if isinstance(self.json, dict):
            return self.json
        try:
            schema = json.loads(self.json or "")
        except json.JSONDecodeError as e:
            raise StructuredOutputError(self.field_name, f"the schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise StructuredOutputError(self.field_name, f"a JSON schema is an object, got {type(schema).__name__}")
        return schema

    @property
    def source(self) -> str:
        """The constraint as one string: a schema re-serialised compactly, keys in their order
        (the order of ``properties`` is the order the output writes them)."""
        kind = self.kind
        if kind == "json":
            return json.dumps(self.schema(), separators=(",", ":"))
        if kind == "json_object":
            return ""
        if kind == "choice":
            return json.dumps(self.choice)
        return str(getattr(self, kind))

    @property
    def key(self) -> str:
        """The compiled grammar's cache key: a hash of kind, strictness and canonical source
        (``field`` is not part of it: the same schema from two fields compiles once)."""
        text = f"{self.kind}\x00{int(self.strict)}\x00{self.source}"
        return hashlib.sha256(text.encode()).hexdigest()

"""The one error structured outputs raise for bad input, typed where it arises.

A ``StructuredOutputError`` is a ``ValueError`` (services already map ValueError from
``add_request`` to HTTP 400 / gRPC INVALID_ARGUMENT) that names the request field at fault, as the
client wrote it (``response_format.json_schema``, ``structured_outputs.regex``,
``tools[0].function.parameters``), so the mapping can point at it.
"""

from __future__ import annotations


class StructuredOutputError(ValueError):
    """A constraint that is malformed, unsupported, does not compile, or compiles too slowly."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message

"""A tool call as OpenAI returns it, and the replies of the constrained tool choices.

    call.openai()                         {"id", "type": "function", "function": {name, arguments}}
    call.openai(index=0)                  the same as one ``delta.tool_calls`` entry of a stream
    calls_from_required(text)             tool_choice required: the JSON array -> calls
    stream = NamedCallStream("f")         tool_choice {"function": {"name": "f"}}: each text delta
    stream.feed(delta) -> delta entry     of the arguments is the next piece of one call's arguments
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text
    id: str = field(default_factory=new_call_id)

    def openai(self, index: int | None = None) -> dict[str, Any]:
        entry: dict[str, Any] = {"id": self.id, "type": "function",
                                 "function": {"name": self.name, "arguments": self.arguments}}
        return entry if index is None else {"index": index, **entry}


def call_from_object(value: Any, names: frozenset[str]) -> ToolCall | None:
    """{"name": N, "arguments": {...}} (or "parameters", as some models write) -> a call, or
    None for anything else, a name not among ``names`` included."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # arguments written as JSON text: kept if it is an object
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def calls_from_required(text: str, names: frozenset[str]) -> list[ToolCall]:
    """The reply of ``tool_choice: required`` (decoded under the array schema of spec.py) as
    calls; [] when it is not such an array (a reply cut at max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    calls = [call_from_object(item, names) for item in value] if isinstance(value, list) else []
    return [c for c in calls if c is not None] if all(calls) else []


class NamedCallStream:
    """Stream deltas of the one call of ``tool_choice: {"function": {"name": N}}``: the first
    entry carries the id, type and name; each carries the next piece of the arguments text."""

    def __init__(self, name: str) -> None:
        self.call = ToolCall(name, "")
        self._started = False

    def feed(self, text: str) -> dict[str, Any] | None:
        if self._started and not text:
            return None
        if self._started:
            return {"index": 0, "function": {"arguments": text}}
        self._started = True
        entry = self.call.openai(index=0)
        entry["function"]["arguments"] = text
        return entry

"""A chat completion's ``tools`` and ``tool_choice`` (OpenAI's shapes), validated, and the
constraint each choice decodes under (engine/structured: exact, never a retry).

    tools = parse_tools(body.get("tools"))                        # [] when absent
    choice = parse_tool_choice(body.get("tool_choice"), tools)    # auto when tools, else none
    constraint = tool_constraint(choice, tools)                   # StructuredOutputsParams | None

    none      the tools are not offered; the reply is text
    auto      the model decides; its text is parsed for calls in its own format (hermes.py)
    required  the reply is a JSON array of one or more {"name", "arguments"} objects (one with
              parallel_tool_calls false), each name one of the tools' and its arguments valid
              under that tool's parameters schema
    function  ({"type": "function", "function": {"name": N}}) the reply is N's arguments object

Bad input raises ``InvalidRequest`` naming the field (``tools[1].function.name``); a schema the
grammar engine cannot compile is refused by the engine under the field named here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from engine.structured.params import StructuredOutputsParams
from services.router.errors import InvalidRequest

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function name
MODES = ("none", "auto", "required")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]
    description: str | None = None
    index: int = 0  # its place in ``tools``, for error messages

    @property
    def field(self) -> str:
        return f"tools[{self.index}].function.parameters"

    def openai(self) -> dict[str, Any]:
        """The tool as the request gave it (OpenAI's shape), for a prompt that lists the tools."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # none | auto | required | function
    name: str | None = None  # mode function: the one function to call


def parse_tools(value: Any) -> list[Tool]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequest(f"tools must be a list of function tools, got {type(value).__name__}", "tools")
    tools: list[Tool] = []
    for i, entry in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(entry, dict) or entry.get("type") != "function":
            raise InvalidRequest(f"{where} must be {{'type': 'function', 'function': {{...}}}}", f"{where}.type")
        function = entry.get("function")
        if not isinstance(function, dict):
            raise InvalidRequest(f"{where}.function must be an object with a name", f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise InvalidRequest(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r:.80}",
                                 f"{where}.function.name")
        if any(t.name == name for t in tools):
            raise InvalidRequest(f"{where}.function.name {name!r} is already the name of another tool",
                                 f"{where}.function.name")
        parameters = function.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise InvalidRequest(f"{where}.function.parameters must be a JSON schema object, got "
                                 f"{type(parameters).__name__}", f"{where}.function.parameters")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequest(f"{where}.function.description must be a string", f"{where}.function.description")
        tools.append(Tool(name, parameters, description, i))
    return tools


def parse_tool_choice(value: Any, tools: list[Tool]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in MODES:
            raise InvalidRequest(f"tool_choice must be one of {list(MODES)} or a named function, got {value!r:.80}",
                                 "tool_choice")
        if value != "none" and not tools:
            raise InvalidRequest(f"tool_choice {value!r} needs tools", "tool_choice")
        return ToolChoice(value)
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or "
                             "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if not any(t.name == name for t in tools):
        raise InvalidRequest(f"tool_choice names function {name!r:.80}, which is not among the tools "
                             f"({[t.name for t in tools]})", "tool_choice.function.name")
    return ToolChoice("function", name)


def tool_constraint(choice: ToolChoice, tools: list[Tool], parallel: bool = True) -> StructuredOutputsParams | None:
    """What the reply decodes under: None for none / auto (free text, parsed afterwards).
    ``parallel`` false (``parallel_tool_calls: false``): at most one call."""
    if choice.mode == "function":
        tool = next(t for t in tools if t.name == choice.name)
        return StructuredOutputsParams(json=tool.parameters, field=tool.field)
    if choice.mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema, field="tools")

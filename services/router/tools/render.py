"""A chat history with tools, as messages any chat template renders (string contents, the roles
system / user / assistant): the form the Hermes format gives them, which SmolLM2, Qwen2 and most
tool-tuned chat models were trained on.

    messages = render_messages(messages, tools)    # messages: content already flattened to str

- the tools (when offered) go into the system message: each tool's OpenAI JSON inside
  ``<tools></tools>``, and how to call one (a ``<tool_call>`` block, hermes.py reads it back);
  an existing system message keeps its text first;
- an assistant turn's ``tool_calls`` become its ``<tool_call>`` blocks, after its text;
- a ``tool`` result becomes a ``<tool_response>`` block in a user turn (consecutive results in
  one turn), since a template that knows no ``tool`` role would drop or refuse it.

Bad shapes raise ``InvalidRequest`` naming the message (``messages[3].tool_calls``).
"""

from __future__ import annotations

import json
from typing import Any

from services.router.errors import InvalidRequest
from services.router.tools.spec import Tool

INSTRUCTIONS = (
    "You may call these functions (JSON signatures):\n<tools>\n{tools}\n</tools>\n"
    "To call one, write <tool_call>\n{{\"name\": <function name>, \"arguments\": <object>}}\n</tool_call>")


def render_messages(messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    previous_role = None
    for i, message in enumerate(messages):
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if previous_role == "tool":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            previous_role = role
            continue
        previous_role = role
        if role == "assistant" and message.get("tool_calls"):
            blocks = [_call_block(call, f"messages[{i}].tool_calls[{j}]")
                      for j, call in enumerate(_list(message["tool_calls"], f"messages[{i}].tool_calls"))]
            content = "\n".join(([content] if content else []) + blocks)
        out.append({"role": role, "content": content})
    if tools:
        listing = INSTRUCTIONS.format(tools="\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def _list(value: Any, field: str) -> list[Any]:
    if not isinstance(value, list):
        raise InvalidRequest(f"{field} must be a list of tool calls", field)
    return value


def _call_block(call: Any, field: str) -> str:
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise InvalidRequest(f"{field} must be {{'type': 'function', 'function': {{'name': str, "
                             "'arguments': JSON text}}}}", field)
    try:
        parsed = json.loads(arguments)
    except ValueError as error:
        raise InvalidRequest(f"{field}.function.arguments is not JSON: {error}",
                             f"{field}.function.arguments") from None
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": parsed}, ensure_ascii=False) + "\n</tool_call>"

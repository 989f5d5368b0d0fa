"""One choice's reply under a tool choice, as OpenAI's chat message or stream deltas.

    reply = ToolReply(choice, tools)          # per choice (n > 1: one each)
    message, finish = reply.message(text, finish_reason)        # a whole response
    delta = reply.delta(text)                 # a stream: delta fields ({"content"}, {"tool_calls"}) or None
    delta = reply.finish()                    # the stream's last fields before its finish_reason
    finish = reply.finish_reason(finish_reason)

    auto      the text is parsed for Hermes calls (hermes.py), content and calls as they come
    required  the text is the JSON array of calls (spec.py's constraint): the calls at the end
    function  the text is the arguments object: streamed as the call's arguments as it decodes

A reply that made calls finishes with ``tool_calls`` unless it ran out of tokens (``length``).
"""

from __future__ import annotations

from typing import Any

from services.router.tools.calls import NamedCallStream, ToolCall, calls_from_required
from services.router.tools.hermes import Call, Content, Event, HermesStream, parse_calls
from services.router.tools.spec import Tool, ToolChoice


class ToolReply:
    def __init__(self, choice: ToolChoice, tools: list[Tool]) -> None:
        self.choice = choice
        self.names = frozenset(t.name for t in tools)
        self.made_calls = False
        self._hermes = HermesStream(self.names)
        self._named = NamedCallStream(choice.name) if choice.name else None
        self._text = ""  # required: the whole array, parsed at the end

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        content: str | None = text
        calls: list[ToolCall] = []
        if self.choice.mode == "auto":
            content, calls = parse_calls(text, self.names)
        elif self.choice.mode == "required":
            calls = calls_from_required(text, self.names)
        elif self._named is not None:
            calls = [ToolCall(self._named.call.name, text, self._named.call.id)]
        if calls:
            content = None if self.choice.mode != "auto" else content
            self.made_calls = True
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        return message, self.finish_reason(finish_reason)

    def delta(self, text: str) -> dict[str, Any] | None:
        if self.choice.mode == "auto":
            return self._fields(self._hermes.feed(text))
        if self._named is not None:
            entry = self._named.feed(text)
            if entry is None:
                return None
            self.made_calls = True
            return {"tool_calls": [entry]}
        self._text += text
        return None

    def finish(self) -> dict[str, Any] | None:
        if self.choice.mode == "auto":
            return self._fields(self._hermes.finish())
        if self.choice.mode == "required":
            calls = calls_from_required(self._text, self.names)
            if calls:
                self.made_calls = True
                return {"tool_calls": [c.openai(index=i) for i, c in enumerate(calls)]}
            return {"content": self._text} if self._text else None
        return None

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return "tool_calls" if self.made_calls and finish_reason == "stop" else finish_reason

    def _fields(self, events: list[Event]) -> dict[str, Any] | None:
        content = "".join(e.text for e in events if isinstance(e, Content))
        calls = [e.call.openai(index=e.index) for e in events if isinstance(e, Call)]
        fields: dict[str, Any] = {}
        if content:
            fields["content"] = content
        if calls:
            fields["tool_calls"] = calls
            self.made_calls = True
        return fields or None

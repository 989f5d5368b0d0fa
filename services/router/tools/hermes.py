"""The Hermes tool-call format, which SmolLM2, Qwen2 and most chat models' templates use: each
call is a JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and
``</tool_call>``; text outside the calls is the reply's content.

    content, calls = parse_calls(text, names)     # a whole reply
    stream = HermesStream(names)                  # a streamed one
    for piece in model_deltas: events = stream.feed(piece)     # [Content(text) | Call(call, index)]
    events = stream.finish()

A call whose JSON does not parse, or that names no offered tool, stays in the content as the
model wrote it (nothing is dropped). Content is held back only while it could be the start of
a ``<tool_call>`` tag, and inside a call until its closing tag.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from services.router.tools.calls import ToolCall, call_from_object

START, END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class Call:
    call: ToolCall
    index: int


Event = Content | Call


def _held_prefix(text: str) -> int:
    """How many trailing characters of ``text`` could begin START."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0


class HermesStream:
    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self._buffer = ""
        self._in_call = False
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            if self._in_call:
                end = self._buffer.find(END)
                if end < 0:
                    return events
                events.append(self._close(self._buffer[:end], END))
                self._buffer, self._in_call = self._buffer[end + len(END):], False
            else:
                start = self._buffer.find(START)
                if start < 0:
                    keep = _held_prefix(self._buffer)
                    self._emit(events, self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return events
                self._emit(events, self._buffer[:start])
                self._buffer, self._in_call = self._buffer[start + len(START):], True

    def finish(self) -> list[Event]:
        """The rest: an unclosed call (a reply cut at max_tokens) is parsed as far as it went."""
        events: list[Event] = []
        if self._in_call:
            events.append(self._close(self._buffer, ""))
        else:
            self._emit(events, self._buffer)
        self._buffer, self._in_call = "", False
        return events

    def _close(self, body: str, end: str) -> Event:
        try:
            call = call_from_object(json.loads(body), self.names)
        except ValueError:
            call = None
        if call is None:
            return Content(START + body + end)
        self.num_calls += 1
        return Call(call, self.num_calls - 1)

    def _emit(self, events: list[Event], text: str) -> None:
        # after a call, the whitespace between calls is not content
        if text and not (self.num_calls and text.isspace()):
            events.append(Content(text))


def parse_calls(text: str, names: frozenset[str]) -> tuple[str | None, list[ToolCall]]:
    """A whole reply -> (its content, None when empty or only whitespace; its calls)."""
    stream = HermesStream(names)
    events = stream.feed(text) + stream.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls = [e.call for e in events if isinstance(e, Call)]
    if calls:
        content = content.strip()
    return content or None, calls

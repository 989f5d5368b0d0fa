"""A model's Jinja chat template, rendered exactly as HF's ``apply_chat_template(..., tokenize=False)``.

Templates come with downloaded models, so they are untrusted code: they run in Jinja's immutable
sandbox. Torch-free (the router renders chats).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplate:
    """Compiled once; ``render`` checks the messages and turns template errors into ValueError."""

    def __init__(self, source: str) -> None:
        # The same environment settings as HF, so the rendered text matches it byte for byte.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise ValueError(f"the model's chat template is not valid Jinja: {error}") from error

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool,
               special_tokens: Mapping[str, str | None]) -> str:
        """``special_tokens``: the variables HF passes too (bos_token, eos_token, ...); None -> ""."""
        check_messages(messages)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **{name: token or "" for name, token in special_tokens.items()})
        except jinja2.TemplateError as error:
            raise ValueError(f"the chat template rejected the messages: {error}") from error


def check_messages(messages: Any) -> None:
    """ValueError naming the first problem unless ``messages`` is a non-empty list of dicts with
    string 'role' and 'content' (other keys pass through to the template)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.80}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"messages[{i}] has no {key!r}")
            if not isinstance(message[key], str):
                raise ValueError(f"messages[{i}][{key!r}] must be a str, got {type(message[key]).__name__}")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF's filter: unlike Jinja's own tojson, it does not escape HTML characters
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker) renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)

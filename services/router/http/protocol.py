"""OpenAI's request bodies -> SamplingParams and prompts, and OpenAI's error shape.

Pure functions, no I/O. Parsing checks types and names the offending field; value ranges are
SamplingParams.validate's job (called by the Frontend once the prompt length is known).
Fields follow the OpenAI API plus vLLM's extensions (top_k, min_p, repetition_penalty,
min_tokens, stop_token_ids, include_stop_str_in_output, ignore_eos, skip_special_tokens,
allowed_token_ids, bad_words, return_token_ids, cache_salt) and ``timeout`` (seconds the whole
request may take; past it HTTP 504). Structured outputs (``response_format``, vLLM's
``guided_*`` and ``structured_outputs``) are read by http/structured.py, on both endpoints.
Unknown fields are ignored, as vLLM does, except the ones that would let a caller run or
change code on the router (``chat_template``, ``chat_template_kwargs``): those are refused.
Strings must be valid Unicode: a lone surrogate (JSON's "\ud800") is refused naming its
field, since no tokenizer can encode it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from services.router.errors import InvalidRequest
from services.router.http.structured import structured_outputs_of
from services.router.tools.render import render_messages
from services.router.tools.spec import Tool, ToolChoice, parse_tool_choice, parse_tools, tool_constraint

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat has none

_NUMBER_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty")
_INT_FIELDS = ("n", "top_k", "seed", "min_tokens")
_BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")
# Fields vLLM accepts that run or change code on the server; pdserve refuses them.
_REFUSED_CHAT_FIELDS = ("chat_template", "chat_template_kwargs")
_INT_KEY = re.compile(r"-?[0-9]+")
_MAX_WALK_DEPTH = 64  # JSON nesting the surrogate check follows (deeper is refused)


@dataclass(frozen=True)
class OpenAIRequest:
    """A parsed /v1/completions or /v1/chat/completions body. Exactly one of ``prompt`` and
    ``messages`` is set. ``params.logprobs`` is the number of top logprobs (None: off)."""

    model: str | None
    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    add_generation_prompt: bool = True
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    timeout_s: float | None = None  # the whole request's budget (None: no deadline)
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice("none")  # services/router/tools

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object. InvalidRequest for bytes that are not UTF-8 JSON, nesting
    too deep to parse, or a string holding a lone surrogate (naming its field)."""
    try:
        body = json.loads(raw)
    except UnicodeDecodeError as error:
        raise InvalidRequest(f"the request body is not valid UTF-8: {error.reason} at byte "
                             f"{error.start}") from None
    except json.JSONDecodeError as error:
        raise InvalidRequest(f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise InvalidRequest("the request body is nested too deeply to parse") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    bad = _lone_surrogate_path(body, "", 0)
    if bad is not None:
        raise InvalidRequest(f"{bad[:80] or 'a key'} holds a lone UTF-16 surrogate (such as \\ud800), "
                             "which is not a Unicode character; send valid text",
                             bad.split(".")[0].split("[")[0] or None)
    return body


def parse_completion_request(body: dict[str, Any]) -> OpenAIRequest:
    prompt = _prompt(body.get("prompt"))
    if _get(body, "echo", bool, False):
        raise InvalidRequest("echo is not supported", "echo")
    if _get(body, "suffix", str, None):
        raise InvalidRequest("suffix is not supported", "suffix")
    logprobs = _get(body, "logprobs", int, None)
    max_tokens = _get(body, "max_tokens", int, COMPLETIONS_DEFAULT_MAX_TOKENS)
    params = _sampling_params(body, max_tokens, logprobs)
    best_of = _get(body, "best_of", int, None)
    if best_of is not None and best_of != params.n:
        raise InvalidRequest("best_of other than n is not supported", "best_of")
    return OpenAIRequest(prompt=prompt, params=params, **_common(body))


def parse_chat_request(body: dict[str, Any]) -> OpenAIRequest:
    messages = _messages(body.get("messages"))
    for name in _REFUSED_CHAT_FIELDS:
        if body.get(name) is not None:
            raise InvalidRequest(f"{name} is not accepted: the server renders chats with the "
                                 "model's own template only", name)
    if body.get("functions"):
        raise InvalidRequest("functions (deprecated) are not supported: use tools", "functions")
    tools = parse_tools(body.get("tools"))
    tool_choice = parse_tool_choice(body.get("tool_choice"), tools)
    if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        messages = render_messages(messages, tools if tool_choice.mode != "none" else [])
    top_logprobs = _get(body, "top_logprobs", int, None)
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top_logprobs}",
                             "top_logprobs")
    if _get(body, "logprobs", bool, False):
        logprobs = 0 if top_logprobs is None else top_logprobs
    elif top_logprobs is not None:
        raise InvalidRequest("top_logprobs needs logprobs set to true", "top_logprobs")
    else:
        logprobs = None
    max_tokens = _get(body, "max_completion_tokens", int, None)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int, None)
    params = _sampling_params(body, max_tokens, logprobs)
    constraint = tool_constraint(tool_choice, tools, _get(body, "parallel_tool_calls", bool, True))
    if constraint is not None:
        if params.structured_outputs is not None:
            raise InvalidRequest(f"tool_choice {tool_choice.mode!r} decodes the tool call under its own "
                                 "schema: it cannot be combined with response_format or structured_outputs",
                                 "tool_choice")
        params = dataclasses.replace(params, structured_outputs=constraint)
    return OpenAIRequest(messages=messages, params=params,
                         add_generation_prompt=_get(body, "add_generation_prompt", bool, True),
                         tools=tuple(tools), tool_choice=tool_choice, **_common(body))


def error_body(message: str, param: str | None = None, code: str | None = None,
               error_type: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _common(body: dict[str, Any]) -> dict[str, Any]:
    stream = _get(body, "stream", bool, False)
    stream_options = _get(body, "stream_options", dict, None)
    if stream_options is not None and not stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
    include_usage = _get(stream_options or {}, "include_usage", bool, False, "stream_options.include_usage")
    timeout_s = _get(body, "timeout", float, None)
    if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
        raise InvalidRequest(f"timeout must be a positive number of seconds, got {timeout_s!r}",
                             "timeout")
    return {"model": _get(body, "model", str, None), "stream": stream,
            "include_usage": include_usage,
            "return_token_ids": _get(body, "return_token_ids", bool, False),
            "timeout_s": timeout_s}


def _sampling_params(body: dict[str, Any], max_tokens: int | None,
                     logprobs: int | None) -> SamplingParams:
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, "logprobs": logprobs}
    for name in _NUMBER_FIELDS:
        kwargs[name] = _get(body, name, float, None)
    for name in _INT_FIELDS:
        kwargs[name] = _get(body, name, int, None)
    for name in _BOOL_FIELDS:
        kwargs[name] = _get(body, name, bool, None)
    stop = body.get("stop")
    kwargs["stop"] = [stop] if isinstance(stop, str) else _list_of(body, "stop", str)
    kwargs["stop_token_ids"] = _list_of(body, "stop_token_ids", int)
    kwargs["allowed_token_ids"] = _list_of(body, "allowed_token_ids", int)
    kwargs["bad_words"] = _list_of(body, "bad_words", str)
    kwargs["cache_salt"] = _get(body, "cache_salt", str, None)
    kwargs["structured_outputs"] = structured_outputs_of(body)
    logit_bias = _get(body, "logit_bias", dict, None)
    if logit_bias:
        for key, value in logit_bias.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidRequest(f"logit_bias[{key!r}] must be a number, got {value!r}", "logit_bias")
            if not _is_int_string(key):
                raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        kwargs["logit_bias"] = {int(key): float(value) for key, value in logit_bias.items()}
    return SamplingParams(**{k: v for k, v in kwargs.items()
                             if v is not None or k in ("max_tokens", "logprobs")})


_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               dict: "an object"}


def _get(body: dict[str, Any], name: str, kind: type, default: Any, param: str | None = None) -> Any:
    """``body[name]`` checked to be of ``kind`` (float accepts integers; null means absent)."""
    value = body.get(name)
    if value is None:
        return default
    is_bool = isinstance(value, bool)
    ok = (is_bool if kind is bool
          else isinstance(value, (int, float)) and not is_bool if kind is float
          else isinstance(value, int) and not is_bool if kind is int
          else isinstance(value, kind))
    if not ok:
        param = param or name
        raise InvalidRequest(f"{param} must be {_TYPE_NAMES[kind]}, got {value!r:.60}", param)
    return float(value) if kind is float else value


def _list_of(body: dict[str, Any], name: str, kind: type) -> list[Any] | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(
            isinstance(v, kind) and not (kind is int and isinstance(v, bool)) for v in value):
        raise InvalidRequest(f"{name} must be a list of {_TYPE_NAMES[kind].split(' ', 1)[1]}s, "
                             f"got {value!r:.60}", name)
    return value


def _prompt(prompt: Any) -> str | list[int]:
    """A string, a list of token ids, or a list holding exactly one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if prompt is None:
        raise InvalidRequest("prompt is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt is empty; give some text or token ids", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, (str, list)) for t in prompt):
        raise InvalidRequest(f"only one prompt per request is supported, got {len(prompt)}", "prompt")
    if not isinstance(prompt, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
        raise InvalidRequest(f"prompt must be a string or a list of token ids, got {prompt!r:.60}", "prompt")
    if not prompt:
        raise InvalidRequest("prompt is empty; give some text or token ids", "prompt")
    return prompt


def _messages(messages: Any) -> list[dict[str, str]]:
    """Messages with their content flattened to a string (text parts joined by newlines)."""
    if messages is None:
        raise InvalidRequest("messages is required", "messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects", "messages")
    flat = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a string role", "messages")
        flat.append({**message, "content": _content(message.get("content"), i)})
    return flat


def _content(content: Any, i: int) -> str:
    if content is None:  # an assistant turn that only called tools
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"messages[{i}].content: only text parts "
                                     f"({{'type': 'text', 'text': ...}}) are supported, got {part!r:.60}",
                                     "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts, "
                         f"got {type(content).__name__}", "messages")


def _is_int_string(key: str) -> bool:
    return _INT_KEY.fullmatch(key) is not None  # ASCII digits only: int() would take '٣' too


def _lone_surrogate_path(value: Any, path: str, depth: int) -> str | None:
    """The path (``messages[0].content``) of the first string, or key, holding a lone
    surrogate; None if there is none. Nesting beyond _MAX_WALK_DEPTH is refused."""
    if isinstance(value, str):
        return path if _has_surrogate(value) else None
    if depth > _MAX_WALK_DEPTH and isinstance(value, (dict, list)):
        raise InvalidRequest(f"the request body nests deeper than {_MAX_WALK_DEPTH} levels "
                             f"(at {path or 'the top'})")
    if isinstance(value, dict):
        for key, item in value.items():
            child = f"{path}.{key}" if path else str(key)
            if _has_surrogate(key):
                return path
            found = _lone_surrogate_path(item, child, depth + 1)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, (str, dict, list)):  # token-id lists: skip the numbers quickly
                found = _lone_surrogate_path(item, f"{path}[{i}]", depth + 1)
                if found is not None:
                    return found
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False

"""OpenAI's response bodies: whole responses, SSE chunks, usage and logprobs (pure, no I/O).

vLLM's extensions ride along: ``stop_reason`` in every choice, and ``token_ids`` /
``prompt_token_ids`` when the request set ``return_token_ids``. Logprobs of impossible tokens
(-inf) are sent as -9999.0, since JSON has no infinities.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from services.router.http.protocol import OpenAIRequest
from services.router.pipeline.frontend import Frontend
from services.router.pipeline.generation import Generation, SampleDelta, Usage
from services.router.tools.reply import ToolReply

if TYPE_CHECKING:  # engine.sampling.logprobs imports torch; the router must not
    from engine.sampling.logprobs import PositionLogprobs

NEG_INF_LOGPROB = -9999.0
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
dumps = _ENCODER.encode  # one encoder: json.dumps with options builds a new one per call
_encode_str = json.encoder.encode_basestring  # a str as dumps writes it (ensure_ascii=False)
_TEXT_SLOT = "\x00text\x00"  # stands for a chunk's text while its template is built


class ResponseRenderer:
    """Builds one request's response bodies (streamed chunks or the whole response)."""

    def __init__(self, api: OpenAIRequest, frontend: Frontend, generation: Generation) -> None:
        self.api = api
        self.generation = generation
        self.model = frontend.model.name
        self.created = int(time.time())
        prefix = "chatcmpl-" if api.is_chat else "cmpl-"
        self.id = prefix + generation.request_id
        self.object = "chat.completion" if api.is_chat else "text_completion"
        decode = frontend.tokenizer.decode
        self.token_text = functools.lru_cache(maxsize=4096)(
            lambda token_id: decode([token_id], skip_special_tokens=False))
        n = generation.params.n
        self.texts = [""] * n
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[PositionLogprobs]] = [[] for _ in range(n)]
        self.finish: list[tuple[str | None, str | int | None]] = [(None, None)] * n
        self.text_offsets = [0] * n  # completions logprobs: where the next token's text starts
        self.has_sent_prompt_ids = False
        # a chat with a tool choice: each choice's text becomes content and tool_calls
        self.tool_replies = ([ToolReply(api.tool_choice, list(api.tools)) for _ in range(n)]
                             if api.tool_choice.mode != "none" else None)
        # Most chunks carry text alone: their JSON is a per-sample template around the text
        # (``chunk_json``), not a dict through the encoder per token.
        self._text_only = (self.tool_replies is None and not api.return_token_ids
                           and generation.params.logprobs is None)
        self._templates: dict[int, tuple[str, str]] = {}

    def add(self, delta: SampleDelta) -> None:
        i = delta.index
        self.texts[i] += delta.text
        self.token_ids[i] += delta.token_ids
        self.logprobs[i] += delta.logprobs or []
        if delta.finish_reason is not None:
            self.finish[i] = (delta.finish_reason, delta.stop_reason)

    def response(self) -> dict[str, Any]:
        choices = []
        for i, text in enumerate(self.texts):
            finish_reason, stop_reason = self.finish[i]
            choice: dict[str, Any] = {"index": i}
            if self.tool_replies is not None:
                choice["message"], finish_reason = self.tool_replies[i].message(text, finish_reason)
            elif self.api.is_chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice["logprobs"] = self._logprobs(i, self.logprobs[i])
            choice |= {"finish_reason": finish_reason, "stop_reason": stop_reason}
            if self.api.return_token_ids:
                choice |= {"prompt_token_ids": self.generation.prompt_token_ids,
                           "token_ids": self.token_ids[i]}
            choices.append(choice)
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_json(self.generation.usage)}

    def opening_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open each choice with the assistant role, as OpenAI's do."""
        if not self.api.is_chat:
            return []
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None})
                for i in range(self.generation.params.n)]

    def chunk(self, delta: SampleDelta) -> dict[str, Any] | None:
        """The chunk for ``delta``, or None when it carries nothing the client asked for."""
        wants_tokens = delta.logprobs or self.api.return_token_ids
        if not delta.text and delta.finish_reason is None and not wants_tokens:
            return None
        choice: dict[str, Any] = {"index": delta.index}
        finish_reason = delta.finish_reason
        if self.tool_replies is not None:
            reply = self.tool_replies[delta.index]
            fields = reply.delta(delta.text)
            if finish_reason is not None:
                fields = _merged(fields, reply.finish())
                finish_reason = reply.finish_reason(finish_reason)
            if fields is None and finish_reason is None and not wants_tokens:
                return None
            choice["delta"] = fields or {}
        elif self.api.is_chat:
            choice["delta"] = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
        else:
            choice["text"] = delta.text
        choice["logprobs"] = self._logprobs(delta.index, delta.logprobs or [])
        choice |= {"finish_reason": finish_reason, "stop_reason": delta.stop_reason}
        if self.api.return_token_ids:
            choice["token_ids"] = delta.token_ids
            if not self.has_sent_prompt_ids:
                choice["prompt_token_ids"] = self.generation.prompt_token_ids
                self.has_sent_prompt_ids = True
        return self._chunk(choice)

    def chunk_json(self, delta: SampleDelta) -> str | None:
        """``dumps(self.chunk(delta))``, the same text; a chunk with text alone (no finish, no
        logprobs, token ids or tool calls) is its sample's template around the text."""
        if self._text_only and delta.finish_reason is None and delta.stop_reason is None:
            if not delta.text:
                return None
            template = self._templates.get(delta.index)
            if template is None:
                template = self._templates[delta.index] = self._text_template(delta.index)
            return template[0] + _encode_str(delta.text) + template[1]
        chunk = self.chunk(delta)
        return None if chunk is None else dumps(chunk)

    def _text_template(self, index: int) -> tuple[str, str]:
        text = dumps(self.chunk(SampleDelta(index, _TEXT_SLOT, [])))
        head, slot, tail = text.partition(_encode_str(_TEXT_SLOT))
        assert slot and _TEXT_SLOT not in tail, text  # exactly one place for the text
        return head, tail

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._chunk(None), "usage": usage_json(self.generation.usage)}

    def _chunk(self, choice: dict[str, Any] | None) -> dict[str, Any]:
        chunk = {"id": self.id, "object": self.object + ".chunk" if self.api.is_chat else self.object,
                 "created": self.created, "model": self.model,
                 "choices": [] if choice is None else [choice]}
        if self.api.include_usage:
            chunk["usage"] = None
        return chunk

    def _logprobs(self, index: int, entries: list[PositionLogprobs]) -> dict[str, Any] | None:
        if self.generation.params.logprobs is None:
            return None
        if self.api.is_chat:
            return chat_logprobs_json(entries, self.token_text)
        body = completion_logprobs_json(entries, self.token_text, self.text_offsets[index])
        self.text_offsets[index] += sum(len(token) for token in body["tokens"])
        return body


def _merged(first: dict[str, Any] | None, last: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two sets of delta fields in one: contents joined, tool_calls in order."""
    if not first or not last:
        return first or last
    merged = dict(first)
    if "content" in last:
        merged["content"] = merged.get("content", "") + last["content"]
    if "tool_calls" in last:
        merged["tool_calls"] = merged.get("tool_calls", []) + last["tool_calls"]
    return merged


def usage_json(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def json_logprob(value: float) -> float:
    """-inf (an impossible token) and NaN have no JSON spelling."""
    return value if math.isfinite(value) else NEG_INF_LOGPROB


def completion_logprobs_json(entries: list[PositionLogprobs], token_text: Callable[[int], str],
                             text_offset: int) -> dict[str, Any]:
    """The legacy completions shape; each top dict includes the sampled token, as vLLM's does.
    ``text_offset`` is where the first token's text starts in the completion."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        token = token_text(entry.token_id)
        tokens.append(token)
        token_logprobs.append(json_logprob(entry.logprob))
        top = {token_text(token_id): json_logprob(lp) for token_id, lp in entry.top}
        top.setdefault(token, json_logprob(entry.logprob))
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def chat_logprobs_json(entries: list[PositionLogprobs],
                       token_text: Callable[[int], str]) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        token = token_text(token_id)
        return {"token": token, "logprob": json_logprob(logprob),
                "bytes": list(token.encode("utf-8"))}

    return {"content": [{**item(entry.token_id, entry.logprob),
                         "top_logprobs": [item(t, lp) for t, lp in entry.top]}
                        for entry in entries]}

"""The request pipeline both APIs (OpenAI HTTP, gRPC) share.

    frontend = Frontend(tokenizer, backend, model_info)
    frontend.check_model(name)                              # ModelNotFound for another model
    prompt_ids = frontend.tokenize(prompt="Hello")          # or token ids, or chat messages
    params = frontend.check(prompt_ids, params)             # InvalidRequest naming the problem
    await frontend.check_constraint(params)                 # the same, for a schema's keywords
    async with frontend.generate(prompt_ids, params) as generation:   # backend errors raise here
        async for delta in generation:                      # SampleDelta per sample and event
            ...
    generation.usage                                        # final once iteration ended

Tokenization and validation (including the router's RequestLimits) happen once, here; the
backend sees token ids only. ``generate`` admits the request into the router's bounded queue
(pipeline/admission.py: QueueFull at once when full) and carries its deadline (monotonic s):
past it, the Generation (pipeline/generation.py) raises RequestTimeout and closes the
backend's iterator, and every worker call made meanwhile carried the time left as its gRPC
deadline. Each of the ``n`` samples has its own IncrementalDetokenizer, which holds back text
that could start a stop string and cuts the text at a match. When every sample has finished
(by the backend's finish_reason or a stop string) the backend's iterator is closed at once,
which aborts the request wherever it still holds blocks; leaving the ``async with`` early
does the same.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

from engine.models.tokenizer import Tokenizer
from engine.sampling_params import SamplingParams
from engine.structured.errors import StructuredOutputError
from engine.structured.schema_check import check_schema
from services.router.backends.backend import Backend
from services.router.errors import InvalidRequest, ModelNotFound
from services.router.metrics import RouterMetrics
from services.router.model_info import ModelInfo
from services.router.pipeline.admission import Admission
from services.router.pipeline.generation import Generation
from services.router.pipeline.limits import RequestLimits, check_limits, context_length_error

# The roles OpenAI's chat API accepts; any other is refused, naming the message.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class Frontend:
    """``metrics``: the router's (every request is timed in its Generation); a private one by
    default. ``limits`` and ``admission`` default to the defaults an operator gets."""

    def __init__(self, tokenizer: Tokenizer, backend: Backend, model: ModelInfo,
                 metrics: RouterMetrics | None = None, limits: RequestLimits | None = None,
                 admission: Admission | None = None) -> None:
        self.tokenizer = tokenizer
        self.backend = backend
        self.model = model
        self.metrics = metrics or RouterMetrics.create(model.name)
        self.limits = limits or RequestLimits()
        self.admission = admission or Admission()

    def check_model(self, name: str | None) -> None:
        """ModelNotFound unless ``name`` is None (not given: the served model) or the served
        model's name."""
        if name is not None and name != self.model.name:
            raise ModelNotFound(name, self.model.name)

    def tokenize(self, prompt: str | list[int] | None = None, messages: list[dict[str, str]] | None = None,
                 add_generation_prompt: bool = True) -> list[int]:
        """Token ids of exactly one of: text, token ids (checked against the vocabulary), or
        chat messages rendered with the model's template."""
        if messages is not None:
            _check_roles(messages)
            try:
                return self.tokenizer.encode_chat(messages, add_generation_prompt)
            except ValueError as error:
                raise InvalidRequest(str(error), "messages") from error
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt is empty; give some text or token ids", "prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if prompt is None:
            raise InvalidRequest("a prompt is required (text, token ids, or chat messages)", "prompt")
        vocab_size = self.model.vocab_size
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab_size}) (the "
                                 f"vocabulary size), got {bad[:8]}", "prompt")
        return list(prompt)

    def check(self, prompt_ids: list[int], params: SamplingParams,
              prompt_param: str = "prompt") -> SamplingParams:
        """Validate the request against the router's limits and the model's; returns the params
        to send (bad words tokenized). Raises InvalidRequest naming the parameter; a request
        that cannot fit the context gets OpenAI's ``context_length_exceeded`` wording, its
        param ``prompt_param`` ("messages" for a chat)."""
        max_model_len = self.model.max_model_len
        if not prompt_ids:
            raise InvalidRequest("prompt is empty; give at least one token", prompt_param)
        check_limits(params, self.limits)
        max_tokens = params.max_tokens
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            max_tokens = None  # validate() names a bad max_tokens
        if (len(prompt_ids) >= max_model_len
                or max_tokens is not None and len(prompt_ids) + max_tokens > max_model_len):
            raise context_length_error(max_model_len, len(prompt_ids), max_tokens, prompt_param)
        try:
            params.validate(self.model.vocab_size, max_model_len, len(prompt_ids))
            return params.with_bad_words_tokenized(self.tokenizer.encode)
        except StructuredOutputError as error:
            raise InvalidRequest(str(error), error.field) from error
        except ValueError as error:
            message = str(error)
            raise InvalidRequest(message, _param_of(message)) from error

    async def check_constraint(self, params: SamplingParams) -> None:
        """InvalidRequest naming the field when the structured-output constraint (checked in
        shape by ``check``) uses a schema keyword the engine would not enforce. On a thread: a
        schema may be large. Whether it compiles is the engine's verdict, on the worker
        (``RefusedByBackend`` from the Generation)."""
        constraint = params.structured_outputs
        if constraint is not None:
            try:
                await asyncio.to_thread(check_schema, constraint)
            except StructuredOutputError as error:
                raise InvalidRequest(str(error), error.field) from error

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 request_id: str | None = None, is_stream: bool = True,
                 arrived_at: float | None = None, deadline: float | None = None) -> Generation:
        """A not-yet-started request; ``async with`` starts it (see the module docstring).
        Raises QueueFull (an Overloaded) at once when the router's queue is full; the returned
        Generation holds a queue place until it is started and closed (``async with`` does
        both; ``start`` closes it itself when it fails). ``deadline``
        (monotonic s; None: none) bounds the whole request. Metrics only: ``is_stream`` labels
        it (``request_type``); ``arrived_at`` (monotonic s, when the edge received it) times
        the ``router_queue`` TTFT stage up to now."""
        ticket = self.admission.admit()
        request_id = request_id or uuid.uuid4().hex
        generation = Generation(self.backend.generate(request_id, prompt_ids, params), self.tokenizer,
                                self.metrics, request_id, prompt_ids, params, is_stream, ticket, deadline)
        if arrived_at is not None:
            queue_s = generation.sent_at - arrived_at
            self.metrics.stages.observe("router_queue", queue_s)
            generation.ttft_stages["router_queue"] = queue_s
        return generation


def _check_roles(messages: list[dict[str, str]]) -> None:
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; "
                                 f"got {role!r:.40}", "messages")


def _param_of(message: str) -> str | None:
    """SamplingParams.validate starts its messages with the parameter: 'top_p must be ...'."""
    word = message.split(" ", 1)[0].split("[", 1)[0]
    return word if word.isidentifier() else None


@dataclass
class RouterState:
    """What the HTTP and gRPC servers share: ``frontend`` is None until the backend is ready;
    ``is_draining`` turns true when a stop signal arrives (health then reports unhealthy).
    ``limits`` and ``admission`` are the router's (the frontend is built with the same)."""

    backend: Backend
    frontend: Frontend | None = None
    limits: RequestLimits = field(default_factory=RequestLimits)
    admission: Admission = field(default_factory=Admission)
    is_draining: bool = False
    metrics: RouterMetrics = field(default_factory=RouterMetrics.create)
    debug_route: bool = False  # tell clients how each request was routed (ROUTE_HEADER)

    async def is_healthy(self) -> bool:
        return self.frontend is not None and not self.is_draining and await self.backend.is_healthy()

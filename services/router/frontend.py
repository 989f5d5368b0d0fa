"""The request pipeline both frontends (OpenAI HTTP, gRPC) share.

    frontend = Frontend(tokenizer, backend, model_info)
    prompt_ids = frontend.tokenize(prompt="Hello")          # or token ids, or chat messages
    params = frontend.check(prompt_ids, params)             # InvalidRequest naming the problem
    async with frontend.generate(prompt_ids, params) as generation:   # backend errors raise here
        async for delta in generation:                      # SampleDelta per sample and event
            ...
    generation.usage                                        # final once iteration ended

Tokenization and validation (including the router's RequestLimits) happen once, here; the
backend sees token ids only. ``generate`` admits the request into the router's bounded queue
(services/router/admission.py: QueueFull at once when full) and carries its deadline
(monotonic s): past it, the Generation raises RequestTimeout and closes the backend's
iterator, and every worker call made meanwhile carried the time left as its gRPC deadline. Each of the
``n`` samples has its own IncrementalDetokenizer, which holds back text that could start a
stop string and cuts the text at a match. When every sample has finished (by the backend's
finish_reason or a stop string) the backend's iterator is closed at once, which aborts the
request wherever it still holds blocks; leaving the ``async with`` early does the same.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from engine.models.tokenizer import Tokenizer
from engine.sampling.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from services.router.admission import Admission, Ticket
from services.router.backend import Backend, BackendError, Overloaded, TokenEvent
from services.router.deadline import set_request_deadline
from services.router.errors import InvalidRequest, RequestTimeout
from services.router.limits import RequestLimits, check_limits, context_length_error
from services.router.metrics import RouterMetrics
from services.router.model_info import ModelInfo
from services.router.ttft_breakdown import TTFT_HEADER, format_breakdown

T = TypeVar("T")

@dataclass(slots=True)
class SampleDelta:
    """What one sample gained from one backend event. ``text`` may be empty (held back for a
    possible stop string, or a character still incomplete) while ``token_ids`` is not."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list | None = None  # [PositionLogprobs], one per token_ids entry
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: str | int | None = None  # the stop string, or the stop token id (None for EOS)
    prompt_logprobs: list | None = None  # on the first delta of the request, if requested


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0  # over all samples, up to and including what stopped each
    cached_tokens: int = 0  # prompt tokens served from a prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class _Sample:
    detokenizer: IncrementalDetokenizer
    is_done: bool = False


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

    def tokenize(self, prompt: str | list[int] | None = None, messages: list[dict] | None = None,
                 add_generation_prompt: bool = True) -> list[int]:
        """Token ids of exactly one of: text, token ids (checked against the vocabulary), or
        chat messages rendered with the model's template."""
        if messages is not None:
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
        except ValueError as error:
            message = str(error)
            raise InvalidRequest(message, _param_of(message)) from error

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
        generation = Generation(self, request_id or uuid.uuid4().hex, prompt_ids, params, is_stream,
                                ticket, deadline)
        if arrived_at is not None:
            queue_s = generation.sent_at - arrived_at
            self.metrics.stages.observe("router_queue", queue_s)
            generation.ttft_stages["router_queue"] = queue_s
        return generation


class Generation:
    """One request in flight: an async iterator of SampleDelta and an async context manager.

    ``start()`` (or entering the context) sends the request and waits for its first event, so
    that bad input (ValueError), Overloaded and BackendError surface before a caller commits
    to a streamed response. Iteration raises BackendError if the backend fails or ends early.
    Past ``deadline`` start or iteration raises RequestTimeout (and closes the request).
    Its metrics: sent at construction, TTFT at the first event, ITL between events, and on
    ``aclose`` the status: success (every sample finished), error (the backend raised) or
    cancelled (closed early: client left, deadline).
    """

    def __init__(self, frontend: Frontend, request_id: str, prompt_ids: list[int],
                 params: SamplingParams, is_stream: bool = True, ticket: Ticket | None = None,
                 deadline: float | None = None) -> None:
        self.request_id = request_id
        self.deadline = deadline
        self._ticket = ticket
        self.prompt_token_ids = prompt_ids
        self.params = params
        self.usage = Usage(prompt_tokens=len(prompt_ids))
        self.prompt_logprobs: list | None = None
        self._events = frontend.backend.generate(request_id, prompt_ids, params)
        self._samples = [_Sample(IncrementalDetokenizer(frontend.tokenizer, prompt_ids, params))
                         for _ in range(params.n)]
        self._first_event: TokenEvent | None = None
        self._ready: deque[SampleDelta] = deque()
        self._is_closed = False
        self._has_sent_prompt_logprobs = False
        self._timer = frontend.metrics.request(len(prompt_ids), is_stream)
        self.sent_at = self._timer.sent_at
        self._has_failed = False
        self.route: str | None = None  # how the first sample was routed (TokenEvent.route)
        # seconds per TTFT stage (router_queue, then the first event's stages) and, once the
        # first event is back, "ttft" itself: the debug-mode breakdown
        self.ttft_stages: dict[str, float] = {}
        self._stages = frontend.metrics.stages

    @property
    def is_finished(self) -> bool:
        """Every sample finished and every delta was handed out: usage is final."""
        return not self._ready and all(sample.is_done for sample in self._samples)

    async def start(self) -> None:
        set_request_deadline(self.deadline)  # worker calls of this task (and its samples) see it
        try:
            if self._ticket is not None:
                await self._before_deadline(self._ticket.acquire_slot())
            self._first_event = await self._before_deadline(anext(self._events))
            self._timer.on_event()
            if self._ticket is not None:
                self._ticket.on_streaming()
            self.route = self._first_event.route
            for stage, seconds in (self._first_event.ttft_stages or {}).items():
                self._stages.observe(stage, seconds)
                self.ttft_stages[stage] = seconds
            self.ttft_stages["ttft"] = self._timer.ttft_s
        except StopAsyncIteration:
            self._has_failed = True
            await self.aclose()
            raise BackendError(f"request {self.request_id}: the backend returned no tokens") from None
        except BaseException as error:
            self._has_failed = isinstance(error, (ValueError, Overloaded, BackendError))
            await self.aclose()
            raise

    async def _before_deadline(self, awaitable: Awaitable[T]) -> T:
        """``await awaitable``, cut off at the deadline: then close the request (which aborts
        it in the backend) and raise RequestTimeout."""
        if self.deadline is None:
            return await awaitable
        loop = asyncio.get_running_loop()
        timeout = asyncio.timeout_at(loop.time() + (self.deadline - time.monotonic()))
        try:
            async with timeout:
                return await awaitable
        except TimeoutError:
            if not timeout.expired():
                raise  # not ours: the backend's own
            await self.aclose()
            raise RequestTimeout(f"request {self.request_id}: its deadline passed before it "
                                 f"finished ({self.usage.completion_tokens} tokens generated); "
                                 "it was aborted") from None

    async def aclose(self) -> None:
        """Close the backend's iterator (aborting the request if it still runs). Idempotent."""
        if not self._is_closed:
            self._is_closed = True
            done = all(sample.is_done for sample in self._samples)
            status = "success" if done else "error" if self._has_failed else "cancelled"
            self._timer.on_finished(status, self.usage.completion_tokens, self.usage.cached_tokens)
            try:
                await self._events.aclose()
            finally:
                if self._ticket is not None:
                    self._ticket.release()

    async def __aenter__(self) -> Generation:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> SampleDelta:
        while not self._ready:
            if all(sample.is_done for sample in self._samples):
                await self.aclose()  # a stop string may have ended it before the backend did
                raise StopAsyncIteration
            self._apply(await self._next_event())
        return self._ready.popleft()

    async def _next_event(self) -> TokenEvent:
        if self._first_event is not None:
            event, self._first_event = self._first_event, None
            return event
        if self._is_closed:
            raise BackendError(f"request {self.request_id}: read after the request was closed")
        try:
            event = await self._before_deadline(anext(self._events))
        except StopAsyncIteration:
            self._has_failed = True
            raise BackendError(f"request {self.request_id}: the backend's stream ended before "
                               f"every sample finished") from None
        except (BackendError, Overloaded, ValueError):
            self._has_failed = True
            raise
        self._timer.on_event()
        return event

    def _apply(self, event: TokenEvent) -> None:
        if not 0 <= event.index < len(self._samples):
            raise BackendError(f"request {self.request_id}: event for sample {event.index} of "
                               f"{len(self._samples)}")
        if event.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = event.prompt_logprobs
        self.usage.cached_tokens = max(self.usage.cached_tokens, event.num_cached_tokens)
        sample = self._samples[event.index]
        if sample.is_done:
            return  # a stop string ended this sample; the others are still running
        if event.finish_reason in ("abort", "error"):
            self._has_failed = True
            raise BackendError(f"request {self.request_id}: sample {event.index} ended with "
                               f"{event.finish_reason!r} inside the cluster")
        delta = _advance(sample, event)
        self.usage.completion_tokens += len(delta.token_ids)
        if not self._has_sent_prompt_logprobs and self.prompt_logprobs is not None:
            delta.prompt_logprobs = self.prompt_logprobs
            self._has_sent_prompt_logprobs = True
        self._ready.append(delta)


def _advance(sample: _Sample, event: TokenEvent) -> SampleDelta:
    """Feed ``event``'s tokens to the sample's detokenizer one at a time, so that a stop string
    ending mid-event drops the tokens after it (several arrive at once with speculation)."""
    detokenizer = sample.detokenizer
    delta = SampleDelta(event.index, "", [], [] if event.logprobs is not None else None)
    # finish_reason "stop" from the backend means the last token is EOS or a stop token id.
    is_stop_token = event.finish_reason == "stop"
    last = len(event.token_ids) - 1
    for i, token_id in enumerate(event.token_ids):
        delta.token_ids.append(token_id)
        if delta.logprobs is not None and i < len(event.logprobs):
            delta.logprobs.append(event.logprobs[i])
        check = detokenizer.update([token_id], stop_terminated=is_stop_token and i == last)
        if check.is_stopped:
            delta.finish_reason, delta.stop_reason = "stop", check.stop_str
            break
    else:
        if event.finish_reason is not None:
            detokenizer.finish()
            delta.finish_reason, delta.stop_reason = event.finish_reason, event.stop_token_id
    sample.is_done = delta.finish_reason is not None
    delta.text = detokenizer.get_delta()
    return delta


def _param_of(message: str) -> str | None:
    """SamplingParams.validate starts its messages with the parameter: 'top_p must be ...'."""
    word = message.split(" ", 1)[0].split("[", 1)[0]
    return word if word.isidentifier() else None


ROUTE_HEADER = "pdserve-route"  # HTTP header / gRPC trailing metadata in debug mode: path/reason


def debug_headers(generation: Generation) -> tuple[tuple[str, str], ...]:
    """Debug mode's answer for a started request: its route (``path/reason``) and its TTFT
    breakdown (services/router/ttft_breakdown.py), as HTTP headers / gRPC trailing metadata."""
    headers = ((ROUTE_HEADER, generation.route),) if generation.route else ()
    return (*headers, (TTFT_HEADER, format_breakdown(generation.ttft_stages)))


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

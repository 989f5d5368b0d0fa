"""One request in flight: ``Generation`` streams each sample's detokenized ``SampleDelta``s
from the backend's token events, applies stop strings, and keeps the request's usage, metrics
and deadline (``Frontend.generate`` in pipeline/frontend.py makes one).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from engine.sampling.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.structured.errors import StructuredOutputError
from services.router.backends.backend import TokenEvent
from services.router.deadline import set_request_deadline
from services.router.errors import BackendError, Overloaded, RefusedByBackend, RequestTimeout
from services.router.pipeline.admission import Ticket

if TYPE_CHECKING:
    from engine.models.tokenizer import Tokenizer
    from engine.sampling.logprobs import PositionLogprobs
    from services.router.metrics import RouterMetrics

T = TypeVar("T")


@dataclass(slots=True)
class SampleDelta:
    """What one sample gained from one backend event. ``text`` may be empty (held back for a
    possible stop string, or a character still incomplete) while ``token_ids`` is not."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None  # one per token_ids entry
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: str | int | None = None  # the stop string, or the stop token id (None for EOS)
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # on the first delta of the request, if asked


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

    def __init__(self, events: AsyncGenerator[TokenEvent, None], tokenizer: Tokenizer,
                 metrics: RouterMetrics, request_id: str, prompt_ids: list[int],
                 params: SamplingParams, is_stream: bool = True, ticket: Ticket | None = None,
                 deadline: float | None = None) -> None:
        self.request_id = request_id
        self.deadline = deadline
        self._ticket = ticket
        self.prompt_token_ids = prompt_ids
        self.params = params
        self.usage = Usage(prompt_tokens=len(prompt_ids))
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self._events = events  # the backend's, for this request
        self._samples = [_Sample(IncrementalDetokenizer(tokenizer, prompt_ids, params))
                         for _ in range(params.n)]
        self._first_event: TokenEvent | None = None
        self._ready: deque[SampleDelta] = deque()
        self._is_closed = False
        self._has_sent_prompt_logprobs = False
        self._timer = metrics.request(len(prompt_ids), is_stream)
        self.sent_at = self._timer.sent_at
        self._has_failed = False
        self.route: str | None = None  # how the first sample was routed (TokenEvent.route)
        # seconds per TTFT stage (router_queue, then the first event's stages) and, once the
        # first event is back, "ttft" itself: the debug-mode breakdown
        self.ttft_stages: dict[str, float] = {}
        self._stages = metrics.stages

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
            if isinstance(error, StructuredOutputError):  # a colocated engine refused the constraint
                raise RefusedByBackend(str(error), error.field) from error
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
            if self.deadline is None:  # no coroutine per token to watch a deadline it has not
                event = await anext(self._events)
            else:
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
        if delta.logprobs is not None and event.logprobs is not None and i < len(event.logprobs):
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



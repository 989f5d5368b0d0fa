"""What the router's request pipeline talks to: a request in, token events out.

Two implementations share this interface: ``ColocatedBackend`` (an EngineCore in this
process, COLOCATED role) and ``DisaggregatedBackend`` (a prefill worker then a decode worker
over gRPC). Backends speak token ids only; the pipeline owns tokenization, detokenization and
stop strings, and closes the event iterator when a stop string matched or the client left,
which must abort the request everywhere it holds resources. What a backend raises is in
services/router/errors.py.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # engine.sampling.logprobs imports torch; the router must not at import
    from engine.sampling.logprobs import PositionLogprobs
    from services.router.metrics import RouterMetrics


@dataclass(slots=True)
class TokenEvent:
    """New tokens of one sample. ``logprobs`` holds one entry per token when requested."""

    index: int  # which of the n samples
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # sent once, with the first event of sample 0
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_token_id: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    route: str | None = None  # first event of a sample: how it was routed ("path/reason")
    # first event of a sample: seconds per TTFT stage it passed behind the router's queue
    # (services/router/metrics.py STAGES); the frontend observes them and reports them in debug mode
    ttft_stages: dict[str, float] | None = None


class Backend(abc.ABC):
    @abc.abstractmethod
    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncGenerator[TokenEvent, None]:
        """Stream the request's token events until every sample finished. Raises ValueError
        for bad input (before any event), Overloaded, or BackendError (services/router/errors.py)."""

    async def start(self) -> None:
        """Connect / start engines. Called once before serving."""

    def attach_metrics(self, metrics: RouterMetrics) -> None:
        """The router's metrics (``metrics.stages``, ``metrics.routing``: services/router/metrics.py),
        handed over before ``start``; a backend that records routing or TTFT stages keeps them."""

    async def close(self) -> None:
        """Stop engines and channels."""

    @abc.abstractmethod
    async def is_healthy(self) -> bool:
        ...

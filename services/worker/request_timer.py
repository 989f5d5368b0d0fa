"""Per-request timings of a worker, observed where its handler already sees the events.

    metrics = WorkerMetrics.create(engine, "Qwen", "decode-1", "decode")
    metrics.attach_transfer_counters(handler.transfer_counters)
    timer = metrics.request()            # RPC arrived
    timer.on_scheduled()                 # add_request applied on the engine thread
    timer.on_output(num_new_tokens)      # once per engine output (a step), never per token
    timer.on_finished("stop", num_prompt_tokens=0)

Every histogram is observed in ``on_finished`` except the inter-token gaps, one per output
(spec decode delivers several tokens in one output: one gap). A request that never finishes
(cancelled, failed) observes only the gaps it had. Times are ``time.monotonic()`` seconds.
``WorkerMetrics.disabled()`` hands out ``NullRequestTimer``s: no clock reads, no locks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from services.common.async_engine import AsyncEngine
from services.common.metrics import new_registry
from services.worker.metrics import LABELS, EngineCollector, RequestHistograms
from services.worker.stats import TransferCounters
from services.worker.transfer_metrics import TransferMetrics


class NullRequestTimer:
    """Records nothing (metrics off)."""

    def on_scheduled(self) -> None:
        pass

    def on_output(self, num_new_tokens: int) -> None:
        pass

    def on_finished(self, finish_reason: str | None, num_prompt_tokens: int = 0) -> None:
        pass


class RequestTimer(NullRequestTimer):
    """One request's timeline on one worker (event-loop thread only)."""

    __slots__ = ("_h", "_labels", "_itl", "arrived_at", "scheduled_at", "first_token_at", "last_output_at",
                 "num_generated_tokens")

    def __init__(self, histograms: RequestHistograms, labels: tuple[str, str, str, str]) -> None:
        self._h = histograms
        self._labels = labels
        self._itl = histograms.itl.labels(*labels)  # observed per output: looked up once
        self.arrived_at = time.monotonic()
        self.scheduled_at: float | None = None
        self.first_token_at: float | None = None
        self.last_output_at: float | None = None
        self.num_generated_tokens = 0

    def on_scheduled(self) -> None:
        self.scheduled_at = time.monotonic()

    def on_output(self, num_new_tokens: int) -> None:
        if num_new_tokens <= 0:
            return
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        else:
            self._itl.observe(now - (self.last_output_at or now))
        self.last_output_at = now
        self.num_generated_tokens += num_new_tokens

    def on_finished(self, finish_reason: str | None, num_prompt_tokens: int = 0) -> None:
        """Observe the request's histograms; ``num_prompt_tokens`` > 0 on the worker that
        computed the prompt (prefill, colocated), 0 on a decode worker."""
        h, labels, now = self._h, self._labels, time.monotonic()
        scheduled = self.scheduled_at if self.scheduled_at is not None else self.arrived_at
        first = self.first_token_at
        h.queue.labels(*labels).observe(scheduled - self.arrived_at)
        h.e2e.labels(*labels).observe(now - self.arrived_at)
        h.inference.labels(*labels).observe(now - scheduled)
        if first is not None:
            h.ttft.labels(*labels).observe(first - self.arrived_at)
            h.prefill.labels(*labels).observe(first - scheduled)
            h.decode.labels(*labels).observe(now - first)
            if self.num_generated_tokens > 1:
                h.tpot.labels(*labels).observe((now - first) / (self.num_generated_tokens - 1))
        if num_prompt_tokens > 0:
            h.prompt_tokens.labels(*labels).observe(num_prompt_tokens)
            h.prompt_tokens_total.labels(*labels).inc(num_prompt_tokens)
        h.generation_tokens.labels(*labels).observe(self.num_generated_tokens)
        h.generation_tokens_total.labels(*labels).inc(self.num_generated_tokens)
        h.success.labels(*labels, finish_reason or "unknown").inc()


@dataclass(frozen=True)
class WorkerMetrics:
    """A worker's registry, its engine collector and its request histograms (None: off)."""

    registry: CollectorRegistry
    labels: tuple[str, str, str, str]
    histograms: RequestHistograms | None
    collector: EngineCollector | None
    transfer: TransferMetrics  # KV pushes (prefill workers): services/worker/transfer_metrics.py

    @classmethod
    def create(cls, engine: AsyncEngine, model_name: str, worker_id: str, role: str,
               registry: CollectorRegistry | None = None) -> WorkerMetrics:
        """On a new registry, or on ``registry`` (the colocated router's, next to its own names)."""
        registry = registry or new_registry()
        labels = (model_name, "0", role, worker_id)
        collector = EngineCollector(engine, labels)
        registry.register(collector)
        return cls(registry, labels, RequestHistograms.create(registry), collector,
                   TransferMetrics.create(registry, LABELS, labels))

    @classmethod
    def disabled(cls) -> WorkerMetrics:
        return cls(CollectorRegistry(), ("", "", "", ""), None, None, TransferMetrics.disabled())

    def attach_transfer_counters(self, counters: TransferCounters) -> None:
        """Export the role handler's KV transfer counters (created after the engine)."""
        if self.collector is not None:
            self.collector.transfer_counters = counters

    def attach_index_counts(self, counts: Mapping[str, int]) -> None:
        """Export the prefix-index publisher's counts (``IndexPublisher.counts``: apply results,
        resyncs by reason), read at scrape time."""
        if self.collector is not None:
            self.collector.index_counts = counts

    def request(self) -> NullRequestTimer:
        if self.histograms is None:
            return _NULL_TIMER
        return RequestTimer(self.histograms, self.labels)


_NULL_TIMER = NullRequestTimer()

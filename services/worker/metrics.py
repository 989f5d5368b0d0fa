"""A worker's Prometheus metrics: engine state read at scrape time, request timings observed by
the role's handler.

    metrics = WorkerMetrics.create(runtime, transfer_counters)   # registry + collector
    timer = metrics.request()                  # when an RPC that runs a request arrives
    timer.on_scheduled()                       # the engine accepted it (add_request applied)
    timer.on_output(len(output.new_token_ids)) # once per engine output (one step), not per token
    timer.on_finished(finish_reason)           # observes every histogram once

``EngineCollector`` turns ``AsyncEngine.stats()`` (``EngineStats``: running / waiting, blocks,
per-tier ``TierStats``), the spec-decode statistics and the transfer counters into samples when
Prometheus scrapes: the engine's hot path pays nothing for gauges and counters it already keeps.
Labels on every sample: ``model_name``, ``engine="0"`` (vLLM's engine index: one engine per
process), ``role`` and ``worker`` (the worker id).

What a worker can time, by role (a request's timeline is split between two workers):
prefill: arrival -> scheduled = queue time, scheduled -> first token = prefill time, arrival ->
first token = TTFT, and its prompt tokens. decode: arrival of the Decode call -> first streamed
token = TTFT seen by the decode worker (KV wait included), gaps between outputs = inter-token
latency (one sample per engine step, as vLLM does), decode time, generation tokens, TPOT and
the finish reason. ``NullRequestTimer`` is what a worker started with ``--metrics-port -1`` uses.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from services.common.async_engine import AsyncEngine
from services.common.metrics import LATENCY_BUCKETS_S, TOKEN_BUCKETS, TTFT_BUCKETS_S
from services.index.publisher import RESYNC_REASONS
from services.worker.stats import TransferCounters

LABELS = ("model_name", "engine", "role", "worker")  # engine: "0", vLLM's engine index
APPLY_RESULTS = ("ok", "dup", "gap", "fenced")  # the index's answers to an apply batch


class EngineCollector(Collector):
    """Engine gauges and counters, read from the engine when scraped (any thread: ``stats()``
    and ``spec_stats()`` only read counters the engine thread writes)."""

    def __init__(self, engine: AsyncEngine, labels: tuple[str, str, str, str],
                 transfer_counters: TransferCounters | None = None) -> None:
        self.engine = engine
        self.labels = list(labels)
        self.transfer_counters = transfer_counters or TransferCounters()
        self.index_counts: Mapping[str, int] | None = None  # IndexPublisher.counts, with --redis-url

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self.labels, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self.labels, value)
        return family

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | InfoMetricFamily]:
        if not self.engine.is_alive:
            return
        stats = self.engine.stats()
        yield self._gauge("vllm:num_requests_running", "Requests in the running batch.",
                          stats.num_running_requests)
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                          stats.num_waiting_requests)
        used = stats.num_total_blocks - stats.num_free_blocks
        yield self._gauge("vllm:kv_cache_usage_perc", "Fraction of device KV blocks in use (0..1).",
                          used / stats.num_total_blocks if stats.num_total_blocks else 0.0)
        info = InfoMetricFamily("vllm:cache_config", "KV cache configuration.", labels=LABELS)
        info.add_metric(self.labels, {"block_size": str(stats.block_size),
                                      "num_gpu_blocks": str(stats.num_total_blocks)})
        yield info
        yield self._counter("vllm:num_preemptions", "Requests preempted (recomputed) so far.",
                            stats.num_preemptions)
        yield self._counter("pdserve_engine_chained_steps", "Engine steps launched before the step "
                            "in flight was booked (async scheduling: their host work overlapped "
                            "the device's).", stats.num_chained_steps)
        yield from self._tiers(stats.block_size)
        yield from self._spec()
        yield self._counter("pdserve_kv_transfer_bytes_sent", "KV bytes pushed to decode workers.",
                            self.transfer_counters.num_bytes_sent)
        yield self._counter("pdserve_kv_transfer_bytes_saved", "KV bytes a delta transfer did not "
                            "send (the decode worker had them cached).",
                            self.transfer_counters.num_bytes_skipped_cached)
        blocks = CounterMetricFamily("pdserve_kv_transfer_blocks", "KV blocks of prompts handed to "
                                     "decode workers: sent, or skipped as cached there (delta).",
                                     labels=(*LABELS, "kind"))
        blocks.add_metric([*self.labels, "full"], self.transfer_counters.num_blocks_sent)
        blocks.add_metric([*self.labels, "delta"], self.transfer_counters.num_blocks_skipped_cached)
        yield blocks
        yield from self._index()

    def _index(self) -> Iterator[CounterMetricFamily]:
        """The prefix-index publisher's apply results and resyncs (declared, without samples,
        on a worker that does not publish)."""
        counts = dict(self.index_counts) if self.index_counts is not None else None
        apply = CounterMetricFamily("pdserve_index_apply", "Batches of KV events sent to the prefix "
                                    "index, by its answer.", labels=(*LABELS, "result"))
        resync = CounterMetricFamily("pdserve_index_resync", "Full snapshots of this worker's cache "
                                     "sent to the prefix index, by cause.", labels=(*LABELS, "reason"))
        if counts is not None:
            for result in APPLY_RESULTS:
                apply.add_metric([*self.labels, result], counts.get(result, 0))
            for reason in RESYNC_REASONS:
                resync.add_metric([*self.labels, reason], counts.get(f"resync_{reason}", 0))
        yield apply
        yield resync

    def _tiers(self, block_size: int) -> Iterator[CounterMetricFamily]:
        tiers = self.engine.stats().tiers
        device = [t for t in tiers if t.tier.name == "DEVICE"]
        lower = [t for t in tiers if t.tier.name != "DEVICE"]
        for prefix, group in (("vllm:prefix_cache", device), ("vllm:external_prefix_cache", lower)):
            if not group:
                continue
            yield self._counter(f"{prefix}_queries", "Prompt tokens looked up (token counts).",
                                sum(t.num_queried_blocks for t in group) * block_size)
            yield self._counter(f"{prefix}_hits", "Prompt tokens served from the cache.",
                                sum(t.num_hit_tokens for t in group))
        per_tier = {
            "pdserve_prefix_hit_tokens": ("Prompt tokens served by each tier.", "num_hit_tokens"),
            "pdserve_kv_evictions": ("Blocks that left each tier to make room.", "num_evicted_blocks"),
            "pdserve_kv_load_failures": ("Loads from each tier that stopped short.", "num_load_failures"),
        }
        for name, (doc, field) in per_tier.items():
            family = CounterMetricFamily(name, doc, labels=(*LABELS, "tier"))
            for tier in tiers:
                assert tier.tier.name is not None  # one tier per TierStats, never a combination of flags
                family.add_metric([*self.labels, tier.tier.name.lower()], getattr(tier, field))
            yield family
        yield self._counter("vllm:kv_offload_store_bytes", "Bytes offloaded device -> host.",
                            sum(t.num_offloaded_bytes for t in tiers))
        yield self._counter("vllm:kv_offload_load_bytes", "Bytes loaded host -> device.",
                            sum(t.num_loaded_bytes for t in tiers))

    def _spec(self) -> Iterator[CounterMetricFamily]:
        spec = self.engine.spec_stats()
        if spec is None:
            return
        # spec_stats() is the engine's dict[str, object]: these two keys hold list[int], that one an int
        proposed = list(spec["num_proposed_per_position"])  # type: ignore[call-overload]  # see above
        accepted = list(spec["num_accepted_per_position"])  # type: ignore[call-overload]  # see above
        yield self._counter("vllm:spec_decode_num_drafts", "Verification steps that had drafts.",
                            int(spec["num_spec_steps"]))  # type: ignore[call-overload]  # see above
        yield self._counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", sum(proposed))
        yield self._counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", sum(accepted))
        family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted at each position.", labels=(*LABELS, "position"))
        for position, count in enumerate(accepted):
            family.add_metric([*self.labels, str(position)], count)
        yield family


@dataclass(frozen=True)
class RequestHistograms:
    """The per-request vLLM families of one worker, bound to its labels."""

    ttft: Histogram
    itl: Histogram
    tpot: Histogram
    e2e: Histogram
    queue: Histogram
    prefill: Histogram
    decode: Histogram
    inference: Histogram
    prompt_tokens: Histogram
    generation_tokens: Histogram
    prompt_tokens_total: Counter
    generation_tokens_total: Counter
    success: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> RequestHistograms:
        def latency(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS_S) -> Histogram:
            return Histogram(name, doc, LABELS, registry=registry, buckets=buckets)

        def tokens(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, LABELS, registry=registry, buckets=TOKEN_BUCKETS)

        return cls(
            latency("vllm:time_to_first_token_seconds", "Arrival to first token (s).", TTFT_BUCKETS_S),
            latency("vllm:inter_token_latency_seconds", "Gap between two outputs of a request (s)."),
            latency("vllm:request_time_per_output_token_seconds", "Decode time / (tokens - 1) (s)."),
            latency("vllm:e2e_request_latency_seconds", "Arrival to finish on this worker (s)."),
            latency("vllm:request_queue_time_seconds", "Arrival to scheduled (s)."),
            latency("vllm:request_prefill_time_seconds", "Scheduled to first token (s)."),
            latency("vllm:request_decode_time_seconds", "First token to finish (s)."),
            latency("vllm:request_inference_time_seconds", "Scheduled to finish (s)."),
            tokens("vllm:request_prompt_tokens", "Prompt tokens per request."),
            tokens("vllm:request_generation_tokens", "Generated tokens per request."),
            Counter("vllm:prompt_tokens", "Prompt tokens processed.", LABELS, registry=registry),
            Counter("vllm:generation_tokens", "Tokens generated.", LABELS, registry=registry),
            Counter("vllm:request_success", "Finished requests by reason.", (*LABELS, "finished_reason"),
                    registry=registry),
        )

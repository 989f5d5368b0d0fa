"""The router's Prometheus metrics: Dynamo's frontend names and pdserve's routing names.

    metrics = RouterMetrics.create(model_name)   # one per Router; served at GET /metrics
    timer = metrics.request(num_prompt_tokens)   # Generation: when the request is sent
    timer.on_event(num_new_tokens)               # every backend event (first one: TTFT)
    timer.on_finished("success" | "error" | "cancelled", num_output_tokens, num_cached_tokens)
    metrics.reject("invalid")                    # a request refused before it started
    metrics.set_slo(ttft_s=1.0, tpot_s=0.1)      # goodput's targets (--slo-ttft-s, --slo-tpot-s)

Goodput: a request that finished with ``success``, whose TTFT (sent to first event) and TPOT
((last event - first event) / (output tokens - 1); 0 for one token) both met their targets,
counts in ``pdserve_requests_slo_met_total{model}``; the rules file divides it by the requests
that were not cancelled (``dynamo_frontend_requests_total``). The targets are exported as
``pdserve_slo_target_seconds{target="ttft"|"tpot"}``.

For the routing code (services/router/backends/disaggregated.py, the policies): ``metrics.stages``
(``StageRecorder``) and ``metrics.routing`` (``RoutingRecorder``) take what only that code sees,
e.g.::

    recorder.stages.observe("index_lookup", seconds)         # TTFT stage, histogram
    recorder.routing.decision("remote_delta", "prefix_hit")   # pdserve_route_decisions_total
    recorder.routing.index_lookup(seconds)
    recorder.routing.set_index_available(False); recorder.routing.fallback("redis_down")

A backend gets them through ``Backend.attach_metrics(metrics)`` (a no-op by default; override
it to keep ``metrics``), which the Router calls before ``start``. Stage names: ``STAGES``; a
stage outside them is a ValueError (a typo would
otherwise become a series no dashboard shows).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.metrics import LATENCY_BUCKETS_S, TOKEN_BUCKETS, TTFT_BUCKETS_S, new_registry

STAGES = ("router_queue", "index_lookup", "prefill_queue", "prefill_compute", "kv_transfer",
          "decode_admit")
STATUSES = ("success", "error", "cancelled")
# IndexClient's fallback reasons: zero series from the start
INDEX_FALLBACK_REASONS = ("breaker_open", "meta_mismatch", "timeout", "error")
REJECT_REASONS = ("auth", "overload", "invalid")
SLO_TTFT_S, SLO_TPOT_S = 1.0, 0.1  # default goodput targets (the dashboards' SLO thresholds)


@dataclass(frozen=True)
class StageRecorder:
    """``pdserve_ttft_stage_seconds{stage}``: one observation per request and stage it passed."""

    histogram: Histogram

    def observe(self, stage: str, seconds: float) -> None:
        if stage not in STAGES:
            raise ValueError(f"TTFT stage {stage!r} is not one of {STAGES}")
        self.histogram.labels(stage).observe(max(seconds, 0.0))


@dataclass(frozen=True)
class RoutingRecorder:
    """Routing decisions and the prefix index's health, as the routing code sees them."""

    decisions: Counter
    index_available: Gauge
    index_lookup_seconds: Histogram
    index_fallbacks: Counter

    def decision(self, path: str, reason: str) -> None:
        """``path``: ``local`` | ``remote`` | ``remote_delta``."""
        self.decisions.labels(path, reason).inc()

    def set_index_available(self, is_available: bool) -> None:
        self.index_available.set(1.0 if is_available else 0.0)

    def index_lookup(self, seconds: float) -> None:
        self.index_lookup_seconds.observe(seconds)

    def fallback(self, reason: str) -> None:
        self.index_fallbacks.labels(reason).inc()


@dataclass
class RouterMetrics:
    """Created with the Router (before the model is known); ``set_model`` names it once the
    frontend is built, and creates the zero series."""

    registry: CollectorRegistry
    model_name: str
    requests: Counter
    inflight: Gauge
    queued: Gauge
    ttft: Histogram
    itl: Histogram
    duration: Histogram
    input_tokens: Histogram
    output_tokens: Histogram
    cached_tokens: Histogram
    rejected: Counter
    stages: StageRecorder
    routing: RoutingRecorder
    slo_met: Counter
    slo_target: Gauge
    slo_ttft_s: float = SLO_TTFT_S
    slo_tpot_s: float = SLO_TPOT_S

    @classmethod
    def create(cls, model_name: str = "") -> RouterMetrics:
        r = new_registry()
        model = ("model",)

        def hist(name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = model) -> Histogram:
            return Histogram(name, doc, labels, registry=r, buckets=buckets)

        metrics = cls(
            r, model_name,
            Counter("dynamo_frontend_requests", "Requests by type and final status.",
                    ("model", "request_type", "status"), registry=r),
            Gauge("dynamo_frontend_inflight_requests", "Requests being served now.", model, registry=r),
            Gauge("dynamo_frontend_queued_requests", "Requests sent, first token not yet back.", model,
                  registry=r),
            hist("dynamo_frontend_time_to_first_token_seconds", "Sent to first token (s).", TTFT_BUCKETS_S),
            hist("dynamo_frontend_inter_token_latency_seconds", "Gap between backend events (s).",
                 LATENCY_BUCKETS_S),
            hist("dynamo_frontend_request_duration_seconds", "Sent to last token (s).", TTFT_BUCKETS_S),
            hist("dynamo_frontend_input_sequence_tokens", "Prompt tokens per request.", TOKEN_BUCKETS),
            hist("dynamo_frontend_output_sequence_tokens", "Generated tokens per request.", TOKEN_BUCKETS),
            hist("dynamo_frontend_cached_tokens", "Prompt tokens served from a prefix cache.", TOKEN_BUCKETS),
            Counter("pdserve_rejected_requests", "Requests refused before they started.", ("reason",),
                    registry=r),
            StageRecorder(Histogram("pdserve_ttft_stage_seconds", "Time a request spent in each TTFT "
                                    "stage (s).", ("stage",), registry=r, buckets=LATENCY_BUCKETS_S)),
            RoutingRecorder(
                Counter("pdserve_route_decisions", "Routing decisions by path and reason.", ("path", "reason"),
                        registry=r),
                Gauge("pdserve_index_available", "1 while the prefix index answers, else 0.", registry=r),
                Histogram("pdserve_index_lookup_seconds", "Prefix-index lookup time (s).", registry=r,
                          buckets=LATENCY_BUCKETS_S),
                Counter("pdserve_index_fallback", "Routing without the index, by reason.", ("reason",),
                        registry=r)),
            Counter("pdserve_requests_slo_met", "Successful requests that met both the TTFT and the "
                    "TPOT target (goodput).", model, registry=r),
            Gauge("pdserve_slo_target_seconds", "Goodput's targets (s).", ("target",), registry=r),
        )
        for reason in REJECT_REASONS:
            metrics.rejected.labels(reason)
        for reason in INDEX_FALLBACK_REASONS:
            metrics.routing.index_fallbacks.labels(reason)
        metrics.set_slo(SLO_TTFT_S, SLO_TPOT_S)
        metrics.set_model(model_name)
        return metrics

    def set_model(self, model_name: str) -> None:
        self.model_name = model_name
        for status in STATUSES:  # zero series exist before the first request: rate() works at once
            for request_type in ("stream", "unary"):
                self.requests.labels(model_name, request_type, status)
        self.inflight.labels(model_name)
        self.queued.labels(model_name)
        self.slo_met.labels(model_name)

    def set_slo(self, ttft_s: float, tpot_s: float) -> None:
        """Goodput's targets in seconds (ValueError unless both are positive)."""
        if not (ttft_s > 0 and tpot_s > 0):
            raise ValueError(f"SLO targets must be positive seconds, got ttft={ttft_s} tpot={tpot_s}")
        self.slo_ttft_s, self.slo_tpot_s = ttft_s, tpot_s
        self.slo_target.labels("ttft").set(ttft_s)
        self.slo_target.labels("tpot").set(tpot_s)

    def request(self, num_prompt_tokens: int, is_stream: bool = True) -> RequestTimer:
        return RequestTimer(self, num_prompt_tokens, "stream" if is_stream else "unary")

    def reject(self, reason: str, is_stream: bool = True, was_counted: bool = False) -> None:
        """A request refused at the edge: ``pdserve_rejected_requests_total{reason}``, and an
        ``error`` request unless its Generation already counted it (``was_counted``)."""
        if reason not in REJECT_REASONS:
            raise ValueError(f"reject reason {reason!r} is not one of {REJECT_REASONS}")
        self.rejected.labels(reason).inc()
        if not was_counted:
            self.requests.labels(self.model_name, "stream" if is_stream else "unary", "error").inc()


class RequestTimer:
    """One request as the router sees it (event-loop thread only); ``on_finished`` is idempotent."""

    __slots__ = ("m", "num_prompt_tokens", "request_type", "sent_at", "last_event_at", "is_done", "ttft_s",
                 "_itl")

    def __init__(self, metrics: RouterMetrics, num_prompt_tokens: int, request_type: str) -> None:
        self.m = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.request_type = request_type
        self.sent_at = time.monotonic()
        self.last_event_at: float | None = None
        self.is_done = False
        self.ttft_s = 0.0  # sent to first event (s), once it came
        metrics.inflight.labels(metrics.model_name).inc()
        metrics.queued.labels(metrics.model_name).inc()
        self._itl = metrics.itl.labels(metrics.model_name)  # observed per event: looked up once

    def on_event(self) -> None:
        now, m = time.monotonic(), self.m
        if self.last_event_at is None:
            self.ttft_s = now - self.sent_at
            m.ttft.labels(m.model_name).observe(self.ttft_s)
            m.queued.labels(m.model_name).dec()
        else:
            self._itl.observe(now - self.last_event_at)
        self.last_event_at = now

    def on_finished(self, status: str, num_output_tokens: int, num_cached_tokens: int) -> None:
        if self.is_done:
            return
        self.is_done = True
        m, model = self.m, self.m.model_name
        if self.last_event_at is None:
            m.queued.labels(model).dec()
        m.inflight.labels(model).dec()
        m.requests.labels(model, self.request_type, status).inc()
        m.duration.labels(model).observe(time.monotonic() - self.sent_at)
        m.input_tokens.labels(model).observe(self.num_prompt_tokens)
        m.output_tokens.labels(model).observe(num_output_tokens)
        m.cached_tokens.labels(model).observe(num_cached_tokens)
        if status == "success" and self.last_event_at is not None:
            first_at = self.sent_at + self.ttft_s
            tpot_s = (self.last_event_at - first_at) / (num_output_tokens - 1) if num_output_tokens > 1 else 0.0
            if self.ttft_s <= m.slo_ttft_s and tpot_s <= m.slo_tpot_s:
                m.slo_met.labels(model).inc()

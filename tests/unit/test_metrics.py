"""services/common/metrics.py and the router's recorders: the flag, the server, exact counts."""

from __future__ import annotations

import argparse
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics import LATENCY_BUCKETS_S, add_metrics_argument, render, start_metrics_server
from services.router.metrics import STAGES, RouterMetrics


def samples(registry) -> dict[tuple[str, tuple], float]:
    text = render(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_buckets_resolve_one_millisecond_to_sixty_seconds():
    assert LATENCY_BUCKETS_S[0] == 0.001 and LATENCY_BUCKETS_S[-1] == 60.0
    assert list(LATENCY_BUCKETS_S) == sorted(set(LATENCY_BUCKETS_S))


def test_metrics_port_flag_reads_the_environment(monkeypatch):
    monkeypatch.delenv("PDSERVE_METRICS_PORT", raising=False)
    parser = argparse.ArgumentParser()
    add_metrics_argument(parser)
    assert parser.parse_args([]).metrics_port == 0
    monkeypatch.setenv("PDSERVE_METRICS_PORT", "-1")
    parser = argparse.ArgumentParser()
    add_metrics_argument(parser)
    assert parser.parse_args([]).metrics_port == -1
    assert parser.parse_args(["--metrics-port", "9100"]).metrics_port == 9100


def test_metrics_server_serves_the_registry_and_minus_one_is_off():
    metrics = RouterMetrics.create("m")
    assert start_metrics_server(-1, "127.0.0.1", metrics.registry) is None
    with pytest.raises(ValueError, match="--metrics-port"):
        start_metrics_server(-2, "127.0.0.1", metrics.registry)
    server = start_metrics_server(0, "127.0.0.1", metrics.registry)
    try:
        with urllib.request.urlopen(f"http://{server.address}/metrics", timeout=5) as reply:
            assert b"dynamo_frontend_inflight_requests" in reply.read()
    finally:
        server.close()


def test_router_request_timer_counts_each_request_once():
    m = RouterMetrics.create("m")
    ok = m.request(10)
    ok.on_event()
    ok.on_event()
    ok.on_finished("success", 2, 8)
    ok.on_finished("success", 2, 8)  # idempotent
    cancelled = m.request(5, is_stream=False)
    cancelled.on_finished("cancelled", 0, 0)  # before its first token: leaves the queue too
    m.reject("invalid")
    m.reject("overload", was_counted=True)
    s = samples(m.registry)
    model = ("model", "m")
    assert s[("dynamo_frontend_requests_total", (model, ("request_type", "stream"), ("status", "success")))] == 1
    assert s[("dynamo_frontend_requests_total", (model, ("request_type", "unary"), ("status", "cancelled")))] == 1
    assert s[("dynamo_frontend_requests_total", (model, ("request_type", "stream"), ("status", "error")))] == 1
    assert s[("pdserve_rejected_requests_total", (("reason", "invalid"),))] == 1
    assert s[("pdserve_rejected_requests_total", (("reason", "overload"),))] == 1
    assert s[("dynamo_frontend_time_to_first_token_seconds_count", (model,))] == 1
    assert s[("dynamo_frontend_inter_token_latency_seconds_count", (model,))] == 1
    assert s[("dynamo_frontend_cached_tokens_sum", (model,))] == 8
    assert s[("dynamo_frontend_inflight_requests", (model,))] == 0
    assert s[("dynamo_frontend_queued_requests", (model,))] == 0


def test_stage_recorder_refuses_unknown_stages():
    m = RouterMetrics.create("m")
    for stage in STAGES:
        m.stages.observe(stage, 0.002)
    with pytest.raises(ValueError, match="prefil_compute"):
        m.stages.observe("prefil_compute", 0.1)
    with pytest.raises(ValueError, match="reject reason"):
        m.reject("teapot")
    m.routing.decision("remote_delta", "prefix_hit")
    m.routing.set_index_available(True)
    s = samples(m.registry)
    assert s[("pdserve_ttft_stage_seconds_count", (("stage", "decode_admit"),))] == 1
    assert s[("pdserve_route_decisions_total", (("path", "remote_delta"), ("reason", "prefix_hit")))] == 1
    assert s[("pdserve_index_available", ())] == 1


def test_first_event_stages_are_observed_once_and_kept_for_debug_mode():
    """A sample's first TokenEvent carries the stages behind the router's queue: the frontend
    observes each once per request and keeps them, with the TTFT, as the debug breakdown."""
    import asyncio

    from engine.sampling_params import SamplingParams
    from services.router.backends.backend import TokenEvent
    from services.router.model_info import ModelInfo
    from services.router.pipeline.frontend import Frontend
    from tests.unit.test_router_frontend import ALPHABET, CharTokenizer, ScriptedBackend

    worker = {"decode_admit": 0.002, "prefill_queue": 0.001, "prefill_compute": 0.02, "kv_transfer": 0.0,
              "index_lookup": 0.003}
    events = [TokenEvent(0, [1], ttft_stages=dict(worker)), TokenEvent(0, [2], ttft_stages={"kv_transfer": 9.0}),
              TokenEvent(0, [3], finish_reason="length")]
    frontend = Frontend(CharTokenizer(), ScriptedBackend(events), ModelInfo("m", len(ALPHABET) + 1, 64))

    async def serve():
        generation = frontend.generate([0, 1], SamplingParams(max_tokens=3), arrived_at=0.0)
        async with generation:
            _ = [d async for d in generation]
        return generation

    generation = asyncio.run(serve())
    s = samples(frontend.metrics.registry)
    for stage, seconds in worker.items():
        assert s[("pdserve_ttft_stage_seconds_count", (("stage", stage),))] == 1
        assert s[("pdserve_ttft_stage_seconds_sum", (("stage", stage),))] == pytest.approx(seconds)
        assert generation.ttft_stages[stage] == seconds
    assert s[("pdserve_ttft_stage_seconds_count", (("stage", "router_queue"),))] == 1
    assert 0 < generation.ttft_stages["ttft"] < 5 and generation.ttft_stages["router_queue"] > 0


def test_route_decisions_and_worker_stages_reach_the_router_metrics():
    from services.common.wire import ttft_stages_from_proto, ttft_stages_to_proto
    from services.router.routing.route_decisions import RouteDecisions

    m = RouterMetrics.create("m")
    decisions = RouteDecisions()
    decisions.listener = m.routing.decision
    decisions.record("local/short_uncached", 0.001)
    decisions.record("remote/load")
    s = samples(m.registry)
    assert s[("pdserve_route_decisions_total", (("path", "local"), ("reason", "short_uncached")))] == 1
    assert s[("pdserve_route_decisions_total", (("path", "remote"), ("reason", "load")))] == 1
    stages = {"prefill_queue": 0.25, "kv_transfer": 0.0}  # unset fields: stages not passed
    assert ttft_stages_from_proto(ttft_stages_to_proto(stages)) == stages
    with pytest.raises(ValueError, match="router_queue"):
        ttft_stages_to_proto({"router_queue": 0.1})


def test_transfer_metrics_per_transport_and_the_nixl_names():
    from prometheus_client import CollectorRegistry

    from services.worker.metrics import LABELS
    from services.worker.transfer_metrics import TransferMetrics

    registry = CollectorRegistry()
    labels = ("m", "0", "prefill", "p0")
    metrics = TransferMetrics.create(registry, LABELS, labels)
    worker = tuple(zip(LABELS, labels))
    s = samples(registry)
    for transport in ("nixl", "grpc"):  # zero series before the first transfer
        assert s[("pdserve_kv_transfer_seconds_count", tuple(sorted((*worker, ("transport", transport)))))] == 0
    metrics.done("grpc", 0.02, 4096)
    metrics.done("nixl", 0.01, 8192)
    metrics.failed("nixl")
    with pytest.raises(ValueError, match="ucx"):
        metrics.done("ucx", 0.1, 1)
    s = samples(registry)
    key = tuple(sorted(worker))
    assert s[("pdserve_kv_transfer_seconds_count", tuple(sorted((*worker, ("transport", "grpc")))))] == 1
    assert s[("pdserve_kv_transfer_failures_total", tuple(sorted((*worker, ("transport", "nixl")))))] == 1
    assert s[("vllm:nixl_xfer_time_seconds_count", key)] == 1  # nixl only, as vLLM
    assert s[("vllm:nixl_bytes_transferred_sum", key)] == 8192
    assert s[("vllm:nixl_num_failed_transfers_total", key)] == 1
    TransferMetrics.disabled().done("grpc", 0.1, 1)  # metrics off: records nothing, no error


def test_metrics_server_keeps_vllm_colons_whatever_prometheus_accepts():
    """Prometheus asks for OpenMetrics first; prometheus_client's OpenMetrics writer turns ':' into
    '_' in sample names, so the server answers the text format: vllm:* names stay intact."""
    from prometheus_client import Counter

    registry = RouterMetrics.create("m").registry
    Counter("vllm:test_requests", "A vLLM-style name.", registry=registry).inc()
    server = start_metrics_server(0, "127.0.0.1", registry)
    accept = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
              "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")  # Prometheus 2.x's scrape header
    try:
        request = urllib.request.Request(f"http://{server.address}/metrics", headers={"Accept": accept})
        with urllib.request.urlopen(request, timeout=5) as reply:
            assert reply.headers["Content-Type"].startswith("text/plain")
            text = reply.read().decode()
    finally:
        server.close()
    assert "\nvllm:test_requests_total 1.0\n" in text and "vllm_test_requests" not in text

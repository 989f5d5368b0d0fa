"""Every service's /metrics against what happened: one real cluster (router, a prefill worker,
a decode worker with n-gram speculation, a kvstore, a real redis-server as the prefix index), a
bounded mix of requests (plain, a prefix hit, a cancelled stream, a bad request), then every
endpoint scraped and its numbers checked against the requests sent.

Where Debian's ``prometheus`` package is installed, a real Prometheus server then scrapes the
same cluster: ``promtool check rules`` passes on the recording rules, and every dashboard
panel's query evaluates to a non-empty result (``PDSERVE_WRITE_DASHBOARD_PNGS=1`` also renders
the dashboards from its data into docs/dashboards/, deploy/grafana/render_pngs.py).

Every metric name the dashboards query must be one this live scrape exposes; the names are kept
in ``tests/integration/metrics_names.txt`` (rewritten with ``PDSERVE_WRITE_METRIC_NAMES=1``) for
the fast dashboard test (tests/unit/test_dashboards.py).
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from services.router.metrics import STAGES
from services.router.pipeline.debug_route import TTFT_HEADER, parse_breakdown
from tests.integration import prometheus_server
from tests.integration.cluster_fixtures import (
    free_port,
    start_kvstore,
    start_router,
    start_worker,
    stop_all,
    wait_all_blocks_free,
    wait_serving,
)
from tests.unit.test_dashboards import DASHBOARDS, RULES_FILE, expressions, scraped_names_used, to_promql

pytestmark = pytest.mark.slow
NAMES_FILE = Path(__file__).with_name("metrics_names.txt")
PREFIX = [100 + (i * 7) % 900 for i in range(48)]  # 3 blocks of 16: shared by the prefix-hit pair
PROMPTS = [PREFIX + [11, 12, 13], PREFIX + [21, 22], [5, 6, 7, 8, 9] * 6, list(range(300, 340))]
MAX_TOKENS = 12


def _port(process, flag: str) -> str:
    return process.args[process.args.index(flag) + 1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, module_redis_server):
    log_dir = tmp_path_factory.mktemp("metrics-logs")
    common = ["--num-kv-blocks", "64", "--log-level", "WARNING", "--redis-url", module_redis_server.url,
              "--index-heartbeat-s", "0.5"]
    prefill = start_worker("prefill", log_dir, *common, "--metrics-port", str(free_port()), transfer="grpc")
    decode = start_worker("decode", log_dir, *common, "--metrics-port", str(free_port()),
                          "--spec-method", "ngram", "--spec-k", "3", transfer="grpc")
    kvstore = start_kvstore(log_dir, "--metrics-port", str(free_port()), "--kvstore-gib", "0.05",
                            transfer="grpc")
    # prefix-aware routing through the index, never the local path: every request is prefilled
    router = start_router(log_dir, [prefill], [decode], "grpc", "--debug-route", "--redis-url",
                          module_redis_server.url, "--local-prefill-max-tokens", "0")
    processes = [prefill, decode, kvstore, router]
    try:
        wait_serving(processes, timeout_s=400.0)  # the shared 2-core box can be slow to load
        yield {"prefill": prefill, "decode": decode, "kvstore": kvstore, "router": router}
    finally:
        stop_all([router])
        stop_all([prefill, decode, kvstore])


def scrape(url: str) -> dict[str, list[Sample]]:
    """{family name: samples} of one /metrics endpoint (text format, real parser)."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    families: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        families.setdefault(family.name, []).extend(family.samples)
        families[f"__type__{family.name}"] = family.type  # type: ignore[assignment]
    return families


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",),
            "summary": ("_sum", "_count")}


def exposed_names(families: dict) -> set[str]:
    """Every series name an endpoint exposes or declares (a labelled family with no child yet has
    HELP/TYPE lines but no sample: its names are still what a dashboard may query)."""
    names = set()
    for key, kind in families.items():
        if key.startswith("__type__"):
            family = key[len("__type__"):]
            names.update(family + suffix for suffix in SUFFIXES.get(kind, ("",)))
            names.update(s.name for s in families[family])
    return names


def value(families: dict, sample_name: str, **labels: str) -> float:
    """Sum of the samples called ``sample_name`` whose labels include ``labels``."""
    total = 0.0
    for name, samples in families.items():
        if name.startswith("__type__"):
            continue
        for s in samples:
            if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def _complete(port: str, prompt: list[int], stream: bool = False, **fields: object) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
                       "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {}),
                       **fields}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        if not stream:
            return json.loads(reply.read())
        usage: dict = {}
        for line in reply:
            line = line.decode().strip()
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
        return {"usage": usage}


def _cancelled_stream(port: str, prompt: list[int]) -> None:
    """Open a long stream, read its first event, then drop the connection."""
    connection = http.client.HTTPConnection("127.0.0.1", int(port), timeout=60)
    body = json.dumps({"prompt": prompt, "max_tokens": 200, "temperature": 0.0, "ignore_eos": True,
                       "stream": True})
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    reply = connection.getresponse()
    for _ in range(20):  # bounded: until the first data line
        if reply.readline().startswith(b"data: {"):
            break
    connection.close()


def _debug_breakdown(port: str, prompt: list[int]) -> dict:
    """A request to the --debug-route router: the TTFT breakdown header it answers."""
    body = json.dumps({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        reply.read()
        return parse_breakdown(reply.headers[TTFT_HEADER])


def _generate_with_timings(address: str) -> None:
    """``pdserve generate --timings`` prints each stage and the TTFT (a real client process)."""
    done = subprocess.run([sys.executable, "-m", "services.cli", "generate", "a b c", "--address", address,
                           "--max-tokens", "3", "--temperature", "0", "--timings"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": "."})
    assert done.returncode == 0, done.stderr
    for name in ("TTFT breakdown (route remote/", "prefill_compute", "decode_admit", "network and router"):
        assert name in done.stderr, done.stderr


def test_every_metrics_endpoint_matches_the_requests_sent(cluster):
    router = cluster["router"]
    http_port = _port(router, "--http-port")
    usages = [_complete(http_port, p, stream=i % 2 == 0)["usage"] for i, p in enumerate(PROMPTS)]
    _cancelled_stream(http_port, PROMPTS[3])
    with pytest.raises(urllib.error.HTTPError) as bad:
        _complete(http_port, PROMPTS[0], max_tokens=-1)
    assert bad.value.code == 400
    # The cancel reaches both workers asynchronously: wait until nothing holds a block.
    freed = wait_all_blocks_free([cluster["prefill"], cluster["decode"]], timeout_s=10.0)
    assert all(free == total for free, total in freed.values()), freed

    urls = {role: f"http://127.0.0.1:{_port(p, '--metrics-port')}/metrics" for role, p in cluster.items()
            if role != "router"}
    urls["router"] = f"http://127.0.0.1:{http_port}/metrics"
    scraped = {role: scrape(url) for role, url in urls.items()}
    num_ok, num_streams = len(PROMPTS), len(PROMPTS) + 1  # the cancelled one started streaming

    r = scraped["router"]
    assert value(r, "dynamo_frontend_requests_total", status="success") == num_ok
    assert value(r, "dynamo_frontend_requests_total", status="cancelled") == 1
    assert value(r, "dynamo_frontend_requests_total", status="error") == 1
    assert value(r, "pdserve_rejected_requests_total", reason="invalid") == 1
    assert value(r, "dynamo_frontend_time_to_first_token_seconds_count") == num_streams
    assert value(r, "dynamo_frontend_request_duration_seconds_count") == num_streams
    assert value(r, "dynamo_frontend_inflight_requests") == 0
    assert value(r, "dynamo_frontend_queued_requests") == 0
    assert value(r, "dynamo_frontend_input_sequence_tokens_sum") == sum(map(len, PROMPTS)) + len(PROMPTS[3])
    assert value(r, "dynamo_frontend_output_sequence_tokens_sum") >= sum(u["completion_tokens"] for u in usages)
    cached = sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) or 0 for u in usages)
    assert value(r, "dynamo_frontend_cached_tokens_sum") >= cached > 0, usages  # the prefix hit
    # router_queue per request is at most its whole TTFT (the stage ends where TTFT starts)
    assert value(r, "pdserve_ttft_stage_seconds_count", stage="router_queue") == num_streams
    assert (value(r, "pdserve_ttft_stage_seconds_sum", stage="router_queue")
            <= value(r, "dynamo_frontend_request_duration_seconds_sum"))
    # the index lookup and the workers' stages (back with each first token): one per stream, and
    # together no longer than the TTFTs they are part of (the rest is the network and the router)
    inner_stages = ("index_lookup", "decode_admit", "prefill_queue", "prefill_compute", "kv_transfer")
    for stage in inner_stages:
        assert value(r, "pdserve_ttft_stage_seconds_count", stage=stage) == num_streams, stage
    assert (sum(value(r, "pdserve_ttft_stage_seconds_sum", stage=stage) for stage in inner_stages)
            <= value(r, "dynamo_frontend_time_to_first_token_seconds_sum"))
    assert value(r, "pdserve_route_decisions_total", path="remote") == num_streams
    assert value(r, "pdserve_route_decisions_total") == num_streams
    assert value(r, "pdserve_index_lookup_seconds_count") + value(r, "pdserve_index_fallback_total") >= num_streams
    assert 0 <= value(r, "pdserve_requests_slo_met_total") <= num_ok
    assert value(r, "pdserve_slo_target_seconds", target="ttft") == 1.0

    p, d = scraped["prefill"], scraped["decode"]
    # prefill computed every prompt and hit the prefix once; the cancelled stream counts if its
    # prefill job saw the engine finish it before the cancel arrived (it streams the first token
    # before that output, so either may win)
    num_prefilled = value(p, "vllm:request_success_total", finished_reason="prefilled")
    assert num_prefilled in (num_ok, num_streams)
    assert value(p, "vllm:prompt_tokens_total") == (sum(map(len, PROMPTS))
                                                    + (num_prefilled - num_ok) * len(PROMPTS[3]))
    assert value(p, "vllm:time_to_first_token_seconds_count") == num_prefilled
    assert value(p, "vllm:prefix_cache_hits_total") >= 48
    assert value(p, "vllm:prefix_cache_queries_total") >= value(p, "vllm:prefix_cache_hits_total")
    assert value(p, "pdserve_kv_transfer_blocks_total", kind="full") > 0
    # one transfer per request handed to the decode worker (the cancelled one: if it got that far)
    assert num_ok <= value(p, "pdserve_kv_transfer_seconds_count", transport="grpc") <= num_streams
    assert value(p, "pdserve_kv_transfer_failures_total") == 0
    for w in (p, d):  # both workers published their caches to the index
        assert value(w, "pdserve_index_resync_total", reason="start") >= 1
        # on a CPU 'auto' leaves async scheduling off (and the decode worker speculates)
        assert value(w, "pdserve_engine_chained_steps_total") == 0
        assert value(w, "pdserve_index_apply_total", result="ok") > 0
    assert ((value(p, "pdserve_kv_transfer_bytes_saved_total") > 0)
            == (value(p, "pdserve_kv_transfer_blocks_total", kind="delta") > 0))
    # decode generated every token after the first of the finished requests
    assert value(d, "vllm:request_success_total", finished_reason="length") == num_ok
    assert value(d, "vllm:generation_tokens_total") == sum(u["completion_tokens"] - 1 for u in usages)
    assert value(d, "vllm:inter_token_latency_seconds_count") > 0
    assert value(d, "vllm:spec_decode_num_draft_tokens_total") >= value(d, "vllm:spec_decode_num_accepted_tokens_total")
    for role in ("prefill", "decode"):
        w = scraped[role]
        assert value(w, "vllm:num_requests_running") == 0 and value(w, "vllm:num_requests_waiting") == 0
        assert value(w, "vllm:kv_cache_usage_perc") == 0
        labels = next(s.labels for s in w["vllm:num_requests_running"])
        assert labels["engine"] == "0" and labels["role"] == role and labels["model_name"]
        assert not [n for n in w if "gpu_cache_usage" in n or "time_per_output_token_seconds" == n[5:]]
    assert "pdserve_kvstore_capacity_bytes" in scraped["kvstore"]
    for role, families in scraped.items():  # no negative gauges anywhere
        for name, kind in families.items():
            if name.startswith("__type__") and kind == "gauge":
                samples = families[name[len("__type__"):]]
                assert all(s.value >= 0 for s in samples), (role, name, samples)

    names = set().union(*(exposed_names(families) for families in scraped.values()))
    used = scraped_names_used()
    assert used and used <= names, sorted(used - names)
    if os.environ.get("PDSERVE_WRITE_METRIC_NAMES") == "1":
        NAMES_FILE.write_text("\n".join(sorted(n for n in names if n.startswith(("vllm:", "dynamo_", "pdserve_"))
                                                    and not n.endswith("_created")))
                              + "\n")

    # debug mode (after the scrape, whose counts it would change): the breakdown per request
    stages = _debug_breakdown(http_port, PROMPTS[2])
    assert set(STAGES) <= set(stages)  # a prefix-aware remote request passes every stage
    assert sum(s for n, s in stages.items() if n not in ("ttft", "router_queue")) <= stages["ttft"]
    _generate_with_timings(router.address)


def test_prometheus_evaluates_every_dashboard_query_and_the_rules(cluster, tmp_path):
    """A real Prometheus scrapes the cluster (after the test above): the rules pass promtool and
    every panel's query has a non-empty result."""
    if not prometheus_server.available():
        pytest.skip("prometheus / promtool not on PATH (Debian's `prometheus` package; "
                    "`make prometheus` installs it where apt and root are available)")
    check = subprocess.run(["promtool", "check", "rules", str(RULES_FILE)], capture_output=True, text=True,
                           timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    http_port = _port(cluster["router"], "--http-port")
    jobs = {"router": [f"127.0.0.1:{http_port}"]}
    jobs.update({role: [f"127.0.0.1:{_port(p, '--metrics-port')}"] for role, p in cluster.items() if role != "router"})
    with prometheus_server.PrometheusServer.start(tmp_path, jobs, [RULES_FILE]) as prom:
        started = time.time()
        prom.wait_for_scrapes(2, timeout_s=60.0)
        for i, prompt in enumerate(PROMPTS * 2):  # traffic between scrapes: the rates move
            _complete(http_port, prompt, stream=i % 2 == 0)
        prom.wait_for_scrapes(4, timeout_s=60.0)
        # the rule group runs every second; a histogram's series are born with the first request,
        # so its quantile rules have a result a scrape or two after the counters' (goodput's)
        rules = ("pdserve:goodput:ratio_5m", "pdserve:frontend_ttft_seconds:p99_5m", "pdserve:tpot_seconds:p99_5m")
        deadline = time.monotonic() + 30.0
        while not all(prom.query(rule) for rule in rules) and time.monotonic() < deadline:
            time.sleep(0.5)
        empty = [(path.stem, expr) for path in DASHBOARDS for expr in expressions(json.loads(path.read_text()))
                 if not prom.query(to_promql(expr))]
        assert not empty, empty
        for rule in rules:
            assert prom.query(rule), rule
        if os.environ.get("PDSERVE_WRITE_DASHBOARD_PNGS") == "1":  # docs/dashboards/*.png
            from deploy.grafana.render_pngs import render_all
            deadline = time.monotonic() + 60.0  # a minute more of mixed traffic for the pictures
            for i in range(200):
                if time.monotonic() > deadline:
                    break
                _complete(http_port, PROMPTS[i % len(PROMPTS)] + [i % 50], stream=i % 2 == 0,
                          max_tokens=4 + i % 16)
            time.sleep(3.0)  # the last scrapes and rule evaluations
            render_all(prom.url, started, time.time())


"""KV-aware routing end to end: a real redis-server, 2 prefill + 2 decode workers publishing to
it, and a router started with ``--redis-url --debug-route`` (each reply's trailing metadata
``pdserve-route`` names its path and reason). One cluster for the module.

* Every path gives the offline engine's greedy tokens: remote (nothing cached), remote with a
  delta transfer (the decode worker holds the prefix), and local prefill on the decode worker.
* Requests sharing a long prefix go to the prefill worker that holds it: checked from the
  workers' ``WorkerStats.prefix_cache`` counters, not logs.
* Redis is SIGKILLed in the middle of a bounded load run: no request fails; after it restarts
  (empty) the index is rebuilt and prefix hits come back within 10 s.
"""

from __future__ import annotations

import asyncio
import re
import time

import grpc
import pytest

from engine.sampling_params import SamplingParams
from services.common.pb import generate_pb2, generate_pb2_grpc
from services.common.wire import params_to_proto
from services.router.pipeline.debug_route import ROUTE_HEADER
from tests.integration.cluster_fixtures import oracle_llm, start_router, start_worker, stop_all, wait_serving

pytestmark = pytest.mark.slow

NUM_BLOCKS = 256
GREEDY = SamplingParams(temperature=0.0, max_tokens=3)


def tokens(seed: int, n: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 104729) % 40000 for i in range(n)]


PREFIX = tokens(1, 192)  # 12 blocks


@pytest.fixture(scope="module")
def cluster(module_redis_server, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("routing-logs")
    common = ["--num-kv-blocks", str(NUM_BLOCKS), "--redis-url", module_redis_server.url,
              "--index-heartbeat-s", "0.5"]
    workers = ([start_worker("prefill", log_dir, *common, transfer="grpc") for _ in range(2)]
               + [start_worker("decode", log_dir, *common, transfer="grpc") for _ in range(2)])
    # a lookup past its budget routes by load (index_unavailable): 5 ms is too short on a loaded
    # 2-core test machine, where Redis may wait that long for a core, and these tests are about
    # what the router does with the index's answer
    router = start_router(log_dir, workers[:2], workers[2:], "grpc", "--redis-url",
                          module_redis_server.url, "--debug-route", "--index-budget-ms", "250")
    try:
        wait_serving(workers + [router])
        yield workers, router
    finally:
        stop_all([router])
        stop_all(workers)


@pytest.fixture(scope="module")
def llm(loaded_model):
    yield from oracle_llm(loaded_model, num_kv_blocks=128)


async def generate(channel: grpc.aio.Channel, prompt: list[int],
                   params: SamplingParams = GREEDY) -> tuple[list[int], str, int]:
    """(token ids, route "path/reason", cached prompt tokens) of one Generate call."""
    call = generate_pb2_grpc.GenerateServiceStub(channel).Generate(generate_pb2.GenerateRequest(
        prompt_token_ids=generate_pb2.TokenIds(ids=prompt),
        sampling_params=params_to_proto(params)), timeout=60)
    out: list[int] = []
    cached = 0
    async for chunk in call:
        out += list(chunk.token_ids)
        if chunk.HasField("usage"):
            cached = chunk.usage.cached_prompt_tokens
    route = dict(await call.trailing_metadata() or ()).get(ROUTE_HEADER, "")
    return out, route, cached


def run(router, *prompts: list[int]) -> list[tuple[list[int], str, int]]:
    """The prompts one after another (so each sees what the previous left cached)."""
    async def scenario():
        async with grpc.aio.insecure_channel(router.address) as channel:
            return [await generate(channel, p) for p in prompts]
    return asyncio.run(scenario())


def hits(worker) -> int:
    return worker.stats().prefix_cache.num_cached_prompt_tokens


def test_every_path_matches_offline_greedy(cluster, llm):
    workers, router = cluster
    fresh = tokens(2, 200)
    delta = fresh + tokens(3, 120)   # decode holds 192/320 tokens (< 75 %): remote, delta
    local = fresh + tokens(4, 20)    # 8 + 20 tokens uncached on the decode worker: local
    results = run(router, fresh, delta, local)
    routes = [r[1] for r in results]
    assert routes[0].startswith("remote/") and routes[1].startswith("remote/"), routes
    assert routes[2] == "local/short_uncached", routes
    skipped = sum(w.stats().kv_transfer.num_blocks_skipped_cached for w in workers[2:])
    assert skipped >= 12, "the second request should have reused the decode worker's prefix"
    expected = [c.outputs[0].token_ids for c in llm.generate([fresh, delta, local], GREEDY)]
    assert [r[0] for r in results] == expected
    assert results[2][2] >= 192  # the local request reused the decode worker's cache


def test_a_constraint_is_rebuilt_on_every_path(cluster, llm):
    """Structured outputs on the remote path (prefill worker, then the decode worker's matcher
    catching up) and the local one (the decode worker's Generate): the offline engine's tokens."""
    _, router = cluster
    constrained = SamplingParams(temperature=0.0, max_tokens=10, structured_outputs={"regex": "[0-9]{3}-[0-9]{4}"})
    fresh = tokens(5, 200)
    local = fresh + tokens(6, 20)

    async def scenario():
        async with grpc.aio.insecure_channel(router.address) as channel:
            return [await generate(channel, p, constrained) for p in (fresh, local)]

    results = asyncio.run(scenario())
    assert [r[1].split("/")[0] for r in results] == ["remote", "local"], [r[1] for r in results]
    expected = [c.outputs[0] for c in llm.generate([fresh, local], constrained)]
    assert [r[0] for r in results] == [list(e.token_ids) for e in expected]
    assert all(re.fullmatch("[0-9]{3}-[0-9]{4}", e.text) for e in expected), [e.text for e in expected]


def test_requests_sharing_a_prefix_go_to_the_worker_holding_it(cluster):
    workers, router = cluster
    prefill = workers[:2]
    run(router, PREFIX + tokens(10, 90))  # seed the prefix on one prefill worker
    before = [hits(w) for w in prefill]
    results = run(router, *[PREFIX + tokens(11 + i, 90) for i in range(4)])
    gained = [hits(w) - b for w, b in zip(prefill, before)]
    assert {r[1] for r in results} == {"remote/prefix"}, [r[1] for r in results]
    holder = max(range(2), key=lambda i: gained[i])
    assert gained[holder] >= 4 * 192 and gained[1 - holder] == 0, gained


def test_redis_killed_mid_load_fails_nothing_and_hits_recover(cluster, module_redis_server):
    workers, router = cluster
    old = tokens(20, 192)
    run(router, old + tokens(21, 90))  # an older prefix, out of the router's 2 s memory later

    async def load_run() -> tuple[list[str], list[BaseException]]:
        routes: list[str] = []
        errors: list[BaseException] = []
        async with grpc.aio.insecure_channel(router.address) as channel:
            async def one(i: int) -> None:
                try:
                    routes.append((await generate(channel, PREFIX + tokens(100 + i, 80)))[1])
                except grpc.aio.AioRpcError as exc:
                    errors.append(exc)

            for wave in range(6):  # 6 waves of 3 concurrent requests; Redis dies after wave 2
                if wave == 2:
                    module_redis_server.kill()
                await asyncio.gather(*(one(wave * 3 + j) for j in range(3)))
        return routes, errors

    routes, errors = asyncio.run(load_run())
    assert errors == [], errors
    assert len(routes) == 18 and any(r.endswith("index_unavailable") for r in routes), routes
    module_redis_server.restart()
    restarted = time.monotonic()
    time.sleep(2.5)  # let the router's memory of `old` lapse; workers re-register meanwhile
    recovered = None
    while time.monotonic() - restarted < 10.0:
        _, route, cached = run(router, old + tokens(22, 90))[0]
        if route == "remote/prefix" and cached >= 192:
            recovered = time.monotonic() - restarted
            break
        time.sleep(0.5)
    assert recovered is not None, "prefix hits did not come back within 10 s of Redis restarting"

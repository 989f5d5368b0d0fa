"""IndexClient against a real redis-server: lookups, reservations seen by another router, the
meta check, and the breaker (Redis killed -> match answers None at once; back after restart)."""

from __future__ import annotations

import time

import pytest
import redis

from engine.kv_cache.hashing import hash_request_blocks
from services.index.breaker import BreakerConfig, BreakerState
from services.index.client import IndexClient, IndexClientConfig
from services.index.schema import IndexMeta, IndexMetaMismatch, WorkerInfo
from services.index.scripts import IndexScripts

META = IndexMeta("smollm2", "0123456789abcdef" * 4, 4)
CONFIG = IndexClientConfig(budget_s=0.02, breaker=BreakerConfig(3, 0.2, 1.0))
TOKENS = list(range(100, 120))


@pytest.fixture
def worker(redis_server) -> IndexScripts:
    """Worker p0 holding the first 3 of the 5 blocks of TOKENS on DEVICE."""
    scripts = IndexScripts(redis.Redis.from_url(redis_server.url), META)
    scripts.register(WorkerInfo("p0", "prefill"), "e1", 60_000)
    hashes = hash_request_blocks(TOKENS, META.block_size)
    scripts.apply("p0", "e1", 1, [("S", h.hex(), 1) for h in hashes[:3]])
    return scripts


def test_match_names_the_worker_and_its_prefix(redis_server, worker):
    client = IndexClient(redis_server.url, META, CONFIG)
    found = client.match(hash_request_blocks(TOKENS, META.block_size))
    assert found is not None and found["p0"].num_device_blocks == 3
    assert client.is_available and client.fallbacks == {}
    client.close()


def test_reservations_are_seen_by_another_router(redis_server, worker):
    router_a = IndexClient(redis_server.url, META, CONFIG)
    router_b = IndexClient(redis_server.url, META, CONFIG)
    assert router_a.reserve("p0", "req-1") == 1
    assert router_b.match([])["p0"].num_reserved == 1
    assert router_a.release("p0", "req-1") is True
    assert router_b.match([])["p0"].num_reserved == 0


def test_meta_mismatch_is_refused_loudly(redis_server, worker):
    client = IndexClient(redis_server.url, IndexMeta("smollm2", META.compat_hash, 8), CONFIG)
    with pytest.raises(IndexMetaMismatch, match="block_size"):
        client.check_meta()
    assert client.match(hash_request_blocks(TOKENS, 8)) is None
    assert client.fallbacks == {"meta_mismatch": 1} and not client.is_available


def test_breaker_opens_when_redis_dies_and_recovers_after_restart(redis_server, worker):
    client = IndexClient(redis_server.url, META, CONFIG)
    hashes = hash_request_blocks(TOKENS, META.block_size)
    assert client.match(hashes) is not None
    redis_server.kill()
    for _ in range(3):
        assert client.match(hashes) is None
    assert client.breaker.state is BreakerState.OPEN
    start = time.perf_counter()
    for _ in range(100):
        assert client.match(hashes) is None
    assert (time.perf_counter() - start) / 100 < 0.001  # open: no network at all
    assert client.fallbacks["breaker_open"] == 100
    redis_server.restart()  # empty: the worker has not re-registered yet
    time.sleep(CONFIG.breaker.base_backoff_s * 2 + 0.05)  # past the (doubled at most once) backoff
    found = None
    for _ in range(50):
        found = client.match(hashes)
        if found is not None:
            break
        time.sleep(0.05)
    assert found == {} and client.breaker.state is BreakerState.CLOSED


def test_slow_redis_costs_at_most_the_budget(redis_server, worker):
    client = IndexClient(redis_server.url, META, CONFIG)
    hashes = hash_request_blocks(TOKENS, META.block_size)
    assert client.match(hashes) is not None
    blocker = redis.Redis.from_url(redis_server.url)
    blocker.execute_command("CLIENT", "PAUSE", 500, "ALL")  # the server stops answering clients
    start = time.perf_counter()
    assert client.match(hashes) is None
    assert time.perf_counter() - start < 10 * CONFIG.budget_s
    assert client.fallbacks == {"timeout": 1}

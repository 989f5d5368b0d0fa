"""PrefixAwarePolicy against a real redis-server: the plan follows the index, a burst on a new
prefix sticks through the router-local memory, reservations reach other routers, Redis dying
means load-only plans at once, and an index with other hash settings is refused at startup."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from engine.kv_cache.hashing import hash_request_blocks
from engine.kv_transfer.base import KVCompat
from engine.sampling_params import SamplingParams
from services.index.breaker import BreakerConfig
from services.index.client import IndexClient, IndexClientConfig
from services.index.schema import IndexMeta, IndexMetaMismatch, WorkerInfo
from services.index.scripts import IndexScripts
from services.router.routing.prefix_aware import PrefixAwarePolicy
from services.router.routing.route_plan import RouteConfig
from services.router.routing.worker_load import WorkerLoad

BS = 4
COMPAT = KVCompat("tiny", "float32", BS, 2, 1, 8)
META = IndexMeta(COMPAT.model_name, COMPAT.hash, BS)
CLIENT = IndexClientConfig(budget_s=0.05, breaker=BreakerConfig(2, 0.5, 1.0))
PROMPT = list(range(100, 140))  # 10 blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def load(name: str) -> WorkerLoad:
    return WorkerLoad(address=f"127.0.0.1:{name}", num_free_blocks=100, num_total_blocks=100,
                      block_size=BS, worker_id=name)


PREFILL, DECODE = [load("p0"), load("p1")], [load("d0"), load("d1")]


@pytest.fixture
def index(redis_server) -> IndexScripts:
    """p1 holds the first 9 blocks of PROMPT on DEVICE; d0 and p0 are registered, empty."""
    scripts = IndexScripts(redis.Redis.from_url(redis_server.url), META)
    for wid, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
        scripts.register(WorkerInfo(wid, role), "e1", 60_000)
    hashes = hash_request_blocks(PROMPT, BS)
    scripts.apply("p1", "e1", 1, [("S", h.hex(), 1) for h in hashes[:9]])
    return scripts


def policy_for(url: str, **config: int) -> PrefixAwarePolicy:
    policy = PrefixAwarePolicy(url, RouteConfig(local_prefill_max_tokens=config.get("local", 8)),
                               CLIENT)
    policy.configure(COMPAT)
    return policy


def test_the_plan_follows_the_index_and_reservations_reach_other_routers(redis_server, index):
    policy = policy_for(redis_server.url)
    other = IndexClient(redis_server.url, META, CLIENT)
    try:
        plan = asyncio.run(policy.plan("r1", PROMPT, GREEDY, lambda: (PREFILL, DECODE)))
        assert (plan.path, plan.reason, plan.prefill_address) == ("remote", "prefix", "127.0.0.1:p1")
        deadline = time.monotonic() + 2.0
        while other.match([])["p1"].num_reserved != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert other.match([])["p1"].num_reserved == 1
        policy.finish("r1")
        while other.match([])["p1"].num_reserved != 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert other.match([])["p1"].num_reserved == 0
        assert policy.decisions.snapshot() == {"remote/prefix": 1}
    finally:
        policy.close()
        other.close()


def test_a_salted_prompt_does_not_match_the_unsalted_prefix(redis_server, index):
    policy = policy_for(redis_server.url)
    try:
        salted = GREEDY.replace(cache_salt="tenant-a")
        plan = asyncio.run(policy.plan("r1", PROMPT, salted, lambda: (PREFILL, DECODE)))
        assert (plan.reason, plan.prefill_address) == ("load", "127.0.0.1:p0")
    finally:
        policy.close()


def test_a_burst_on_a_new_prefix_sticks_before_events_arrive(redis_server, index):
    policy = policy_for(redis_server.url, local=0)
    fresh = list(range(500, 540))
    try:
        first = asyncio.run(policy.plan("a", fresh, GREEDY, lambda: (PREFILL, DECODE)))
        # p0 now looks busier by load, but the router remembers where the prefix went
        busier = [WorkerLoad(**{**vars_of(PREFILL[0]), "num_outstanding_prefill_tokens": 8}), PREFILL[1]]
        second = asyncio.run(policy.plan("b", fresh, GREEDY, lambda: (busier, DECODE)))
        assert first.prefill_address == second.prefill_address == "127.0.0.1:p0"
        assert second.reason == "prefix"
        # ... and the decode worker that got it is picked again (it will hold the prefix), but
        # the suffix is not prefilled there until the index confirms the blocks landed: they
        # may still be computing or in transfer (route_plan's module docstring)
        policy.config = RouteConfig(local_prefill_max_tokens=8)
        third = asyncio.run(policy.plan("c", fresh, GREEDY, lambda: (PREFILL, DECODE)))
        assert (third.path, third.decode_address, third.prefill_address) == (
            "remote", first.decode_address, "127.0.0.1:p0")
        assert third.num_decode_cached_tokens == len(fresh)  # predicted there: not sent again
    finally:
        policy.close()


def vars_of(w: WorkerLoad) -> dict[str, object]:
    return {name: getattr(w, name) for name in WorkerLoad.__slots__}


def test_redis_down_gives_load_only_plans_at_once(redis_server, index):
    policy = policy_for(redis_server.url, local=0)
    try:
        redis_server.kill()
        started = time.perf_counter()
        plans = [asyncio.run(policy.plan(f"r{i}", PROMPT, GREEDY, lambda: (PREFILL, DECODE))) for i in range(5)]
        elapsed = time.perf_counter() - started
        assert {p.reason for p in plans} == {"index_unavailable"}
        assert elapsed < 1.0, f"5 plans took {elapsed:.3f} s with Redis down"
    finally:
        policy.close()


def test_an_index_with_other_hash_settings_is_refused_at_startup(redis_server, index):
    other = KVCompat("tiny", "float32", BS, 2, 1, 8)
    policy = PrefixAwarePolicy(redis_server.url, client_config=CLIENT)
    scripts = IndexScripts(redis.Redis.from_url(redis_server.url), META)
    scripts.client.hset(f"{META.scope}meta", "hash_seed", "another-seed")
    with pytest.raises(IndexMetaMismatch, match="hash_seed"):
        policy.configure(other)
    policy.close()


def test_a_release_still_in_flight_is_never_another_routers_request(redis_server, index):
    """finish() releases in the background; until Redis has the release, the reservation it
    still lists is counted as this router's own, not as one more request of another router."""
    import threading

    policy = policy_for(redis_server.url)
    gate = threading.Event()
    try:
        asyncio.run(policy.plan("r1", PROMPT, GREEDY, lambda: (PREFILL, DECODE)))  # reserves p1 and a decode worker
        deadline = time.monotonic() + 2.0
        while policy.index.match([])["p1"].num_reserved != 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # the reservation is written in the background too
        policy._reservations._executor.submit(gate.wait, 5.0)  # the reservation thread busy: the release queues
        policy.finish("r1")
        matches = policy.index.match([])
        assert matches["p1"].num_reserved == 1  # still in Redis ...
        assert policy._others(matches, "p1") == 0  # ... and still ours
        gate.set()
        deadline = time.monotonic() + 2.0
        while policy.index.match([])["p1"].num_reserved and time.monotonic() < deadline:
            time.sleep(0.01)
        matches = policy.index.match([])
        assert matches["p1"].num_reserved == 0 and policy._others(matches, "p1") == 0
    finally:
        gate.set()
        policy.close()


def test_a_burst_of_plans_sees_what_the_plans_before_it_began(redis_server, index):
    """Plans waiting on their index lookups together decide one after another once the answers
    are in: each reads the loads then, so a burst of short prompts onto
    idle decode workers spreads over them (it all went to the first while the loads were read
    before the lookup: the Ray Serve test's second decode replica once got none of 8)."""
    import threading

    policy = policy_for(redis_server.url)
    running = {"d0": 0, "d1": 0}  # what the backend begins right after each plan

    def current_loads():
        return PREFILL, [WorkerLoad(address=f"127.0.0.1:{w}", num_free_blocks=100, num_total_blocks=100,
                                    block_size=BS, num_running=running[w], worker_id=w) for w in running]

    gate = threading.Event()
    try:
        async def one(i: int):
            plan = await policy.plan(f"r{i}", [1, 2, 3], GREEDY, current_loads)
            running[plan.decode_address.rsplit(":", 1)[1]] += 1  # begun: no wait after the plan
            return plan

        async def burst() -> list:
            policy._lookups._executor.submit(gate.wait, 5.0)  # the lookups queue behind one
            plans = [asyncio.ensure_future(one(i)) for i in range(4)]
            await asyncio.sleep(0.05)
            gate.set()
            return await asyncio.gather(*plans)

        plans = asyncio.run(burst())
        assert {p.path for p in plans} == {"local"} and running == {"d0": 2, "d1": 2}
    finally:
        gate.set()
        for i in range(4):
            policy.finish(f"r{i}")
        policy.close()


def test_a_burst_of_plans_shares_its_index_round_trips(redis_server, index):
    """Lookups that queue behind one in flight go to Redis together (services/index/batches.py):
    40 plans arriving while the lookup thread is busy take 2 round trips (32 + 8), each answered."""
    import threading

    from services.router.routing.prefix_aware import INDEX_BATCH

    policy = policy_for(redis_server.url)
    gate = threading.Event()
    try:
        async def burst() -> list:
            policy._lookups._executor.submit(gate.wait, 5.0)  # a round trip in flight, say
            plans = [asyncio.ensure_future(policy.plan(f"r{i}", PROMPT, GREEDY, lambda: (PREFILL, DECODE)))
                     for i in range(40)]
            await asyncio.sleep(0.05)
            gate.set()
            return await asyncio.gather(*plans)

        plans = asyncio.run(burst())
        assert all(p is not None and p.reason != "index_unavailable" for p in plans)
        assert plans[0].prefill_address == "127.0.0.1:p1"  # p1 holds the prompt (9 blocks)
        assert INDEX_BATCH == 32 and (policy._lookups.batches, policy._lookups.items) == (2, 40)
        for i in range(40):
            policy.finish(f"r{i}")
        workers = ("p0", "p1", "d0")

        def reserved() -> dict[str, int]:
            found = policy.index.match([])
            return {w: found[w].num_reserved for w in workers}

        deadline = time.monotonic() + 5.0
        while (any(reserved().values()) or any(policy._own.values())) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reserved() == dict.fromkeys(workers, 0)
        # 2 reservations per plan and 2 releases: all sent, none still counted as this router's
        assert policy._reservations.items == 160 and set(policy._own.values()) == {0}
    finally:
        gate.set()
        policy.close()

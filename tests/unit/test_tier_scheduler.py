"""The host tier under the scheduler (engine/kv_cache/tiers/host_tier.py), over a KV tensor of token
ids (tests/unit/_tier_fakes.py): offload on device eviction with exact events in order, reload
of the host continuation of a prefix hit, the cost gate, a failed load recomputed from the last
good block, and the stats of both tiers."""

from __future__ import annotations

import pytest

from engine.kv_cache.events import BlockRemoved, BlockStored, Tier
from engine.kv_cache.hashing import hash_request_blocks
from tests.unit._scheduler_fakes import check_scheduler, make_request
from tests.unit._tier_fakes import TierRunner, make_tier_scheduler

BS = 4
PROMPT_A = list(range(1, 14))  # 13 tokens: 3 full blocks, the last token always recomputed
PROMPT_B = list(range(101, 114))
HA = hash_request_blocks(PROMPT_A, BS)
HB = hash_request_blocks(PROMPT_B, BS)


@pytest.fixture
def setup():
    scheduler, tier = make_tier_scheduler(num_blocks=4, num_host_blocks=8, block_size=BS)
    runner = TierRunner(scheduler, tier)
    yield scheduler, tier, runner
    check_scheduler(scheduler)
    tier.check_integrity()


def events(scheduler):
    return scheduler.kv_manager.take_events()


def test_eviction_offloads_stored_host_before_removed_device_then_a_hit_reloads(setup):
    scheduler, tier, runner = setup
    cold = runner.run(make_request("a1", PROMPT_A, max_tokens=2))
    assert cold == ([100, 101], 0)
    assert events(scheduler) == [BlockStored(HA[:3], None, PROMPT_A[:12], BS, Tier.DEVICE)]

    # B needs all 4 blocks: A's cached ones are evicted (the queue frees a table tail first).
    assert runner.run(make_request("b", PROMPT_B, max_tokens=2))[1] == 0
    # Evicted tail first, stored below parents first (one chain event, consecutive slots) and
    # aged tail first on the host too.
    assert events(scheduler) == [BlockStored(HA[:3], None, PROMPT_A[:12], BS, Tier.HOST),
                                 BlockRemoved([HA[2], HA[1], HA[0]], Tier.DEVICE),
                                 BlockStored(HB[:3], None, PROMPT_B[:12], BS, Tier.DEVICE)]
    assert [tier.host_pool.get(h).slot for h in HA[:3]] == [0, 1, 2]
    assert tier.host_pool.cached_block_hashes() == [HA[2], HA[1], HA[0]]  # LRU first

    # A again: nothing on device, all 3 blocks from the host; the runner reads them back.
    assert runner.run(make_request("a2", PROMPT_A, max_tokens=2)) == ([100, 101], 12)
    evs = events(scheduler)
    assert evs[-1] == BlockStored(HA[:3], None, PROMPT_A[:12], BS, Tier.DEVICE)  # reloaded: cached again
    assert BlockRemoved(HB[2::-1], Tier.DEVICE) in evs and not any(
        isinstance(e, BlockRemoved) and e.tier == Tier.HOST for e in evs)  # inclusive: host keeps A
    assert set(tier.host_pool.cached_block_hashes()) == set(HA[:3] + HB[:3])
    assert (tier.counters.num_hit_blocks, tier.counters.num_loaded_bytes) == (3, 3 * BS * 8)
    assert scheduler.device_counters.num_hit_blocks == 0


def test_order_is_stored_on_host_before_removed_from_device(setup):
    scheduler, _, runner = setup
    for i, prompt in enumerate([PROMPT_A, PROMPT_B, PROMPT_A, PROMPT_B]):
        runner.run(make_request(f"r{i}", prompt, max_tokens=2))
    seen_on_host = set()
    for event in events(scheduler):
        if isinstance(event, BlockStored) and event.tier == Tier.HOST:
            seen_on_host.update(event.block_hashes)
        if isinstance(event, BlockRemoved) and event.tier == Tier.DEVICE:
            assert set(event.block_hashes) <= seen_on_host


def test_device_hit_then_host_continuation(setup):
    scheduler, tier, runner = setup
    runner.run(make_request("a1", PROMPT_A, max_tokens=1))
    runner.run(make_request("b", PROMPT_B, max_tokens=1))  # evicts A to the host
    # A's first block comes back to the device (from the host), then all of A: 1 device + 2 host.
    assert runner.run(make_request("a-head", PROMPT_A[:5], max_tokens=1)) == ([100], 4)
    assert runner.run(make_request("a2", PROMPT_A, max_tokens=2)) == ([100, 101], 12)
    assert (scheduler.device_counters.num_hit_blocks, tier.counters.num_hit_blocks) == (1, 1 + 2)
    assert (scheduler.device_counters.num_queried_blocks, tier.counters.num_queried_blocks) == (
        3 + 3 + 1 + 3, 3 + 3 + 1 + 2)


def test_cost_gate_recomputes_when_loading_is_slower(setup):
    _scheduler, tier, runner = setup
    runner.run(make_request("a1", PROMPT_A, max_tokens=1))
    runner.run(make_request("b", PROMPT_B, max_tokens=1))
    tier.cost.load_us_per_block = 10 * tier.cost.recompute_us_per_block
    assert runner.run(make_request("a2", PROMPT_A, max_tokens=2)) == ([100, 101], 0)
    assert tier.counters.num_hit_blocks == 0 and tier.counters.num_queried_blocks >= 3


def test_failed_load_recomputes_from_the_last_good_block(setup):
    scheduler, tier, runner = setup
    runner.run(make_request("a1", PROMPT_A, max_tokens=1))
    runner.run(make_request("b", PROMPT_B, max_tokens=1))
    events(scheduler)
    tier.failing_slots = {tier.host_pool.get(HA[1]).slot}
    assert runner.run(make_request("a2", PROMPT_A, max_tokens=2)) == ([100, 101], 4)
    assert tier.counters.num_load_failures == 1
    assert tier.host_pool.get(HA[1]) is None  # the bad copy is dropped...
    assert BlockRemoved([HA[1]], Tier.HOST) in events(scheduler)
    tier.failing_slots = set()
    runner.run(make_request("b2", PROMPT_B, max_tokens=1))
    assert runner.run(make_request("a3", PROMPT_A, max_tokens=2))[0] == [100, 101]  # ...and recomputed


def test_admission_that_does_not_fit_releases_the_host_pins(setup):
    scheduler, tier, runner = setup
    runner.run(make_request("a1", PROMPT_A, max_tokens=1))
    runner.run(make_request("b", PROMPT_B, max_tokens=1))
    scheduler.add_request(make_request("long", list(range(200, 215)), max_tokens=1))  # 4 blocks
    scheduler.add_request(make_request("a2", PROMPT_A, max_tokens=1))
    runner.step()  # "long" takes every block; a2 is matched on the host but cannot be admitted
    tier.host_pool.check_integrity(at_rest=True)
    assert [r.request_id for r in scheduler.waiting] == ["a2"]
    for _ in range(20):
        if not scheduler.has_unfinished_requests():
            break
        runner.step()
    assert not scheduler.has_unfinished_requests()


def test_a_reservation_reuses_the_host_tier_too(setup):
    """DECODE: a prompt whose prefix was pushed down to the host is reloaded into the reserved
    table; the peer sends only the blocks after it (delta transfer counts the host too)."""
    scheduler, tier, runner = setup
    runner.run(make_request("a1", PROMPT_A, max_tokens=1))
    runner.run(make_request("b", PROMPT_B, max_tokens=1))
    request = make_request("remote", PROMPT_A, max_tokens=2)
    block_ids = scheduler.reserve_remote(request)
    tier.flush()
    assert request.num_cached_tokens == 12 and len(block_ids) == 4
    assert [tier.device_cache[b].tolist() for b in block_ids[:3]] == [
        [float(t) for t in PROMPT_A[i:i + BS]] for i in range(0, 12, BS)]
    assert tier.counters.num_hit_blocks == 3
    for pos in range(12, 13):  # the prefill worker writes the rest
        tier.device_cache[block_ids[pos // BS], pos % BS] = PROMPT_A[pos]
    scheduler.finish_remote_kv("remote", 100)
    for _ in range(10):
        if not scheduler.has_unfinished_requests():
            break
        runner.step()
    assert not scheduler.has_unfinished_requests()


def test_host_lru_evicts_a_chain_tail_before_its_prefix():
    scheduler, tier = make_tier_scheduler(num_blocks=4, num_host_blocks=4, block_size=BS)
    runner = TierRunner(scheduler, tier)
    runner.run(make_request("a1", PROMPT_A, max_tokens=1))
    runner.run(make_request("b", PROMPT_B, max_tokens=1))  # A's 3 blocks go to the host
    runner.run(make_request("c", list(range(301, 314)), max_tokens=1))  # B's 3 come down: 2 must go
    assert set(tier.host_pool.cached_block_hashes()) == {HA[0], *HB[:3]}  # A's tail went, its prefix stayed
    assert runner.run(make_request("a2", PROMPT_A[:5], max_tokens=1)) == ([100], 4)


def test_a_failed_offload_drops_those_blocks_and_nothing_else(setup):
    scheduler, tier, runner = setup
    runner.run(make_request("a1", PROMPT_A, max_tokens=1))
    events(scheduler)
    tier.is_offload_failing = True
    runner.run(make_request("b", PROMPT_B, max_tokens=1))
    tier.is_offload_failing = False
    # The bytes never reached the host: nothing is announced there, the device copy just goes.
    assert events(scheduler)[:2] == [BlockRemoved([HA[2], HA[1], HA[0]], Tier.DEVICE),
                                     BlockStored(HB[:3], None, PROMPT_B[:12], BS, Tier.DEVICE)]
    assert tier.host_pool.num_cached_blocks == 0
    assert runner.run(make_request("a2", PROMPT_A, max_tokens=2)) == ([100, 101], 0)  # recomputed

"""The lower tier below the host (engine/kv_cache/tiers/lower_stage.py) under the scheduler, over a KV
tensor of token ids (tests/unit/_tier_fakes.py): a prefix evicted from device and host comes back
from the lower tier through host slots, a short load recomputes from the last good block, a lost
lower tier is a plain miss, the cost gate, and the KVSTORE counters kept apart from the host's."""

from __future__ import annotations

import pytest

from engine.kv_cache.events import BlockRemoved, BlockStored, Tier
from engine.kv_cache.hashing import hash_request_blocks
from tests.unit._scheduler_fakes import check_scheduler, make_request
from tests.unit._tier_fakes import MemoryLowerTier, TierRunner, make_tier_scheduler

BS = 4
PROMPT_A = list(range(1, 14))  # 13 tokens: 3 full blocks, the last token always recomputed
PROMPT_B = list(range(101, 114))
PROMPT_C = list(range(201, 214))
HA = hash_request_blocks(PROMPT_A, BS)
BLOCK_BYTES = BS * 8  # float64 token ids


@pytest.fixture
def setup():
    lower = MemoryLowerTier(capacity=16)
    # Host holds 3 blocks: B then C push A out of device and then out of host, into the lower tier.
    scheduler, tier = make_tier_scheduler(num_blocks=4, num_host_blocks=3, block_size=BS, lower=lower)
    runner = TierRunner(scheduler, tier)
    for i, prompt in enumerate([PROMPT_A, PROMPT_B, PROMPT_C]):
        assert runner.run(make_request(f"w{i}", prompt, max_tokens=2)) == ([100, 101], 0)
    assert set(HA[:3]) <= set(lower.blocks) and not set(HA[:3]) & set(tier.host_pool.cached_block_hashes())
    scheduler.kv_manager.take_events()
    assert tier.lower is not None and tier.lower.counters.num_queried_blocks == 9  # 3 cold misses
    tier.lower.counters.num_queried_blocks = 0
    yield scheduler, tier, runner, lower
    check_scheduler(scheduler)
    tier.check_integrity()


def test_a_prefix_gone_from_device_and_host_comes_back_from_the_lower_tier(setup):
    scheduler, tier, runner, lower = setup
    assert runner.run(make_request("a2", PROMPT_A, max_tokens=2)) == ([100, 101], 12)
    events = scheduler.kv_manager.take_events()
    staged = [e for e in events if isinstance(e, BlockStored) and e.tier == Tier.HOST]
    assert [h for e in staged for h in e.block_hashes] == HA[:3]  # staged parents first
    # Announced once the bytes are there, all at once: one chain event, or several in order.
    assert staged[0].parent_block_hash is None and staged[0].token_ids[:BS] == PROMPT_A[:BS]
    assert events[-1] == BlockStored(HA[:3], None, PROMPT_A[:12], BS, Tier.DEVICE)
    stager = tier.lower
    assert stager is not None
    assert (stager.counters.num_hit_blocks, stager.counters.num_loaded_bytes) == (3, 3 * BLOCK_BYTES)
    assert stager.counters.num_queried_blocks == 3 and stager.counters.num_load_failures == 0
    assert tier.counters.num_hit_blocks == 0  # the host had none of them before
    assert stager.counters.num_offloaded_bytes == stager.num_offered_blocks * BLOCK_BYTES > 0


def test_a_short_load_recomputes_from_the_last_good_block(setup):
    scheduler, tier, runner, lower = setup
    lower.max_load = 1
    assert runner.run(make_request("a2", PROMPT_A, max_tokens=2)) == ([100, 101], 4)
    events = scheduler.kv_manager.take_events()
    stored = {h for e in events if isinstance(e, BlockStored) and e.tier == Tier.HOST for h in e.block_hashes}
    removed = {h for e in events if isinstance(e, BlockRemoved) and e.tier == Tier.HOST for h in e.block_hashes}
    # The slots reserved for what did not load are dropped, never having been announced.
    assert HA[0] in stored and not {HA[1], HA[2]} & (stored | removed)
    assert tier.host_pool.get(HA[1]) is None and tier.host_pool.get(HA[2]) is None
    assert tier.lower is not None and tier.lower.counters.num_load_failures == 1


def test_a_lost_lower_tier_is_a_miss_and_the_output_is_unchanged(setup):
    _, tier, runner, lower = setup
    lower.lose()
    assert runner.run(make_request("a2", PROMPT_A, max_tokens=2)) == ([100, 101], 0)
    assert tier.lower is not None and tier.lower.counters.num_hit_blocks == 0
    assert tier.lower.counters.num_queried_blocks == 3


def test_the_cost_gate_recomputes_when_the_lower_tier_is_measured_slow(setup):
    _, tier, runner, _ = setup
    assert tier.lower is not None
    tier.lower.cost.load_us_per_block = tier.lower.cost.recompute_us_per_block * 10
    assert runner.run(make_request("a2", PROMPT_A, max_tokens=2)) == ([100, 101], 0)
    assert tier.lower.counters.num_hit_blocks == 0

"""The host tier in the real engine (SmolLM2-135M, fp32, CPU) with a KV pool of 4 blocks, so a
second prompt evicts the first: greedy output token for token equal to the cold run when the
prefix comes from the device tier, from the host tier after eviction, and after a failed load
(recomputed); exact events in order; stats per tier; holdings; reset of both tiers; the cost
gate; cache_salt isolation; and the tier switched off. Two engines, shared by the tests (each
test starts from ``reset_prefix_cache``), so the module runs in well under 30 s."""

from __future__ import annotations

import dataclasses

import pytest

from engine.args import EngineArgs
from engine.config import Role
from engine.core import EngineCore
from engine.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, Tier
from engine.kv_cache.hashing import hash_request_blocks
from engine.kv_cache.tiers.host_tier import HostTier
from engine.kv_cache.tiers.protocol import NoHostTier
from engine.sampling_params import SamplingParams
from engine.stats import TierStats
from tests.engine_runs import run_alone
from tests.unit._tier_fakes import MemoryLowerTier

pytestmark = pytest.mark.slow

BS = 8
BLOCK_BYTES = 30 * 2 * BS * 3 * 64 * 4  # SmolLM2: layers x K,V x tokens x kv heads x head_dim x fp32
PROMPT_A = [(7 * i + 3) % 4000 + 100 for i in range(28)]  # 3 full blocks + 4 tokens
PROMPT_B = [(11 * i + 5) % 4000 + 200 for i in range(28)]
HA = hash_request_blocks(PROMPT_A, BS)
HB = hash_request_blocks(PROMPT_B, BS)
GREEDY = SamplingParams(temperature=0.0, max_tokens=3)
HIT = 3 * BS  # tokens of A's (or B's) 3 full blocks


def make_core(loaded_model, num_host_blocks: int, lower_tier: MemoryLowerTier | None = None) -> EngineCore:
    engine_args = EngineArgs(block_size=BS, num_kv_blocks=4, max_num_batched_tokens=64,
                             cpu_offload_gb=num_host_blocks * BLOCK_BYTES / 2**30)
    config = engine_args.build(loaded_model.config, Role.COLOCATED)
    config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, enable_kv_events=True))
    return EngineCore(config, loaded_model, lower_tier=lower_tier)


_ids = iter(range(10**6))


def run(core: EngineCore, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], int]:
    """(output tokens, prompt tokens served from cache) of one request run alone; checks idle after."""
    result = run_alone(core, f"t{next(_ids)}", prompt, params)
    assert core.block_pool.num_free_blocks == core.block_pool.num_blocks
    return result


def fresh(core: EngineCore) -> EngineCore:
    core.reset_prefix_cache()
    core.take_kv_events()
    return core


@pytest.fixture(scope="module")
def tiered(loaded_model) -> EngineCore:
    core = make_core(loaded_model, num_host_blocks=16)
    assert isinstance(core.host_tier, HostTier) and core.host_tier.host_pool.num_blocks == 16
    return core


@pytest.fixture(scope="module")
def untiered(loaded_model) -> EngineCore:
    core = make_core(loaded_model, num_host_blocks=0)
    assert isinstance(core.host_tier, NoHostTier) and len(core.stats().tiers) == 1
    return core


@pytest.fixture(scope="module")
def cold(untiered) -> dict[str, list[int]]:
    """Each prompt's greedy tokens computed from scratch."""
    fresh(untiered)
    (a, num_a), (b, num_b) = run(untiered, PROMPT_A), run(untiered, PROMPT_B)
    assert num_a == num_b == 0
    return {"a": a, "b": b}


def test_device_hit_host_hit_and_failed_load_all_equal_the_cold_output(tiered, cold):
    core = fresh(tiered)
    assert run(core, PROMPT_A) == (cold["a"], 0)
    assert run(core, PROMPT_A) == (cold["a"], HIT)  # device tier
    assert run(core, PROMPT_B) == (cold["b"], 0)  # evicts A's blocks to the host
    assert run(core, PROMPT_A) == (cold["a"], HIT)  # host tier, after eviction
    assert run(core, PROMPT_B) == (cold["b"], HIT)  # host tier again (A evicted B)

    # A load that fails on A's second block: the first loads, the rest is recomputed.
    host_tier = core.host_tier
    bad_slot = host_tier.host_pool.get(HA[1]).slot
    copy = host_tier.copy_to_device

    def failing_copy(block_ids, slots):  # fault injection on the real tier's copy
        if bad_slot in slots:
            raise RuntimeError("injected DMA failure")
        copy(block_ids, slots)

    host_tier.copy_to_device = failing_copy
    try:
        assert run(core, PROMPT_A) == (cold["a"], BS)
    finally:
        del host_tier.copy_to_device
    assert host_tier.host_pool.get(HA[1]) is None  # dropped from the host as bad
    assert core.stats().tiers[1].num_load_failures >= 1
    assert run(core, PROMPT_B) == (cold["b"], HIT)  # evicts A again: its recomputed block 1 goes down
    assert run(core, PROMPT_A) == (cold["a"], HIT)


def test_events_in_order_stats_holdings_and_reset(tiered, cold):
    core = fresh(tiered)
    before = core.stats().tiers
    run(core, PROMPT_A)
    assert core.take_kv_events() == [BlockStored(HA[:3], None, PROMPT_A[:HIT], BS, Tier.DEVICE)]
    run(core, PROMPT_B)
    # The pool evicts A's chain tail first; it is stored below parents first, as one event.
    assert core.take_kv_events() == [
        BlockStored(HA[:3], None, PROMPT_A[:HIT], BS, Tier.HOST),
        BlockRemoved([HA[2], HA[1], HA[0]], Tier.DEVICE),
        BlockStored(HB[:3], None, PROMPT_B[:HIT], BS, Tier.DEVICE)]
    assert sorted(core.cached_block_hashes()) == sorted([(h, Tier.DEVICE) for h in HB[:3]]
                                                        + [(h, Tier.HOST) for h in HA[:3]])
    run(core, PROMPT_A)
    events = core.take_kv_events()
    assert events[-1] == BlockStored(HA[:3], None, PROMPT_A[:HIT], BS, Tier.DEVICE)  # reloaded
    assert not any(isinstance(e, BlockRemoved) and e.tier == Tier.HOST for e in events)  # inclusive
    assert sorted(core.cached_block_hashes()) == sorted([(h, Tier.DEVICE) for h in HA[:3]]
                                                        + [(h, Tier.HOST) for h in HA[:3] + HB[:3]])

    device, host = (_minus(after, b) for after, b in zip(core.stats().tiers, before))
    assert (device.tier, device.num_blocks, device.num_cached_blocks) == (Tier.DEVICE, 4, 3)
    assert (device.num_queried_blocks, device.num_hit_blocks, device.num_miss_blocks) == (9, 0, 9)
    assert (device.num_stored_blocks, device.num_evicted_blocks) == (9, 6)
    assert (host.tier, host.num_blocks, host.num_cached_blocks) == (Tier.HOST, 16, 6)
    assert (host.num_stored_blocks, host.num_evicted_blocks) == (6, 0)
    assert (host.num_queried_blocks, host.num_hit_blocks, host.num_hit_tokens) == (9, 3, HIT)
    assert (host.num_loaded_bytes, host.num_offloaded_bytes) == (3 * BLOCK_BYTES, 6 * BLOCK_BYTES)

    core.reset_prefix_cache()
    assert core.take_kv_events() == [AllBlocksCleared(None)]
    assert core.cached_block_hashes() == []
    assert run(core, PROMPT_A) == (cold["a"], 0)


def _minus(after: TierStats, before: TierStats) -> TierStats:
    """Counters of ``after`` since ``before`` (gauges: tier, capacity, cached blocks, as in ``after``)."""
    keep = {"tier", "num_blocks", "num_cached_blocks"}
    return dataclasses.replace(after, **{f.name: getattr(after, f.name) - getattr(before, f.name)
                                         for f in dataclasses.fields(after) if f.name not in keep})


def test_cost_gate_recomputes_when_a_load_is_estimated_slower(tiered, cold):
    core = fresh(tiered)
    run(core, PROMPT_A)
    run(core, PROMPT_B)
    cost = core.host_tier.cost
    assert cost.prefill_tok_s != 300.0  # the engine measured its prefill rate
    saved = cost.load_us_per_block
    cost.load_us_per_block = 2 * cost.recompute_us_per_block
    try:
        assert run(core, PROMPT_A) == (cold["a"], 0)
    finally:
        cost.load_us_per_block = saved


def test_tier_off_behaves_as_before(untiered, cold):
    core = fresh(untiered)
    assert run(core, PROMPT_A) == (cold["a"], 0)
    assert run(core, PROMPT_B) == (cold["b"], 0)
    assert run(core, PROMPT_A) == (cold["a"], 0)  # evicted, nothing below: recomputed
    assert [e for e in core.take_kv_events() if getattr(e, "tier", None) == Tier.HOST] == []


def test_two_cache_salts_never_share_blocks(untiered, cold):
    core = fresh(untiered)
    salted = [dataclasses.replace(GREEDY, cache_salt=salt) for salt in ("tenant-a", "tenant-b")]
    outputs = [run(core, PROMPT_A, salted[0]), run(core, PROMPT_A, salted[1]), run(core, PROMPT_A, salted[1]),
               run(core, PROMPT_A, GREEDY)]
    # Same tokens, other salt: a miss; same salt: a hit; unsalted shares nothing with either.
    assert [num_cached for _, num_cached in outputs] == [0, 0, HIT, 0]
    assert all(tokens == cold["a"] for tokens, _ in outputs)  # the salt never changes the output


def test_a_prefetch_looks_up_the_chain_that_the_admission_then_asks_below(loaded_model, cold):
    """``prefetch_prefix`` (what the services call as a request arrives) hashes the prompt as
    the scheduler does, cache salt included: the admission asks the lower tier for a run of the
    prefetched chain (a cold prompt: all of it), and the output is the cold run's."""
    lower = MemoryLowerTier(capacity=16)
    core = make_core(loaded_model, num_host_blocks=16, lower_tier=lower)
    for params in (GREEDY, dataclasses.replace(GREEDY, cache_salt="tenant-1")):
        fresh(core)
        lower.prefetched.clear()
        lower.matched.clear()
        core.prefetch_prefix(PROMPT_A, params)
        assert run(core, PROMPT_A, params) == (cold["a"], 0)
        chain = hash_request_blocks(PROMPT_A, BS, params.block_hash_extra_keys)
        assert lower.prefetched == [chain] and lower.matched == [chain]
    core.prefetch_prefix([-1] * 20, GREEDY)  # not hashable: nothing, and add_request names them
    assert len(lower.prefetched) == 1
    untiered = make_core(loaded_model, num_host_blocks=0, lower_tier=lower)  # the lower tier goes unused
    untiered.prefetch_prefix(PROMPT_A, GREEDY)
    assert len(lower.prefetched) == 1

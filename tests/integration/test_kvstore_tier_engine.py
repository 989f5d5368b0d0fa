"""The kvstore as the engine's third tier: the real engine (SmolLM2-135M, fp32, CPU, a KV pool of
4 blocks and a host tier of 3) over ``KVStoreTier`` and a real ``pdserve serve kvstore`` process.
A prefix pushed out of the device and then the host tier comes back from the kvstore with greedy
output token for token equal to the cold run; after the kvstore restarts (empty) the same prompt
is a miss and is recomputed, output unchanged; the KVSTORE TierStats count both."""

from __future__ import annotations

import time

import pytest

from engine.args import EngineArgs
from engine.config import Role
from engine.core import EngineCore
from engine.kv_cache.events import Tier
from engine.kv_cache.hashing import hash_request_blocks
from engine.kv_transfer.base import KVCompat
from engine.sampling_params import SamplingParams
from services.worker import kvstore_tier
from services.worker.kvstore_tier import KVStoreTier, KVStoreTierConfig
from tests.engine_runs import run_alone
from tests.integration.cluster_fixtures import start_kvstore, stop_all, wait_serving

pytestmark = pytest.mark.slow

BS = 8
BLOCK_BYTES = 30 * 2 * BS * 3 * 64 * 4  # SmolLM2: layers x K,V x tokens x kv heads x head_dim x fp32
PROMPTS = {name: [(k * i + off) % 4000 + 100 for i in range(28)]  # 3 full blocks + 4 tokens each
           for name, k, off in (("a", 7, 3), ("b", 11, 5), ("c", 13, 9))}
HA = hash_request_blocks(PROMPTS["a"], BS)
GREEDY = SamplingParams(temperature=0.0, max_tokens=3)
HIT = 3 * BS


def run(core: EngineCore, prompt: list[int], request_id: str) -> tuple[list[int], int]:
    return run_alone(core, request_id, prompt, GREEDY)


def wait_held(tier: KVStoreTier, num_blocks: int, timeout_s: float = 20.0) -> None:
    """Until the store holds A's leading ``num_blocks`` (the puts are asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if tier.match(HA[:num_blocks]) == num_blocks:
            return
        time.sleep(0.05)
    raise AssertionError(f"the kvstore does not hold A's {num_blocks} blocks after {timeout_s} s "
                         f"(tier counters {tier.counters})")


def wait_prefetched(tier: KVStoreTier, timeout_s: float = 20.0) -> None:
    """Until every prefetch so far has its reply."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(entry.present.done() for entry, _ in list(tier._prefetched.values())):
            return
        time.sleep(0.01)
    raise AssertionError(f"prefetches unanswered after {timeout_s} s")


def kvstore_stats(core: EngineCore):
    tiers = {t.tier: t for t in core.stats().tiers}
    return tiers[Tier.KVSTORE]


def test_a_prefix_evicted_from_device_and_host_comes_back_from_the_kvstore(loaded_model, tmp_path, monkeypatch):
    store = start_kvstore(tmp_path, "--kvstore-gib", "0.05", transfer="grpc")
    port = int(store.address.rsplit(":", 1)[1])
    engine_args = EngineArgs(block_size=BS, num_kv_blocks=4, max_num_batched_tokens=64,
                             cpu_offload_gb=3 * BLOCK_BYTES / 2**30)
    config = engine_args.build(loaded_model.config, Role.COLOCATED)
    # The 2-core machine is shared: a generous lookup budget keeps the test about tiers, not load.
    tier = KVStoreTier(KVStoreTierConfig(store.address, lookup_budget_s=0.5, load_budget_s=5.0))
    core = EngineCore(config, loaded_model, lower_tier=tier)
    try:
        wait_serving([store], timeout_s=60)
        tier.start(KVCompat.from_kv_cache(config.model.name, core.runner.kv_cache))
        cold = {name: run(core, prompt, f"cold-{name}") for name, prompt in PROMPTS.items()}
        assert all(num_cached == 0 for _, num_cached in cold.values())
        # C pushed A off the device (B) and then off the 3-block host tier, into the kvstore.
        assert core.host_tier.host_pool.match_prefix(HA[:3]) == []
        wait_held(tier, 3)
        before = kvstore_stats(core)

        core.prefetch_prefix(PROMPTS["a"], GREEDY)  # as the services do when a request arrives
        assert run(core, PROMPTS["a"], "a-from-kvstore") == (cold["a"][0], HIT)
        assert tier.counters.num_prefetched_matches == 1  # the admission read the prefetched reply
        after = kvstore_stats(core)
        assert after.num_hit_blocks - before.num_hit_blocks == 3
        assert after.num_loaded_bytes - before.num_loaded_bytes == 3 * BLOCK_BYTES
        assert after.num_offloaded_bytes > 0 and after.num_load_failures == 0

        # The store restarts empty: A (forgotten by device and host too) is a miss, recomputed.
        # A's prefetched reply (before the restart) still says held: the load finds nothing.
        monkeypatch.setattr(kvstore_tier, "PREFETCH_TTL_S", 600.0)
        core.reset_prefix_cache()
        core.prefetch_prefix(PROMPTS["a"], GREEDY)
        wait_prefetched(tier)
        stop_all([store])
        store = start_kvstore(tmp_path, "--kvstore-gib", "0.05", transfer="grpc", port=port)
        wait_serving([store], timeout_s=60)
        before = kvstore_stats(core)
        assert run(core, PROMPTS["a"], "a-after-restart") == (cold["a"][0], 0)
        assert tier.counters.num_prefetched_matches == 2
        after = kvstore_stats(core)
        assert after.num_hit_blocks == before.num_hit_blocks
        assert after.num_load_failures - before.num_load_failures == 1
        assert after.num_queried_blocks - before.num_queried_blocks == 3
    finally:
        tier.close()
        stop_all([store])

"""KVStoreTier's edges without a store: bad settings are clear errors, and a kvstore that is not
there (nothing listens on the port) costs the engine thread at most the budgets: every lookup
and load is a miss, every offer returns at once (dropped when the queue is full)."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import torch

from engine.kv_cache.hashing import hash_request_blocks
from engine.kv_cache.tiers.lower_tier import EvictedBlock
from engine.kv_transfer.base import KVCompat
from services.worker.kvstore_tier import KVStoreTier, KVStoreTierConfig

COMPAT = KVCompat("tiny-tier-model", "float32", 4, 2, 1, 8)
HASHES = hash_request_blocks(list(range(16)), 4)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("kwargs, message", [
    ({"address": ""}, "address is empty"),
    ({"address": "127.0.0.1:1", "lookup_budget_s": 0}, "budgets must be > 0"),
    ({"address": "127.0.0.1:1", "max_queued_blocks": 0}, "max_queued_blocks"),
    ({"address": "127.0.0.1:1", "transfer": "rdma"}, "one of nixl, grpc, auto, got 'rdma'"),
    ({"address": "127.0.0.1:1", "staging_blocks": 0}, "staging_blocks must be >= 1"),
])
def test_bad_settings_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVStoreTierConfig(**kwargs)


def test_a_missing_store_is_a_fast_miss_and_offers_never_block():
    tier = KVStoreTier(KVStoreTierConfig(f"127.0.0.1:{closed_port()}", lookup_budget_s=0.05,
                                         load_budget_s=0.2, max_queued_blocks=2))
    blocks = [EvictedBlock(h, HASHES[i - 1] if i else None, tuple(range(4 * i, 4 * i + 4)),
                           torch.zeros(COMPAT.block_shape)) for i, h in enumerate(HASHES)]
    dst = torch.ones((4, *COMPAT.block_shape))
    try:
        assert tier.match(HASHES) == 0 and tier.load(HASHES, dst, [0, 1]) == 0  # not started: nothing
        tier.offer(blocks)
        assert tier.counters.num_dropped_blocks == 4
        tier.start(COMPAT)
        start = time.monotonic()
        assert tier.match(HASHES) == 0
        assert tier.load(HASHES, dst, [0, 1]) == 0
        tier.offer(blocks)  # one chain of 4: more than the queue's 2, dropped at once
        tier.offer(blocks[:1])
        assert time.monotonic() - start < 0.2 + 0.05 + 1.0  # the budgets, and slack for a busy CPU
        assert bool((dst == 1).all())  # nothing written
        assert tier.counters.num_dropped_blocks == 8 and tier.counters.num_offered_blocks == 5
    finally:
        tier.close()


@pytest.fixture
def started_tier():
    """A started tier whose store is not there: every lookup is a fast miss, so the counters
    say which path a match took."""
    tier = KVStoreTier(KVStoreTierConfig(f"127.0.0.1:{closed_port()}", lookup_budget_s=2.0))
    tier.start(COMPAT)
    yield tier
    tier.close()


def test_a_prefetched_chain_answers_one_match_on_any_run_of_it(started_tier):
    tier = started_tier
    tier.prefetch(HASHES)
    assert tier.match(HASHES[1:3]) == 0  # a run inside the chain: the prefetched reply
    assert (tier.counters.num_prefetches, tier.counters.num_prefetched_matches) == (1, 1)
    assert tier.match(HASHES[1:3]) == 0  # one admission per prefetch: this one asked the store
    assert tier.counters.num_prefetched_matches == 1
    tier.prefetch(HASHES)
    other = hash_request_blocks([*range(8), 99, 98, 97, 96], 4)  # shares the first 2 blocks
    assert tier.match(other) == 0  # not a run of the prefetched chain: asked the store
    assert tier.counters.num_prefetched_matches == 1
    assert tier.match(HASHES) == 0  # the prefetch is still there for its own chain
    assert tier.counters.num_prefetched_matches == 2 and tier.counters.num_lookup_timeouts == 0


def test_an_old_prefetch_is_asked_again_and_prefetches_are_bounded(started_tier, monkeypatch):
    from services.worker import kvstore_tier
    tier = started_tier
    monkeypatch.setattr(kvstore_tier, "PREFETCH_TTL_S", 0.0)
    tier.prefetch(HASHES)
    time.sleep(0.01)
    assert tier.match(HASHES) == 0 and tier.counters.num_prefetched_matches == 0
    monkeypatch.setattr(kvstore_tier, "PREFETCH_TTL_S", 60.0)
    monkeypatch.setattr(kvstore_tier, "MAX_PREFETCHED_HASHES", 6)
    chains = [hash_request_blocks([c, *range(1, 12)], 4) for c in range(3)]  # 3 blocks each
    for chain in chains:
        tier.prefetch(chain)  # the third pushes the first out
    assert tier.match(chains[0]) == 0 and tier.counters.num_prefetched_matches == 0
    assert tier.match(chains[1]) == 0 and tier.match(chains[2]) == 0
    assert tier.counters.num_prefetched_matches == 2


class HeldBack:
    """A client whose Lookup replies ``present`` once the test calls ``answer`` (on the tier's loop)."""

    def __init__(self, present: list[bool]) -> None:
        self.present = present
        self.asked: list[list] = []
        self._go = asyncio.Event()  # set on the tier's loop

    async def lookup_present(self, hashes):
        self.asked.append(list(hashes))
        await self._go.wait()
        return self.present

    async def lookup(self, hashes):
        present = await self.lookup_present(hashes)
        return next((i for i, p in enumerate(present) if not p), len(present))

    def answer(self) -> None:
        self._go.set()

    async def close(self):
        pass


def test_prefetch_never_waits_for_the_store_and_match_reads_its_per_block_reply():
    tier = KVStoreTier(KVStoreTierConfig(f"127.0.0.1:{closed_port()}", lookup_budget_s=0.3))
    tier.start(COMPAT)
    try:
        held = HeldBack([True, True, False, True])
        tier._client = held  # the tier's logic; the real client against a real store: tests/integration
        tier.prefetch(HASHES)  # the reply is held back: prefetch returned anyway
        assert tier.counters.num_prefetches == 1
        assert tier.match(HASHES) == 0  # no reply within the budget: a miss
        assert tier.counters.num_lookup_timeouts == 1
        tier.prefetch(HASHES)
        tier.prefetch(HASHES[1:])  # the same blocks from the second on: the newer chain answers them
        tier._loop.call_soon_threadsafe(held.answer)
        assert tier.match(HASHES) == 2  # held, held, missing
        assert tier.match(HASHES[3:]) == 0  # in the newer chain at index 2: missing
        assert tier.counters.num_prefetched_matches == 2
        assert [len(a) for a in held.asked] == [4, 4, 3]  # no lookup of a match's own
    finally:
        tier.close()

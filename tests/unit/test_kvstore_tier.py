"""KVStoreTier's edges without a store: bad settings are clear errors, and a kvstore that is not
there (nothing listens on the port) costs the engine thread at most the budgets: every lookup
and load is a miss, every offer returns at once (dropped when the queue is full)."""

from __future__ import annotations

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

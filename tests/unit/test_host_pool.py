"""HostBlockPool (engine/kv_cache/tiers/host_pool.py): exact slots, LRU order, pins, events, the
offer to a lower tier, capacity, and the run copies; an integrity check after every test."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, Tier
from engine.kv_cache.hashing import BlockHash, hash_request_blocks
from engine.kv_cache.tiers.host_pool import HostBlockPool, copy_block_runs
from engine.kv_cache.tiers.lower_tier import EvictedBlock

BLOCK_SIZE = 4
HASHES = hash_request_blocks(list(range(40)), BLOCK_SIZE)  # a chain of 10 blocks


def tokens(i: int) -> list[int]:
    return list(range(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE))


def parent(i: int) -> BlockHash | None:
    return HASHES[i - 1] if i else None


@pytest.fixture
def offered() -> list[tuple[BlockHash, list[float]]]:
    return []


@pytest.fixture
def pool(offered):
    def offer(blocks: list[EvictedBlock]) -> None:  # copies what it keeps, as the contract says
        offered.extend((b.block_hash, b.data.tolist()) for b in blocks)

    pool = HostBlockPool(3, (BLOCK_SIZE,), torch.float32, on_evict=offer)
    yield pool
    pool.check_integrity()


def store(pool: HostBlockPool, i: int) -> int:
    """Reserve block i of the chain, write its tokens as its data, commit it; returns its slot."""
    entry = pool.reserve(HASHES[i], parent(i), tokens(i))
    assert entry is not None
    pool.kv_cache[entry.slot] = torch.tensor(tokens(i), dtype=torch.float32)
    pool.commit([entry])
    return entry.slot


def test_reserve_takes_the_lowest_free_slot_and_announces_the_block(pool):
    assert [store(pool, i) for i in range(3)] == [0, 1, 2]
    assert pool.take_events() == [BlockStored([HASHES[i]], parent(i), tokens(i), BLOCK_SIZE, Tier.HOST)
                                  for i in range(3)]
    assert pool.cached_block_hashes() == HASHES[:3]
    assert [e.slot for e in pool.match_prefix(HASHES)] == [0, 1, 2]


def test_a_held_hash_is_touched_not_stored_twice(pool):
    store(pool, 0)
    store(pool, 1)
    pool.take_events()
    assert pool.reserve(HASHES[0], None, tokens(0)) is None
    assert pool.take_events() == []
    assert pool.cached_block_hashes() == [HASHES[1], HASHES[0]]  # 0 is now the most recent


def test_full_pool_evicts_lru_offers_it_below_then_announces_removal(pool, offered):
    for i in range(3):
        store(pool, i)
    pool.touch(pool.match_prefix(HASHES[:1]))  # LRU order: 1, 2, 0
    pool.take_events()
    assert store(pool, 3) == 1
    assert offered == [(HASHES[1], [4.0, 5.0, 6.0, 7.0])]  # the bytes before the slot is reused
    assert pool.take_events() == [BlockRemoved([HASHES[1]], Tier.HOST),
                                  BlockStored([HASHES[3]], HASHES[2], tokens(3), BLOCK_SIZE, Tier.HOST)]
    assert pool.num_cached_blocks == 3 == pool.num_blocks
    assert (pool.num_stored_blocks, pool.num_evicted_blocks) == (4, 1)


def test_pinned_entries_are_never_evicted(pool):
    for i in range(3):
        store(pool, i)
    pinned = pool.match_prefix(HASHES[:3])
    pool.pin(pinned[:2])
    assert store(pool, 3) == 2  # the only unpinned one
    assert pool.reserve(HASHES[4], HASHES[3], tokens(4)) is not None  # 3 is pinned by its reserve
    assert pool.reserve(HASHES[5], HASHES[4], tokens(5)) is None  # everything pinned: not kept
    with pytest.raises(RuntimeError, match="pinned at rest"):
        pool.check_integrity()
    pool.unpin(pinned[:2])
    pool.commit([pool.get(HASHES[4])])
    pool.check_integrity()
    assert pool.num_cached_blocks <= pool.num_blocks


def test_match_prefix_stops_at_the_first_miss(pool):
    store(pool, 0)
    store(pool, 2)
    assert [e.block_hash for e in pool.match_prefix(HASHES)] == [HASHES[0]]
    assert pool.match_prefix(HASHES[1:]) == []


def test_discard_and_clear(pool):
    for i in range(2):
        store(pool, i)
    pool.take_events()
    pool.discard(pool.get(HASHES[0]))
    assert pool.take_events() == [BlockRemoved([HASHES[0]], Tier.HOST)]
    pool.clear()
    assert pool.take_events() == [AllBlocksCleared(Tier.HOST)]
    assert pool.num_cached_blocks == 0 and pool.match_prefix(HASHES) == []
    assert store(pool, 5) == 0


def test_clear_refuses_while_a_copy_is_in_flight(pool):
    pool.reserve(HASHES[0], None, tokens(0))
    with pytest.raises(RuntimeError, match="pinned"):
        pool.clear()
    pool.commit([pool.get(HASHES[0])])


def test_a_reserved_entry_is_announced_and_matched_only_once_committed(pool):
    entry = pool.reserve(HASHES[0], None, tokens(0))
    assert entry is not None and not entry.is_ready
    assert pool.take_events() == [] and pool.match_prefix(HASHES) == []
    assert pool.cached_block_hashes() == [] and pool.num_cached_blocks == 0
    assert pool.reserve(HASHES[0], None, tokens(0)) is None  # its copy is on the way: not twice
    pool.commit([entry])
    assert pool.take_events() == [BlockStored([HASHES[0]], None, tokens(0), BLOCK_SIZE, Tier.HOST)]
    assert [e.slot for e in pool.match_prefix(HASHES)] == [0] and pool.num_cached_blocks == 1
    with pytest.raises(RuntimeError, match="already ready"):
        pool.commit([entry])


def test_a_reserved_entry_whose_copy_failed_goes_unannounced(pool):
    entry = pool.reserve(HASHES[0], None, tokens(0))
    pool.unpin([entry])
    pool.discard(entry)
    assert pool.take_events() == [] and pool.num_evicted_blocks == 0
    assert store(pool, 1) == 0  # the slot is free again


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        HostBlockPool(0, (4,), torch.float32)
    with pytest.raises(ValueError, match="3 destination blocks for 2 source"):
        copy_block_runs(torch.zeros(4, 2), [0, 1, 2], torch.zeros(4, 2), [0, 1])


def test_copy_block_runs_copies_every_pair_in_runs():
    src = torch.arange(24, dtype=torch.float32).reshape(8, 3)
    dst = torch.zeros(6, 3)
    copy_block_runs(dst, [1, 2, 3, 0, 5], src, [4, 5, 6, 2, 3])  # runs: (1..3 <- 4..6), (0 <- 2), (5 <- 3)
    expected = torch.zeros(6, 3)
    for d, s in zip([1, 2, 3, 0, 5], [4, 5, 6, 2, 3]):
        expected[d] = src[s]
    assert torch.equal(dst, expected)

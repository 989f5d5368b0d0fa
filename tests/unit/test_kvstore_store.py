"""The kvstore's block store: exact LRU eviction order, watermarks, leases, events, dedup."""

from __future__ import annotations

import hashlib

import pytest

from engine.kv_cache.events import BlockRemoved, BlockStored, Tier
from engine.kv_cache.hashing import BlockHash
from engine.kv_transfer.base import KVCompat
from services.kvstore.store import (
    BlockStore,
    KVStoreConfig,
    MissingBlocksError,
    UnknownCompatError,
)

# one block: [num_layers=2, 2, block_size=4, kv_heads=1, head_dim=8] float32 = 512 bytes
COMPAT = KVCompat("tiny", "float32", 4, 2, 1, 8)
BLOCK_BYTES = 512


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def h(i: int) -> BlockHash:
    return BlockHash(hashlib.sha256(str(i).encode()).digest())


def data(ids: list[int]) -> bytes:
    return b"".join(bytes([i % 256]) * BLOCK_BYTES for i in ids)


def tokens(ids: list[int]) -> list[int]:
    return [t for i in ids for t in range(i * 4, i * 4 + 4)]


def put(store: BlockStore, ids: list[int], parent: int | None = None) -> int:
    return store.put(COMPAT.hash, [h(i) for i in ids], None if parent is None else h(parent),
                     tokens(ids), data(ids))


def held(store: BlockStore, ids: range) -> list[int]:
    return [i for i in ids if store.contains(COMPAT.hash, h(i))]


def make(num_blocks: int = 20, clock: Clock | None = None) -> BlockStore:
    store = BlockStore(KVStoreConfig(capacity_bytes=num_blocks * BLOCK_BYTES), clock or Clock())
    store.register(COMPAT)
    return store


def test_put_lookup_acquire_round_trip_bytes():
    store = make()
    assert put(store, [0, 1, 2]) == 3
    assert store.lookup(COMPAT.hash, [h(0), h(1), h(5), h(2)]) == (2, [True, True, False, True])
    lease = store.acquire(COMPAT.hash, [h(2), h(0)])
    region = store.region(COMPAT.hash)
    assert [bytes(region.read(s)) for s in lease.slot_ids] == [data([2]), data([0])]
    assert store.release(lease.lease_id) and not store.release(lease.lease_id)
    stats = store.stats()
    assert (stats.num_hits, stats.num_misses, stats.num_stored) == (2, 2, 3)
    assert (stats.bytes_in, stats.bytes_out) == (3 * BLOCK_BYTES, 2 * BLOCK_BYTES)
    store.check_integrity()


def test_put_skips_held_blocks_and_offer_names_only_new_ones():
    store = make()
    put(store, [0, 1])
    assert store.offer(COMPAT.hash, [h(0), h(2), h(1), h(3), h(2)]) == [h(2), h(3)]
    assert put(store, [0, 1, 2, 3]) == 2
    assert store.stats().num_stored == 4


def test_lru_eviction_order_is_exact_at_the_watermark():
    store = make(20)  # high watermark 19 blocks; evicting goes down to 18 incl. the new block
    put(store, list(range(19)))
    assert held(store, range(19)) == list(range(19))
    store.release(store.acquire(COMPAT.hash, [h(0), h(1)]).lease_id)  # 0, 1 most recent now
    put(store, [100])
    # 19 + 1 > 19: evict LRU until 17 + 1 <= 18: blocks 2 and 3 (0 and 1 were touched)
    assert held(store, range(19)) == [0, 1, *range(4, 19)]
    assert store.stats().num_evicted == 2
    events = store.take_events()
    assert events[-1] == BlockStored([h(100)], None, tokens([100]), 4, Tier.KVSTORE)
    assert events[-2] == BlockRemoved([h(2), h(3)], Tier.KVSTORE)
    store.check_integrity()


def test_leased_blocks_are_never_evicted_and_an_expired_lease_permits_it():
    clock = Clock()
    store = make(4, clock)  # soft watermark 3.8 blocks, hard capacity 4
    put(store, [0, 1, 2])
    lease = store.acquire(COMPAT.hash, [h(0), h(1), h(2)], lease_s=5.0)
    assert put(store, [3]) == 1  # above the watermark, all others pinned: fits under capacity
    store.acquire(COMPAT.hash, [h(3)], lease_s=10.0)
    assert put(store, [4]) == 0  # every block pinned and the store full: nothing stored
    assert held(store, range(5)) == [0, 1, 2, 3]
    clock.now = 5.0  # expires_at <= now: the first lease expired, the second is live
    assert not store.is_leased(lease.lease_id)
    assert put(store, [4]) == 1  # evict LRU until 2 + 1 <= 3.6 blocks: 0 and 1; 3 stays pinned
    assert held(store, range(5)) == [2, 3, 4]
    assert store.stats().num_leases_expired == 1


def test_acquire_unknown_block_and_unknown_compat_and_bad_sizes_are_clear_errors():
    store = make()
    put(store, [0])
    with pytest.raises(MissingBlocksError, match="1 of 2 blocks are not in the kvstore"):
        store.acquire(COMPAT.hash, [h(0), h(9)])
    with pytest.raises(UnknownCompatError, match="unknown compat_hash"):
        store.lookup("ab" * 32, [h(0)])
    with pytest.raises(ValueError, match="need 1024 bytes of data, got 512"):
        store.put(COMPAT.hash, [h(1), h(2)], None, tokens([1, 2]), data([1]))
    with pytest.raises(ValueError, match="need 8 token ids, got 4"):
        store.put(COMPAT.hash, [h(1), h(2)], None, tokens([1]), data([1, 2]))
    with pytest.raises(ValueError, match="must be 32 bytes"):
        store.lookup(COMPAT.hash, [b"short"])
    with pytest.raises(ValueError, match="lease must be in"):
        store.acquire(COMPAT.hash, [h(0)], lease_s=600)
    assert store.stats().num_leases == 0 and held(store, range(3)) == [0]
    store.check_integrity()


def test_stored_events_follow_the_chain_around_held_blocks():
    store = make()
    put(store, [1])
    store.take_events()
    put(store, [0, 1, 2, 3], parent=7)
    assert store.take_events() == [
        BlockStored([h(0)], h(7), tokens([0]), 4, Tier.KVSTORE),
        BlockStored([h(2), h(3)], h(1), tokens([2, 3]), 4, Tier.KVSTORE),
    ]


def test_capacity_smaller_than_a_block_is_refused():
    with pytest.raises(ValueError, match="more than the store's capacity"):
        BlockStore(KVStoreConfig(capacity_bytes=100)).register(COMPAT)

"""BlockPool: exact block ids, LRU eviction order, the hash map, events and the integrity check."""

import pytest

from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from engine.kv_cache.hashing import ROOT_HASH, hash_request_blocks

H = hash_request_blocks(list(range(40)), 4)  # ten chained hashes


@pytest.fixture
def pool():
    pool = BlockPool(6)
    yield pool
    pool.check_integrity()


def ids(blocks):
    return [b.block_id for b in blocks]


def free_all(pool):
    pool.free_blocks([b for b in pool.blocks for _ in range(b.ref_cnt)])


def test_allocates_in_id_order_then_lru(pool):
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(3)
    assert ids(a) == [0, 1] and ids(b) == [2, 3, 4]
    assert all(blk.ref_cnt == 1 for blk in a + b)
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(5 / 6)
    pool.free_blocks(reversed(b))  # 4, 3, 2 join the tail after 5
    pool.free_blocks(a)  # then 0, 1
    assert ids(pool.get_new_blocks(6)) == [5, 4, 3, 2, 0, 1]
    assert pool.num_free_blocks == 0


def test_asking_for_too_many_raises_and_changes_nothing(pool):
    pool.get_new_blocks(4)
    with pytest.raises(ValueError, match="only 2 free"):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2
    assert ids(pool.get_new_blocks(2)) == [4, 5]
    free_all(pool)


def test_touch_and_free_count_references(pool):
    (blk,) = pool.get_new_blocks(1)
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and pool.num_free_blocks == 5
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and pool.num_free_blocks == 6
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([blk])


def test_cached_free_block_is_reused_by_touch_and_evicted_lru(pool):
    blocks = pool.get_new_blocks(3)
    for i, blk in enumerate(blocks):
        assert pool.cache_full_block(blk, H[i], H[i - 1] if i else None, list(range(4 * i, 4 * i + 4)))
    assert pool.take_events() == [BlockStored(H[:3], None, list(range(12)), 4)]
    pool.free_blocks(reversed(blocks))  # queue: 3 4 5 | 2 1 0
    assert pool.get_cached_block(H[1]) is blocks[1]

    # A prefix hit takes the free cached block back out of the queue.
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1 and pool.num_free_blocks == 5

    # Allocation drains uncached blocks first (they are older), then evicts cached ones LRU.
    assert ids(pool.get_new_blocks(3)) == [3, 4, 5]
    assert pool.take_events() == []
    assert ids(pool.get_new_blocks(1)) == [2]
    assert pool.get_cached_block(H[2]) is None and blocks[2].block_hash is None
    assert pool.take_events() == [BlockRemoved([H[2]])]
    assert pool.get_cached_block(H[0]) is blocks[0]  # in use, still cached
    free_all(pool)


def test_evictions_in_one_allocation_coalesce_in_order(pool):
    blocks = pool.get_new_blocks(6)
    for i, blk in enumerate(blocks):
        pool.cache_full_block(blk, H[i], H[i - 1] if i else None, list(range(4 * i, 4 * i + 4)))
    pool.take_events()
    pool.free_blocks([blocks[4], blocks[1], blocks[5]])
    pool.get_new_blocks(2)
    pool.get_new_blocks(1)
    assert pool.take_events() == [BlockRemoved([H[4], H[1], H[5]])]
    free_all(pool)


def test_stored_events_coalesce_only_along_a_chain(pool):
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_block(a, H[0], None, [0, 1, 2, 3])
    pool.cache_full_block(c, H[5], H[4], [9, 9, 9, 9])  # not the child of H[0]
    pool.cache_full_block(b, H[6], H[5], [8, 8, 8, 8])  # child of H[5]
    assert pool.take_events() == [
        BlockStored([H[0]], None, [0, 1, 2, 3], 4),
        BlockStored([H[5], H[6]], H[4], [9, 9, 9, 9, 8, 8, 8, 8], 4),
    ]
    assert pool.take_events() == []
    pool.free_blocks([a, b, c])


def test_first_block_keeps_a_hash(pool):
    a, b = pool.get_new_blocks(2)
    assert pool.cache_full_block(a, H[0], None, [0, 1, 2, 3])
    assert not pool.cache_full_block(b, H[0], None, [0, 1, 2, 3])
    assert not pool.cache_full_block(a, H[0], None, [0, 1, 2, 3])
    assert b.block_hash is None and pool.get_cached_block(H[0]) is a
    assert len(pool.take_events()) == 1
    with pytest.raises(RuntimeError, match="different hash"):
        pool.cache_full_block(a, H[1], H[0], [4, 5, 6, 7])
    pool.free_blocks([a, b])
    with pytest.raises(RuntimeError, match="no request holds"):
        pool.cache_full_block(b, H[1], H[0], [4, 5, 6, 7])


def test_reset_prefix_cache(pool):
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, H[0], None, [0, 1, 2, 3])
    pool.cache_full_block(b, H[1], H[0], [4, 5, 6, 7])
    pool.free_blocks([b])
    pool.take_events()
    pool.reset_prefix_cache()
    assert pool.get_cached_block(H[0]) is None and pool.get_cached_block(H[1]) is None
    assert a.block_hash is None and b.block_hash is None and a.ref_cnt == 1
    assert pool.take_events() == [AllBlocksCleared()]
    pool.get_new_blocks(5)  # evicting the formerly cached block reports nothing
    assert pool.take_events() == []
    free_all(pool)


def test_caching_disabled_hashes_nothing():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    assert not pool.cache_full_block(a, H[0], None, [0, 1, 2, 3])
    assert pool.get_cached_block(H[0]) is None and pool.take_events() == []
    pool.check_integrity()


def test_events_disabled_still_caches():
    pool = BlockPool(2, enable_events=False)
    (a,) = pool.get_new_blocks(1)
    assert pool.cache_full_block(a, H[0], None, [0, 1, 2, 3])
    pool.free_blocks([a])
    pool.get_new_blocks(2)
    pool.reset_prefix_cache()
    assert pool.take_events() == []
    pool.check_integrity()


def test_integrity_check_reports_the_numbers():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    a.ref_cnt = 0  # a leaked reference: ref 0 but not in the free queue
    with pytest.raises(RuntimeError, match=r"3 blocks have ref_cnt 0, 1 in use.*not in queue: \[0\]"):
        pool.check_integrity()
    a.ref_cnt = 1
    pool.check_integrity()
    pool.cache_full_block(a, H[0], None, [0, 1, 2, 3])
    b.block_hash = H[1]  # carries a hash the map does not know
    with pytest.raises(RuntimeError, match=r"hashed but unmapped: \[1\]"):
        pool.check_integrity()
    assert ROOT_HASH not in {blk.block_hash for blk in pool.blocks}


def test_rejects_empty_pool():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)

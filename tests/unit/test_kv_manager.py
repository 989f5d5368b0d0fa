"""KVCacheManager: token accounting, prefix hits, copy-on-write, truncation, and the KV tensor.

Block size 4 throughout; ``toks(n)`` is the prompt 0..n-1.
"""

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.config import CacheConfig, ConfigError, ModelConfig
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from engine.kv_cache.hashing import hash_request_blocks
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.storage import (
    allocate_kv_cache,
    bytes_per_block,
    layer_kv,
    num_blocks_for_budget,
)

BS = 4


def toks(n, start=0):
    return list(range(start, start + n))


def hashes(tokens):
    return hash_request_blocks(tokens, BS)


def make_manager(num_blocks=8, **pool_kwargs):
    return KVCacheManager(BlockPool(num_blocks, **pool_kwargs), BS)


@pytest.fixture
def mgr():
    mgr = make_manager()
    yield mgr
    mgr.check_integrity()


def run_prefill(mgr, rid, tokens):
    """Admit a whole prompt in one step, with prefix reuse, and cache what it computed."""
    blocks, num_hit = mgr.get_computed_blocks(hashes(tokens), len(tokens))
    new_ids = mgr.allocate_slots(rid, len(tokens), blocks)
    if new_ids is not None:
        mgr.cache_blocks(rid, hashes(tokens), len(tokens), tokens)
    return num_hit, new_ids


def test_allocates_exact_blocks_for_tokens(mgr):
    assert mgr.allocate_slots("a", 5) == [0, 1]
    assert mgr.allocate_slots("a", 8) == []  # 8 tokens still fit in two blocks
    assert mgr.allocate_slots("a", 9) == [2]
    assert mgr.allocate_slots("b", 1) == [3]
    assert mgr.get_block_ids("a") == [0, 1, 2] and mgr.get_block_ids("b") == [3]
    assert mgr.get_block_ids("unknown") == []
    assert mgr.num_free_blocks == 4 and mgr.usage == pytest.approx(0.5)
    mgr.check_integrity()


def test_prefix_hit_reuses_the_same_blocks_and_recomputes_the_last_token(mgr):
    assert run_prefill(mgr, "a", toks(10)) == (0, [0, 1, 2])
    assert mgr.take_events() == [BlockStored(hashes(toks(10)), None, toks(8), BS)]

    # Same first 8 tokens: both full blocks are reused.
    assert run_prefill(mgr, "b", toks(8) + [99, 98, 97]) == (8, [3])
    assert mgr.get_block_ids("b") == [0, 1, 3]
    assert [blk.ref_cnt for blk in mgr.block_pool.blocks[:4]] == [2, 2, 1, 1]

    # A prompt that is exactly two cached blocks reuses only one: its last token needs logits.
    blocks, num_hit = mgr.get_computed_blocks(hashes(toks(8)), 8)
    assert [b.block_id for b in blocks] == [0] and num_hit == 4
    assert mgr.allocate_slots("c", 8, blocks) == [4]
    mgr.cache_blocks("c", hashes(toks(8)), 8, toks(8))
    assert mgr.take_events() == []  # block 4 holds a hash block 1 already holds: the first keeps it
    assert mgr.get_block_ids("c") == [0, 4]
    mgr.check_integrity()


def test_cache_blocks_registers_each_block_once_as_it_fills(mgr):
    tokens = toks(12)
    mgr.allocate_slots("a", 6)
    mgr.cache_blocks("a", hashes(tokens), 6, tokens)
    mgr.cache_blocks("a", hashes(tokens), 7, tokens)
    assert mgr.take_events() == [BlockStored(hashes(tokens)[:1], None, toks(4), BS)]
    mgr.allocate_slots("a", 12)
    mgr.cache_blocks("a", hashes(tokens)[:2], 12, tokens)  # the third hash is not known yet
    mgr.cache_blocks("a", hashes(tokens), 12, tokens)
    h = hashes(tokens)
    assert mgr.take_events() == [BlockStored([h[1], h[2]], h[0], toks(8, start=4), BS)]


def test_free_releases_tail_first_so_the_tail_is_evicted_first():
    mgr = make_manager(4)
    run_prefill(mgr, "a", toks(13))  # blocks 0 1 2 3, the first three cached
    mgr.take_events()
    mgr.free("a")
    mgr.free("a")  # unknown now: a no-op
    assert mgr.block_pool.free_block_ids() == [3, 2, 1, 0]
    assert mgr.allocate_slots("b", 8) == [3, 2]
    assert mgr.take_events() == [BlockRemoved([hashes(toks(13))[2]])]
    # The surviving prefix is still a hit, on the very same blocks.
    blocks, num_hit = mgr.get_computed_blocks(hashes(toks(13)), 13)
    assert [b.block_id for b in blocks] == [0, 1] and num_hit == 8
    mgr.check_integrity()


def test_hit_on_free_cached_blocks_counts_them_against_the_pool():
    mgr = make_manager(4)
    run_prefill(mgr, "a", toks(9))  # blocks 0 1 2; 0 and 1 cached
    mgr.free("a")  # free queue: 3 2 1 0
    blocks, num_hit = mgr.get_computed_blocks(hashes(toks(9)), 9)
    assert num_hit == 8
    # Reviving 2 cached blocks leaves 2 free: 16 tokens (2 new blocks) fit, 17 do not.
    assert mgr.allocate_slots("b", 17, blocks) is None
    assert mgr.block_pool.free_block_ids() == [3, 2, 1, 0]
    assert mgr.allocate_slots("b", 16, blocks) == [3, 2]
    assert mgr.get_block_ids("b") == [0, 1, 3, 2] and mgr.num_free_blocks == 0
    mgr.check_integrity()


def test_hit_blocks_at_the_eviction_head_are_taken_before_allocating():
    mgr = make_manager(4)
    run_prefill(mgr, "a", toks(8))  # blocks 0 1, both cached
    mgr.free("a")
    mgr.allocate_slots("x", 8)
    mgr.free("x")
    assert mgr.block_pool.free_block_ids() == [1, 0, 3, 2]
    mgr.take_events()
    blocks, num_hit = mgr.get_computed_blocks(hashes(toks(9)), 9)
    assert [b.block_id for b in blocks] == [0, 1]
    assert mgr.allocate_slots("b", 12, blocks) == [3]  # not block 1, which the pool would pop first
    assert mgr.get_block_ids("b") == [0, 1, 3] and mgr.take_events() == []
    mgr.check_integrity()


def snapshot(mgr, request_ids):
    pool = mgr.block_pool
    return ([mgr.get_block_ids(r) for r in request_ids], pool.free_block_ids(),
            [(b.ref_cnt, b.block_hash) for b in pool.blocks])


def test_failed_allocation_has_no_side_effects():
    mgr = make_manager(4)
    run_prefill(mgr, "a", toks(6))  # blocks 0 1, block 0 cached
    mgr.fork("a", "b")  # block 1 is shared: a's next write needs a copy
    mgr.allocate_slots("c", 8)  # blocks 2 3: pool empty
    mgr.take_events()
    before = snapshot(mgr, ["a", "b", "c", "d"])
    assert mgr.allocate_slots("a", 7) is None  # needs one block for the copy
    assert mgr.allocate_slots("c", 9) is None
    assert mgr.allocate_slots("d", 1) is None
    assert snapshot(mgr, ["a", "b", "c", "d"]) == before
    assert mgr.take_copy_ops() == [] and mgr.take_events() == []
    mgr.free("c")
    assert mgr.allocate_slots("a", 7) == [3]
    assert mgr.take_copy_ops() == [(1, 3)]
    mgr.check_integrity()


def test_fork_shares_blocks_and_copies_on_write(mgr):
    tokens = toks(6)
    run_prefill(mgr, "a", tokens)  # blocks 0 (full, cached) and 1 (2 of 4 slots computed)
    mgr.fork("a", "b")
    assert mgr.get_block_ids("b") == [0, 1]
    assert [b.ref_cnt for b in mgr.block_pool.blocks[:2]] == [2, 2]
    mgr.check_integrity()

    # a writes position 6, in shared block 1: it gets a copy; full block 0 stays shared.
    assert mgr.allocate_slots("a", 7) == [2]
    assert mgr.get_block_ids("a") == [0, 2]
    assert mgr.take_copy_ops() == [(1, 2)]
    # b is now block 1's only owner: it writes in place.
    assert mgr.allocate_slots("b", 7) == []
    assert mgr.get_block_ids("b") == [0, 1]
    assert mgr.take_copy_ops() == []
    assert [b.ref_cnt for b in mgr.block_pool.blocks[:3]] == [2, 1, 1]

    # Diverged samples cache their own second block.
    mgr.cache_blocks("a", hashes(tokens + [6, 7]), 8, tokens + [6, 7])
    mgr.cache_blocks("b", hashes(tokens + [9, 9]), 8, tokens + [9, 9])
    h_a, h_b = hashes(tokens + [6, 7]), hashes(tokens + [9, 9])
    assert mgr.take_events() == [
        BlockStored(h_a[:2], None, toks(4) + [4, 5, 6, 7], BS),  # a's block 2 extends the chain of block 0
        BlockStored(h_b[1:2], h_b[0], [4, 5, 9, 9], BS),
    ]
    assert mgr.block_pool.blocks[2].block_hash == hashes(tokens + [6, 7])[1]


def test_copy_ends_stay_pinned_until_taken_even_if_their_owners_go():
    mgr = make_manager(5)
    run_prefill(mgr, "a", toks(6))  # blocks 0 1
    mgr.fork("a", "b")
    mgr.allocate_slots("c", 8)  # blocks 2 3
    assert mgr.allocate_slots("a", 7) == [4]  # queues the copy 1 -> 4
    # Later in the same step both sharers of block 1 are preempted. Unpinned, blocks 1 and 4
    # would be free, and the next allocation could make one of them a second copy's target.
    mgr.free("a")
    mgr.free("b")
    assert mgr.num_free_blocks == 1 and [b.ref_cnt for b in mgr.block_pool.blocks[:5]] == [0, 1, 1, 1, 1]
    assert mgr.allocate_slots("d", 1) == [0]
    assert mgr.allocate_slots("e", 1) is None
    mgr.check_integrity()
    assert mgr.take_copy_ops() == [(1, 4)]
    assert mgr.num_free_blocks == 2 and mgr.block_pool.free_block_ids() == [4, 1]
    mgr.check_integrity()


def test_pins_do_not_make_a_block_look_shared(mgr):
    run_prefill(mgr, "a", toks(6))
    mgr.fork("a", "b")
    mgr.fork("a", "c")
    assert mgr.allocate_slots("a", 7) == [2] and mgr.allocate_slots("b", 7) == [3]
    assert mgr.allocate_slots("c", 7) == []  # c is block 1's last owner: the pins do not count
    with pytest.raises(RuntimeError, match="take_copy_ops"):
        mgr.fork("c", "d")
    assert mgr.take_copy_ops() == [(1, 2), (1, 3)]
    mgr.fork("c", "d")
    assert mgr.get_block_ids("d") == [0, 1]


def test_block_table_is_one_tuple_until_the_table_changes(mgr):
    """``block_table``: the same tuple across steps that add no block (a step's staging
    converts a table it has seen once), a new one when a block is appended, copied on write
    or truncated away; ``get_block_ids`` a list of the same ids."""
    run_prefill(mgr, "a", toks(6))  # blocks 0 and 1, 2 slots of block 1 computed
    first = mgr.block_table("a")
    assert first == (0, 1) and mgr.get_block_ids("a") == [0, 1]
    assert mgr.allocate_slots("a", 7) == [] and mgr.block_table("a") is first  # a slot it owns
    assert mgr.allocate_slots("a", 9) == [2]
    grown = mgr.block_table("a")
    assert grown == (0, 1, 2) and grown is not first
    mgr.fork("a", "b")
    assert mgr.block_table("b") == grown
    assert mgr.allocate_slots("b", 10) == [3]  # b's write lands in shared block 2: a copy
    assert mgr.take_copy_ops() == [(2, 3)]
    assert mgr.block_table("b") == (0, 1, 3) and mgr.block_table("a") is grown
    assert mgr.truncate("a", 5) == [2] and mgr.block_table("a") == (0, 1)
    mgr.check_integrity()
    assert mgr.block_table("unknown") == ()


def test_fork_before_a_block_boundary_needs_no_copy(mgr):
    run_prefill(mgr, "a", toks(8))  # blocks 0 1, both full
    mgr.fork("a", "b")
    assert mgr.allocate_slots("a", 9) == [2] and mgr.allocate_slots("b", 9) == [3]
    assert mgr.take_copy_ops() == []
    assert mgr.get_block_ids("a") == [0, 1, 2] and mgr.get_block_ids("b") == [0, 1, 3]


def test_shared_block_without_computed_tokens_is_replaced_without_a_copy(mgr):
    mgr.allocate_slots("a", 8)  # slots for 8, e.g. 4 tokens + 4 lookahead
    mgr.fork("a", "b")
    assert mgr.allocate_slots("b", 8, num_computed_tokens=4) == [2]
    assert mgr.take_copy_ops() == []
    assert mgr.get_block_ids("b") == [0, 2]


def test_truncate_frees_blocks_beyond_the_kept_tokens(mgr):
    run_prefill(mgr, "a", toks(5))  # blocks 0 1
    assert mgr.allocate_slots("a", 5 + 1 + 7) == [2, 3]  # one token plus 7 draft tokens
    assert mgr.truncate("a", 7) == [2, 3]  # 2 of 8 accepted
    assert mgr.get_block_ids("a") == [0, 1]
    assert mgr.block_pool.free_block_ids() == [4, 5, 6, 7, 3, 2]
    assert mgr.truncate("a", 7) == []
    assert mgr.allocate_slots("a", 8) == []  # the default write start is now 7: block 1 is ours
    assert mgr.take_copy_ops() == []


def test_truncate_keeps_dropped_cached_blocks_cached(mgr):
    run_prefill(mgr, "a", toks(9))  # blocks 0 1 cached, block 2 partial
    mgr.take_events()
    assert mgr.truncate("a", 4) == [1, 2]
    assert mgr.block_pool.free_block_ids()[-2:] == [2, 1]
    assert mgr.block_pool.get_cached_block(hashes(toks(9))[1]).block_id == 1
    assert mgr.take_events() == []


def test_writing_into_a_cached_block_after_truncation_copies_it(mgr):
    tokens = toks(8)
    run_prefill(mgr, "a", tokens)  # blocks 0 1, both cached
    h = hashes(tokens)
    mgr.take_events()
    mgr.truncate("a", 6)  # keeps block 1, which is cached and immutable
    assert mgr.allocate_slots("a", 8) == [2]
    assert mgr.take_copy_ops() == [(1, 2)]
    assert mgr.get_block_ids("a") == [0, 2]
    assert mgr.block_pool.get_cached_block(h[1]).block_id == 1 and mgr.block_pool.blocks[1].ref_cnt == 0
    new_tokens = tokens[:6] + [50, 51]
    mgr.cache_blocks("a", hashes(new_tokens), 8, new_tokens)
    assert mgr.take_events() == [BlockStored([hashes(new_tokens)[1]], h[0], [4, 5, 50, 51], BS)]


def test_default_write_start_demands_truncate_after_rejection(mgr):
    mgr.allocate_slots("a", 9)
    with pytest.raises(ValueError, match="truncate"):
        mgr.allocate_slots("a", 6)
    assert mgr.allocate_slots("a", 6, num_computed_tokens=5) == []


def test_bad_calls_raise(mgr):
    run_prefill(mgr, "a", toks(9))
    blocks, _ = mgr.get_computed_blocks(hashes(toks(9)), 9)
    with pytest.raises(ValueError, match="first allocation"):
        mgr.allocate_slots("a", 12, blocks)
    with pytest.raises(ValueError, match="already holds"):
        mgr.fork("a", "a")
    with pytest.raises(ValueError, match="unknown request"):
        mgr.fork("x", "y")
    with pytest.raises(ValueError, match="unknown request"):
        mgr.truncate("x", 0)
    with pytest.raises(ValueError, match="unknown request"):
        mgr.cache_blocks("x", [], 0, [])


def test_can_fit_and_caching_disabled():
    mgr = make_manager(3, enable_caching=False)
    assert mgr.can_fit(12) and not mgr.can_fit(13)
    run_prefill(mgr, "a", toks(9))
    assert mgr.get_computed_blocks(hashes(toks(9)), 9) == ([], 0)
    assert mgr.take_events() == []
    mgr.check_integrity()


def test_integrity_check_catches_a_leaked_reference(mgr):
    mgr.allocate_slots("a", 4)
    mgr.block_pool.touch(mgr.block_pool.blocks[:1])
    with pytest.raises(RuntimeError, match=r"\(block_id, ref_cnt, tables \+ pins\): \[\(0, 2, 1\)\]"):
        mgr.check_integrity()
    mgr.block_pool.free_blocks(mgr.block_pool.blocks[:1])


class KVCacheMachine(RuleBasedStateMachine):
    """Random scheduler steps (admissions, decode/draft/prefill-chunk allocations and preemptions,
    then the copies, then the "forward") interleaved with forks, rollbacks, finishes and resets,
    against a fake KV store that holds one token id per slot.

    After every rule: each request reads its own computed tokens back through its block table,
    every cached block holds the tokens its hash names, replaying the events into an index gives
    exactly the cached hashes, and the integrity checks pass.
    """

    BS, NUM_BLOCKS, MAX_TOKENS = 2, 16, 10

    def __init__(self):
        super().__init__()
        self.mgr = KVCacheManager(BlockPool(self.NUM_BLOCKS), self.BS)
        self.kv = [[None] * self.BS for _ in range(self.NUM_BLOCKS)]
        self.reqs = {}  # request id -> [token_ids, num_computed_tokens, passes num_computed_tokens]
        self.block_tokens = {}  # hash -> the tokens of that block
        self.index = set()  # what a consumer of the events believes is cached
        self.next_id = 0

    def new_id(self):
        self.next_id += 1
        return f"r{self.next_id - 1}"

    def hashes(self, tokens):
        hs = hash_request_blocks(tokens, self.BS)
        for i, h in enumerate(hs):
            self.block_tokens[h] = tokens[i * self.BS:(i + 1) * self.BS]
        return hs

    def allocate(self, rid, num_new, lookahead):
        """The scheduling half of a step for one request; returns its write range or None."""
        tokens, num_computed, explicit = self.reqs[rid]
        new_computed = ()
        if num_computed == 0 and not self.mgr.get_block_ids(rid):  # (re)admission: reuse a prefix
            new_computed, num_computed = self.mgr.get_computed_blocks(self.hashes(tokens), len(tokens))
            assert num_computed < len(tokens)
            self.reqs[rid][1] = num_computed
        num_total = min(len(tokens), num_computed + num_new)
        before = snapshot(self.mgr, sorted(self.reqs))
        new_ids = self.mgr.allocate_slots(rid, num_total + lookahead, new_computed,
                                          num_computed_tokens=num_computed if explicit else None)
        if new_ids is None:
            assert snapshot(self.mgr, sorted(self.reqs)) == before
            self.reqs[rid][1] -= len(new_computed) * self.BS
            return None
        table = self.mgr.get_block_ids(rid)
        assert len(table) >= -(-(num_total + lookahead) // self.BS) and set(new_ids) <= set(table)
        return num_computed, num_total

    def preempt(self, rid):
        self.mgr.free(rid)
        self.reqs[rid][1] = 0

    @initialize(prompts=st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=9), min_size=1, max_size=4))
    def start(self, prompts):
        for i, prompt in enumerate(prompts):
            self.reqs[self.new_id()] = [prompt, 0, i % 2 == 1]

    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=9), explicit=st.booleans())
    def arrive(self, prompt, explicit):
        self.reqs[self.new_id()] = [prompt, 0, explicit]

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def step(self, data):
        """Schedule every request once, in a random order, preempting to make room."""
        scheduled = {}
        for rid in data.draw(st.permutations(sorted(self.reqs))):
            tokens, num_computed, explicit = self.reqs[rid]
            num_new = data.draw(st.integers(1, 4))
            if num_computed == len(tokens):  # decode: a sampled token plus draft tokens
                tokens.extend(data.draw(st.lists(st.integers(0, 1), min_size=num_new, max_size=num_new)))
            lookahead = data.draw(st.integers(0, 3)) if explicit else 0
            write_range = self.allocate(rid, num_new, lookahead)
            if write_range is None and data.draw(st.booleans()):
                victim = data.draw(st.sampled_from(sorted(self.reqs)))
                self.preempt(victim)
                scheduled.pop(victim, None)
                write_range = self.allocate(rid, num_new, lookahead) if victim != rid else None
            if write_range is not None:
                scheduled[rid] = write_range
        ops = self.mgr.take_copy_ops()
        dsts = [dst for _, dst in ops]
        assert len(set(dsts)) == len(dsts) and not set(dsts) & {src for src, _ in ops}
        for src, dst in ops:  # safe in any order, as in the parallel kernel
            self.kv[dst] = list(self.kv[src])
        for rid, (num_computed, num_total) in scheduled.items():
            tokens = self.reqs[rid][0]
            table = self.mgr.get_block_ids(rid)
            for pos in range(num_computed, num_total):
                self.kv[table[pos // self.BS]][pos % self.BS] = tokens[pos]
            self.reqs[rid][1] = num_total
            self.mgr.cache_blocks(rid, self.hashes(tokens), num_total, tokens)
            if num_total >= self.MAX_TOKENS:
                self.finish_request(rid)
        if self.reqs and data.draw(st.booleans()):  # n > 1 sampling forks after a step
            self.fork(data, num_children=1)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), num_children=st.integers(1, 2))
    def fork_rule(self, data, num_children):
        self.fork(data, num_children)

    def fork(self, data, num_children):
        parent = data.draw(st.sampled_from(sorted(self.reqs)))
        tokens, num_computed, explicit = self.reqs[parent]
        for _ in range(num_children):
            child = self.new_id()
            self.reqs[child] = [list(tokens), num_computed, explicit]
            if num_computed or self.mgr.get_block_ids(parent):
                self.mgr.fork(parent, child)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def reject_drafts(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        tokens, num_computed, explicit = self.reqs[rid]
        if not self.mgr.get_block_ids(rid):
            return
        keep = data.draw(st.integers(0, num_computed))
        self.mgr.truncate(rid, keep)
        self.reqs[rid] = [tokens[:keep], keep, explicit]

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data):
        self.finish_request(data.draw(st.sampled_from(sorted(self.reqs))))

    def finish_request(self, rid):
        self.mgr.free(rid)
        del self.reqs[rid]

    @rule()
    def reset_prefix_cache(self):
        self.mgr.reset_prefix_cache()

    @invariant()
    def consistent(self):
        for event in self.mgr.take_events():
            if isinstance(event, BlockStored):
                assert not self.index & set(event.block_hashes)
                self.index |= set(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.index
                self.index -= set(event.block_hashes)
            else:
                assert isinstance(event, AllBlocksCleared)
                self.index.clear()
        cached = {b.block_hash: b.block_id for b in self.mgr.block_pool.blocks if b.block_hash is not None}
        assert self.index == set(cached)
        for block_hash, block_id in cached.items():
            assert self.kv[block_id] == self.block_tokens[block_hash]
        for rid, (tokens, num_computed, _) in self.reqs.items():
            table = self.mgr.get_block_ids(rid)
            assert [self.kv[table[p // self.BS]][p % self.BS] for p in range(num_computed)] == tokens[:num_computed]
        self.mgr.check_integrity()


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])


# The KV tensor.

TINY = ModelConfig(architecture="llama", vocab_size=32, hidden_size=16, intermediate_size=32,
                   num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, name="tiny")


def test_storage_shapes_and_views():
    cache_config = CacheConfig(block_size=4, num_blocks=5, dtype="float16")
    assert bytes_per_block(TINY, cache_config) == 3 * 2 * 4 * 2 * 8 * 2
    kv = allocate_kv_cache(TINY, cache_config, "cpu")
    assert kv.shape == (5, 3, 2, 4, 2, 8) and kv.dtype == torch.float16 and not kv.any()
    key, value = layer_kv(kv, 1)
    assert key.shape == value.shape == (5, 4, 2, 8)
    key[2, 3] = 1.0
    value[2, 3] = 2.0
    assert kv[2, 1, 0, 3].eq(1).all() and kv[2, 1, 1, 3].eq(2).all() and kv.sum() == 3 * 16
    assert kv[2].is_contiguous()  # one block, all layers: one region
    with pytest.raises(ValueError, match="num_blocks, num_layers, 2"):
        layer_kv(key, 0)


def test_budget_sizing():
    block_bytes = 3 * 2 * 16 * 2 * 8 * 4
    assert num_blocks_for_budget(TINY, CacheConfig(memory_budget_bytes=10 * block_bytes + 1)) == 10
    assert num_blocks_for_budget(TINY, CacheConfig(), budget_bytes=3 * block_bytes) == 3
    assert num_blocks_for_budget(TINY, CacheConfig(num_blocks=7, memory_budget_bytes=1)) == 7
    with pytest.raises(ConfigError, match=f"needs {block_bytes} bytes"):
        num_blocks_for_budget(TINY, CacheConfig(memory_budget_bytes=block_bytes - 1))
    with pytest.raises(ConfigError, match="fits no block"):
        allocate_kv_cache(TINY, CacheConfig(memory_budget_bytes=100), "cpu")

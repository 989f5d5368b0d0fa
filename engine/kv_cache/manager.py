"""Per-request block tables over a BlockPool, with vLLM-v1 style token accounting.

A request owns a block table (``get_block_ids``) covering its computed tokens plus the tokens
scheduled this step. The scheduler drives it:

    blocks, num_hit_tokens = manager.get_computed_blocks(block_hashes, num_tokens)   # new request
    new_block_ids = manager.allocate_slots(rid, num_hit_tokens + num_scheduled, blocks)
    if new_block_ids is None: ...preempt someone (or wait) and retry...
    copy_ops = manager.take_copy_ops()            # runner copies these blocks before the forward
    ...forward...
    manager.cache_blocks(rid, block_hashes, num_computed_tokens, token_ids)
    manager.truncate(rid, num_computed_tokens)    # after rejected draft tokens
    manager.free(rid)                             # finished, aborted or preempted

Copy-on-write: a block is written in place only if this request is its sole owner and it is
not in the prefix cache (cached contents are immutable). ``allocate_slots`` replaces any other
block that will receive tokens this step with a fresh one, and when the old block holds computed
tokens it queues a (src, dst) copy. Shared blocks come from ``fork`` (n > 1 samples), cached ones
from prefix hits or a ``truncate`` into a cached block. Until ``take_copy_ops`` both ends of a
queued copy are pinned (an extra reference), so a preemption or free later in the same step
cannot hand either block to someone else: the copies of one step never overlap.

A block a copy is being written into (a host-tier load) is held (``hold_blocks``) until the copy
lands, so freeing or aborting its request cannot hand it to someone else meanwhile.

The manager must be the pool's only client: ``check_integrity`` matches every block's ref_cnt
against the tables, the copy pins and the holds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from engine.kv_cache.block_pool import BlockPool, KVBlock
from engine.kv_cache.events import KVCacheEvent
from engine.kv_cache.hashing import BlockHash
from engine.mathutils import cdiv


@dataclass(slots=True)
class _RequestBlocks:
    blocks: list[KVBlock]
    num_cached_blocks: int  # leading blocks already offered to the prefix cache
    num_tokens: int  # tokens the table was last allocated for, lowered by truncate
    table: tuple[int, ...] | None = None  # the blocks' ids, built once per change (block_table)


class KVCacheManager:
    """Block tables keyed by request id. Running out of blocks is a None return, never an error;
    exceptions mean a caller bug (unknown request, inconsistent arguments)."""

    def __init__(self, block_pool: BlockPool, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_pool = block_pool
        self.block_size = block_size
        self._requests: dict[str, _RequestBlocks] = {}
        self._copy_ops: list[tuple[KVBlock, KVBlock]] = []  # (src, dst), both pinned
        self._num_pins: Counter[int] = Counter()  # block_id -> references held by _copy_ops
        self._num_holds: Counter[int] = Counter()  # block_id -> references held by ``hold_blocks``

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` could ever fit, with the whole pool to itself."""
        return cdiv(num_tokens, self.block_size) <= self.block_pool.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table ([] for an unknown request)."""
        return list(self.block_table(request_id))

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """``get_block_ids`` as a tuple that stays the same object until the table changes: a
        step's staging converts a table it has seen before only once (``DecodeBuffers``)."""
        state = self._requests.get(request_id)
        if state is None:
            return ()
        if state.table is None:
            state.table = tuple([b.block_id for b in state.blocks])
        return state.table

    def get_computed_blocks(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of full blocks, and the number of tokens it covers.

        Stops short of the whole prompt: the last token is always recomputed so the step has
        logits for it. Takes no reference; pass the blocks to ``allocate_slots`` before
        anything else allocates from the pool.
        """
        if not self.block_pool.enable_caching or num_tokens <= 1:
            return [], 0
        computed: list[KVBlock] = []
        for block_hash in block_hashes[:(num_tokens - 1) // self.block_size]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed.append(block)
        return computed, len(computed) * self.block_size

    def allocate_slots(self, request_id: str, num_total_tokens: int,
                       new_computed_blocks: Sequence[KVBlock] = (),
                       num_computed_tokens: int | None = None) -> list[int] | None:
        """Make the request own blocks for ``num_total_tokens`` (computed + scheduled this step,
        draft tokens included), copying-on-write any shared or cached block to be written.

        ``new_computed_blocks`` (from ``get_computed_blocks``) are only for a request that holds no
        blocks yet. ``num_computed_tokens`` is where this step's writes start, counting the tokens
        of ``new_computed_blocks``; by default it is the ``num_total_tokens`` of the previous
        allocation (lowered by ``truncate``), or the hit tokens for a new request.

        Returns the ids of blocks taken from the pool, in table order (copy-on-write replacements,
        then appended blocks), or None, changing nothing, when the pool cannot supply them.
        """
        bs = self.block_size
        state = self._requests.get(request_id)
        blocks = state.blocks if state else []
        if new_computed_blocks and blocks:
            raise ValueError(f"request {request_id!r} already holds {len(blocks)} blocks; "
                             f"new_computed_blocks are only for its first allocation")
        if num_computed_tokens is None:
            num_computed_tokens = (state.num_tokens if state is not None and blocks
                                   else len(new_computed_blocks) * bs)
        if not 0 <= num_computed_tokens <= num_total_tokens:
            raise ValueError(f"request {request_id!r}: num_computed_tokens={num_computed_tokens} "
                             f"must be in [0, num_total_tokens={num_total_tokens}] (pass it explicitly, "
                             f"or truncate() the request after rejecting draft tokens)")

        num_required = cdiv(num_total_tokens, bs)
        if state is not None and num_required <= len(blocks) and not new_computed_blocks:
            # the tokens land in blocks it has (a decode step's, 15 of 16): nothing to do when
            # each is its own alone (one reference: no other table, pin or hold) and uncached
            for i in range(num_computed_tokens // bs, num_required):
                if blocks[i].ref_cnt != 1 or blocks[i].block_hash is not None:
                    break
            else:
                state.num_tokens = num_total_tokens
                return []
        num_appended = max(0, num_required - len(blocks) - len(new_computed_blocks))
        cow_indices = [i for i in range(num_computed_tokens // bs, min(num_required, len(blocks)))
                       if self._is_shared(blocks[i]) or blocks[i].block_hash is not None]
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)  # leave the free queue
        if num_appended + len(cow_indices) + num_revived > self.block_pool.num_free_blocks:
            return None

        if state is None:
            state = self._requests[request_id] = _RequestBlocks(blocks, len(new_computed_blocks), 0)
        elif not (num_appended or cow_indices or new_computed_blocks):  # a token in a block it owns
            state.num_tokens = num_total_tokens
            return []
        state.table = None  # changes below
        # Touch before allocating, so the pool cannot evict a block we are about to reuse.
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        fresh = self.block_pool.get_new_blocks(len(cow_indices) + num_appended)
        for i, new_block in zip(cow_indices, fresh):
            old_block, blocks[i] = blocks[i], new_block
            if i * bs < num_computed_tokens:
                self.block_pool.touch([old_block, new_block])
                self._num_pins.update((old_block.block_id, new_block.block_id))
                self._copy_ops.append((old_block, new_block))
            state.num_cached_blocks = min(state.num_cached_blocks, i)
            self.block_pool.free_blocks([old_block])
        blocks.extend(fresh[len(cow_indices):])
        state.num_tokens = num_total_tokens
        return [b.block_id for b in fresh]

    def take_copy_ops(self) -> list[tuple[int, int]]:
        """Drain the (src_block_id, dst_block_id) copies queued by copy-on-write, oldest first.

        The runner applies them before the forward of the step that queued them. The dst ids are
        distinct and none is also a src, so the copies may run in parallel. Taking them releases
        the pins: call this once per step, after the last ``allocate_slots``.
        """
        copy_ops, self._copy_ops = self._copy_ops, []
        for src, dst in copy_ops:
            self.block_pool.free_blocks([dst, src])
        self._num_pins.clear()
        return [(src.block_id, dst.block_id) for src, dst in copy_ops]

    def cache_blocks(self, request_id: str, block_hashes: Sequence[BlockHash], num_computed_tokens: int,
                     token_ids: Sequence[int]) -> None:
        """Offer the request's blocks that are full of computed tokens to the prefix cache, once each.

        ``block_hashes`` are the request's full-block hashes (at least as many as the computed
        full blocks to be cached; blocks without a hash yet are offered by a later call).
        """
        state = self._require(request_id)
        if not self.block_pool.enable_caching:
            return
        bs = self.block_size
        num_full = min(num_computed_tokens // bs, len(block_hashes), len(state.blocks))
        for i in range(state.num_cached_blocks, num_full):
            parent = block_hashes[i - 1] if i > 0 else None
            self.block_pool.cache_full_block(state.blocks[i], block_hashes[i], parent,
                                             token_ids[i * bs:(i + 1) * bs])
        state.num_cached_blocks = max(state.num_cached_blocks, num_full)

    def truncate(self, request_id: str, num_tokens: int) -> list[int]:
        """Keep only the blocks ``num_tokens`` need (speculative rollback); returns the freed ids.

        Dropped blocks go to the free queue tail-first; cached ones stay cached.
        """
        state = self._require(request_id)
        num_kept = cdiv(max(num_tokens, 0), self.block_size)
        dropped = state.blocks[num_kept:]
        del state.blocks[num_kept:]
        if dropped:
            state.table = None
        self.block_pool.free_blocks(reversed(dropped))
        state.num_cached_blocks = min(state.num_cached_blocks, num_kept)
        state.num_tokens = min(state.num_tokens, num_tokens)
        return [b.block_id for b in dropped]

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's table, sharing every block (for n > 1 samples).
        Neither writes a shared block in place: ``allocate_slots`` copies it first.
        Fork between steps: not while copies queued by this step are still to be taken."""
        parent = self._require(parent_id)
        if child_id in self._requests:
            raise ValueError(f"cannot fork into {child_id!r}: it already holds blocks")
        if self._copy_ops:
            raise RuntimeError(f"fork({parent_id!r}, {child_id!r}) while {len(self._copy_ops)} copy-on-write "
                               f"ops are pending: call take_copy_ops() (end of schedule) first")
        self.block_pool.touch(parent.blocks)
        self._requests[child_id] = _RequestBlocks(list(parent.blocks), parent.num_cached_blocks,
                                                  parent.num_tokens)

    def free(self, request_id: str) -> None:
        """Release all the request's blocks, its last block first (so it is evicted first).
        An unknown id is a no-op (a request aborted before it got blocks)."""
        state = self._requests.pop(request_id, None)
        if state is not None:
            self.block_pool.free_blocks(reversed(state.blocks))

    def hold_blocks(self, block_ids: Sequence[int]) -> None:
        """Take an extra reference on each block (a copy into it is in flight): a free or an
        abort of its request leaves it out of the free queue until ``release_blocks``."""
        self.block_pool.touch(self.block_pool.blocks[i] for i in block_ids)
        self._num_holds.update(block_ids)

    def release_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop the references of ``hold_blocks``, last block first."""
        for block_id in block_ids:
            if self._num_holds[block_id] <= 0:
                raise RuntimeError(f"releasing block {block_id} which is not held")
            self._num_holds[block_id] -= 1
        self._num_holds += Counter()  # drop zero counts
        self.block_pool.free_blocks(self.block_pool.blocks[i] for i in reversed(block_ids))

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def cached_block_hashes(self) -> list[BlockHash]:
        return self.block_pool.cached_block_hashes()

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Pool invariants, plus: each block's ref_cnt equals the tables holding it plus its pins."""
        self.block_pool.check_integrity()
        refs = Counter(b.block_id for state in self._requests.values() for b in state.blocks)
        refs.update(self._num_pins)
        refs.update(self._num_holds)
        wrong = [(b.block_id, b.ref_cnt, refs[b.block_id]) for b in self.block_pool.blocks
                 if b.ref_cnt != refs[b.block_id]]
        if wrong:
            raise RuntimeError(f"{len(wrong)} blocks have ref_cnt != tables holding them + copy pins "
                               f"(load holds count as pins) (block_id, ref_cnt, tables + pins): {wrong[:10]}")
        for request_id, state in self._requests.items():
            ids = [b.block_id for b in state.blocks]
            if state.table is not None and list(state.table) != ids:
                raise RuntimeError(f"request {request_id!r}: its cached table {state.table} is not "
                                   f"its blocks' ids {ids}")
            if len(set(ids)) != len(ids) or state.num_cached_blocks > len(ids):
                raise RuntimeError(f"request {request_id!r}: table {ids} repeats a block or "
                                   f"num_cached_blocks={state.num_cached_blocks} exceeds its length")

    def _is_shared(self, block: KVBlock) -> bool:
        return block.ref_cnt - self._num_pins[block.block_id] - self._num_holds[block.block_id] > 1

    def _require(self, request_id: str) -> _RequestBlocks:
        state = self._requests.get(request_id)
        if state is None:
            raise ValueError(f"unknown request {request_id!r}: it holds no blocks")
        return state

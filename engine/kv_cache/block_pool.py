"""The block pool: ref counts, the LRU free queue and the prefix-cache hash map.

Invariants (``check_integrity`` verifies them and raises with the numbers):

- a block is in the free queue exactly when its ``ref_cnt`` is 0, so free + in use == total;
- a free block may still carry a hash: it is *cached* and reusable by a prefix hit (``touch``)
  until allocation pops it from the head of the queue, which evicts it (``BlockRemoved``);
- the hash map holds each hash once, and its block carries that hash (the first block cached
  under a hash keeps it; a later block with the same content stays unhashed);
- a cached block's contents are immutable: writers copy it first (see ``KVCacheManager``).

The queue's head is the eviction end. Freed blocks join the tail in the order given, so callers
free a sequence's blocks in reverse (its tail is evicted before its shared prefix).

An *offloader* (``set_offloader``; the host tier) copies cached blocks down before they are
evicted, off the engine thread. Each free cached block is, to it, ``READY`` (evictable now: its
bytes are below, or will not be kept), ``NEEDS_COPY`` or ``IN_FLIGHT`` (its copy runs). An
in-flight block is never handed out: ``get_new_blocks`` takes free blocks from the head that
are ready, starts the copies of the ``NEEDS_COPY`` ones it passes (they stay cached, so a prefix
hit may still take them), and only when nothing else is free waits for a copy to finish. The
offloader announces ``Stored`` on its tier when a copy lands, so that event precedes the pool's
``BlockRemoved`` of the block. ``offload_ahead`` starts the copies of the blocks at the head
before anyone asks for them, so that the next allocation finds them ready.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from engine.kv_cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from engine.kv_cache.hashing import BlockHash


@dataclass(slots=True, eq=False)
class KVBlock:
    """One block of the paged cache; ``prev_free``/``next_free`` link it into the free queue."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None  # of a cached block: its parent (None: a sequence's first)
    token_ids: tuple[int, ...] = ()  # of a cached block: its tokens
    prev_free: KVBlock | None = None
    next_free: KVBlock | None = None

    def __repr__(self) -> str:
        cached = f", hash={self.block_hash.hex()[:8]}" if self.block_hash is not None else ""
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}{cached})"


class _FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels; every operation is O(1)."""

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self._head, self._tail = KVBlock(-1), KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_blocks = 0
        self.version = 0  # changes with every append and remove
        for block in blocks:
            self.append(block)

    # Between the sentinels every link is set: the ``assert``s below only tell the type checker.

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        block.prev_free, block.next_free = last, self._tail
        last.next_free = self._tail.prev_free = block
        self.num_blocks += 1
        self.version += 1

    def remove(self, block: KVBlock) -> None:
        prev, next_ = block.prev_free, block.next_free
        assert prev is not None and next_ is not None
        prev.next_free, next_.prev_free = next_, prev
        block.prev_free = block.next_free = None
        self.num_blocks -= 1
        self.version += 1

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def first(self) -> KVBlock | None:
        """The head (next to evict), or None when empty."""
        block = self._head.next_free
        return None if block is self._tail else block

    def after(self, block: KVBlock) -> KVBlock | None:
        """The block behind ``block`` (towards the tail), or None at the end."""
        nxt = block.next_free
        return None if nxt is self._tail else nxt

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """``num_blocks`` blocks with ids 0..num_blocks-1. Exceptions here mean a caller bug;
    running out is the caller's check (``num_free_blocks``) before ``get_new_blocks``.

    With ``enable_caching=False`` no block is ever hashed, so nothing is reused and no events
    are queued. With ``enable_events=False`` the cache works but nothing is queued (for
    processes that have nobody to drain events, e.g. the offline ``LLM``).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, enable_events: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_events = enable_events and enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free = _FreeBlockQueue(self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self._events: list[KVCacheEvent] = []
        self._offloader: Offloader | None = None
        self.num_stored_blocks = 0  # hashes ever cached (BlockStored), for stats
        self.num_evicted_blocks = 0  # cached blocks ever evicted for reuse (BlockRemoved)

    def set_offloader(self, offloader: Offloader | None) -> None:
        """Who copies cached blocks down before they are evicted (see the module docstring),
        or nobody (None: evicted blocks are simply dropped)."""
        self._offloader = offloader

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0, cached ones included (they are evictable)."""
        return self._free.num_blocks

    @property
    def free_queue_version(self) -> int:
        """Changes whenever a block joins or leaves the free queue (its order changes no other way)."""
        return self._free.version

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - self._free.num_blocks / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """The free queue from its eviction end (head) to its tail, for tests and debugging. O(n)."""
        return [b.block_id for b in self._free]

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` free blocks with ref_cnt 1, evicting any hash they carry: the
        ready ones nearest the LRU head, skipping those whose copy down is in flight (see the
        module docstring; without an offloader, exactly the head ``num_blocks``)."""
        if num_blocks > self._free.num_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self._free.num_blocks} free")
        new_blocks: list[KVBlock] = []
        # A round takes blocks, or starts copies, or waits for one to land: each is progress.
        for _ in range(2 * (num_blocks + self.num_blocks) + 2):
            has_started = self._take_ready(num_blocks, new_blocks)
            if len(new_blocks) == num_blocks:
                break
            if not has_started:
                assert self._offloader is not None  # only it leaves free blocks unready
                self._offloader.wait_for_offload()
        else:
            raise RuntimeError(f"block pool: no progress taking {num_blocks} blocks "
                               f"({len(new_blocks)} taken, {self._free.num_blocks} free)")
        evicted = [b for b in new_blocks if b.block_hash is not None]
        if evicted and self._offloader is not None:
            self._offloader.on_evict(evicted)
        for block in evicted:
            assert block.block_hash is not None
            del self._cached[block.block_hash]
            self._queue_event(BlockRemoved([block.block_hash]))
            block.block_hash, block.parent_hash, block.token_ids = None, None, ()
        self.num_evicted_blocks += len(evicted)
        for block in new_blocks:
            block.ref_cnt = 1
        return new_blocks

    def _take_ready(self, num_blocks: int, taken: list[KVBlock]) -> bool:
        """Move ready free blocks from the head into ``taken`` until it holds ``num_blocks``, and
        start the copies of blocks passed that need one, as many as the blocks already taken or
        in flight leave short. The walk stops at the first block needing a copy once that
        shortfall is covered, so it visits at most ``num_blocks`` plus the in-flight blocks.
        Returns whether it started copies."""
        offloader = self._offloader
        to_copy: list[KVBlock] = []
        num_in_flight = 0
        block = self._free.first()
        while block is not None and len(taken) < num_blocks:
            nxt = self._free.after(block)
            state = EvictionState.READY if offloader is None else offloader.eviction_state(block)
            if state == EvictionState.READY:
                self._free.remove(block)
                taken.append(block)
            elif state == EvictionState.IN_FLIGHT:
                num_in_flight += 1
            elif len(taken) + len(to_copy) + num_in_flight < num_blocks:
                to_copy.append(block)
            else:
                break
            block = nxt
        if to_copy and offloader is not None:
            offloader.start_offload(to_copy)
        return bool(to_copy)

    def offload_ahead(self, num_blocks: int) -> None:
        """Start copying down the cached blocks among the ``num_blocks`` free ones at the head
        that need it, so that the allocations to come find them ready."""
        offloader = self._offloader
        if offloader is None or num_blocks <= 0:
            return
        to_copy: list[KVBlock] = []
        block = self._free.first()
        for _ in range(num_blocks):
            if block is None:
                break
            if offloader.eviction_state(block) == EvictionState.NEEDS_COPY:
                to_copy.append(block)
            block = self._free.after(block)
        if to_copy:
            offloader.start_offload(to_copy)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block; a free (cached) block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._free.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in order; blocks reaching 0 join the queue's tail."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"freeing {block} which has no references (double free)")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free.append(block)

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash, parent_hash: BlockHash | None,
                         token_ids: Sequence[int]) -> bool:
        """Register a full, in-use block under ``block_hash``. Returns whether it was stored.

        Not stored (False): caching disabled, the block already carries this hash, or another
        block already holds the hash (the first one keeps it). ``parent_hash`` is None for a
        sequence's first block. ``block_size`` of the event is ``len(token_ids)``.
        """
        if not self.enable_caching:
            return False
        if block.ref_cnt <= 0:
            raise RuntimeError(f"caching {block} which no request holds")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise RuntimeError(f"{block} is already cached under a different hash")
            return False
        if block_hash in self._cached:
            return False
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, tuple(token_ids)
        self._cached[block_hash] = block
        self.num_stored_blocks += 1
        self._queue_event(BlockStored([block_hash], parent_hash, list(token_ids), len(token_ids)))
        return True

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        """The block holding ``block_hash`` (in use or free), or None. Does not take a reference."""
        return self._cached.get(block_hash)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a hash (in use or free)."""
        return len(self._cached)

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every hash this pool holds now (in use or free), in no particular order."""
        return list(self._cached)

    def queue_event(self, event: KVCacheEvent) -> None:
        """Queue another tier's event into this pool's stream, so that one drain sees every tier
        in the order things happened (runs are coalesced as for this pool's own events)."""
        self._queue_event(event)

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the queued events, oldest first."""
        events, self._events = self._events, []
        return events

    def reset_prefix_cache(self) -> None:
        """Forget every hash. Blocks keep their contents and owners; nothing cached is reused."""
        for block in self._cached.values():
            block.block_hash, block.parent_hash, block.token_ids = None, None, ()
        self._cached.clear()
        if self.enable_events:
            self._events.append(AllBlocksCleared())

    def check_integrity(self) -> None:
        """Raise RuntimeError, with the numbers, if an invariant of this module is broken."""
        free = list(self._free)
        free_ids = {b.block_id for b in free}
        zero_ref_ids = {b.block_id for b in self.blocks if b.ref_cnt == 0}
        num_in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        negative = [b for b in self.blocks if b.ref_cnt < 0]
        if (len(free) != self._free.num_blocks or len(free_ids) != len(free)
                or free_ids != zero_ref_ids or negative or len(free) + num_in_use != self.num_blocks):
            raise RuntimeError(
                f"block pool inconsistent: free queue walks {len(free)} blocks ({len(free_ids)} distinct), "
                f"counter says {self._free.num_blocks}, {len(zero_ref_ids)} blocks have ref_cnt 0, "
                f"{num_in_use} in use, {len(negative)} negative, total {self.num_blocks}; "
                f"in queue but referenced: {sorted(free_ids - zero_ref_ids)}, "
                f"unreferenced but not in queue: {sorted(zero_ref_ids - free_ids)}")
        hashed = {b.block_id for b in self.blocks if b.block_hash is not None}
        mapped = {b.block_id for h, b in self._cached.items() if b.block_hash == h}
        if hashed != mapped or len(mapped) != len(self._cached):
            raise RuntimeError(
                f"prefix cache inconsistent: {len(self._cached)} hash-map entries, {len(mapped)} point to "
                f"a block carrying that hash, {len(hashed)} blocks carry a hash; "
                f"hashed but unmapped: {sorted(hashed - mapped)}")

    def _queue_event(self, event: KVCacheEvent) -> None:
        # Coalesce runs: a chain of stored blocks (or a burst of evictions) becomes one event.
        if not self.enable_events:
            return
        last = self._events[-1] if self._events else None
        if isinstance(event, BlockRemoved) and isinstance(last, BlockRemoved) and event.tier == last.tier:
            self._events[-1] = replace(last, block_hashes=last.block_hashes + event.block_hashes)
        elif (isinstance(event, BlockStored) and isinstance(last, BlockStored) and event.tier == last.tier
              and event.parent_block_hash == last.block_hashes[-1] and event.block_size == last.block_size):
            self._events[-1] = replace(last, block_hashes=last.block_hashes + event.block_hashes,
                                       token_ids=last.token_ids + event.token_ids)
        else:
            self._events.append(event)


class EvictionState(enum.Enum):
    """What evicting one free block would take, as its offloader sees it."""

    READY = "ready"  # nothing: uncached, already below, or not to be kept
    NEEDS_COPY = "needs_copy"  # its bytes must be copied down first
    IN_FLIGHT = "in_flight"  # its copy down runs: neither hand it out nor write it


class Offloader(Protocol):
    """Copies cached blocks down before the pool evicts them (the host tier). Its methods
    must not call back into the pool except through the blocks' fields they read."""

    def eviction_state(self, block: KVBlock) -> EvictionState:
        """The state of a free block (uncached ones are READY unless a copy still reads them)."""
        ...

    def start_offload(self, blocks: list[KVBlock]) -> None:
        """Start copying these NEEDS_COPY cached blocks down (each becomes IN_FLIGHT, then
        READY once its copy landed or failed)."""
        ...

    def wait_for_offload(self) -> None:
        """Block until at least one copy in flight is over and settled (its blocks READY)."""
        ...

    def on_evict(self, blocks: list[KVBlock]) -> None:
        """These READY cached blocks are evicted now (they still carry hash, parent, tokens)."""
        ...

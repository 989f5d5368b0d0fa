"""The host tier's block store: one preallocated host tensor, a hash -> slot map and an LRU.

Layout: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, the device cache's
(``CacheConfig``), so one block is one contiguous region (one memcpy, one NIXL descriptor) and
a run of consecutive slots is one copy. The tensor is pinned for a CUDA device cache (DMA
host<->device copies; ``pin_memory`` None: whenever CUDA is available), plain memory otherwise;
``torch.empty``, so on a CPU untouched slots cost no memory.

Invariants (``check_integrity`` verifies them and raises with the numbers):

- every slot is either free or held by exactly one entry: free + cached == num_blocks;
- the map holds each hash once, and its entry names its own hash;
- a pinned entry (``num_pins > 0``) is never evicted; a pin lasts while a copy that reads or
  writes its slot is in flight (``engine/kv_cache/tiers/host_tier.py`` says which, at any moment);
- an entry is *ready* once its bytes are there (``commit``); until then it is pinned, invisible
  to ``match_prefix``, ``cached_block_hashes`` and ``num_cached_blocks``, and announced nowhere.

Events go to ``event_sink`` in the order things happened: ``BlockStored(HOST)`` with the parent
and token ids when an entry is committed (its bytes have landed), ``BlockRemoved(HOST)`` when
the LRU evicts a ready entry or a bad one is discarded, and ``AllBlocksCleared(HOST)`` on
``clear``. An evicted entry is first offered, with its bytes, to ``on_evict`` (the next tier
down, see ``engine/kv_cache/tiers/lower_tier.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice

import numpy as np
import torch

from engine.kv_cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    Tier,
)
from engine.kv_cache.hashing import BlockHash
from engine.kv_cache.tiers.lower_tier import EvictedBlock


@dataclass(slots=True, eq=False)
class HostEntry:
    """One cached block on the host: where it lives and what it is (for events and lower tiers)."""

    slot: int
    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    num_pins: int = 0  # copies in flight (or admissions in progress) that read or write this slot
    is_ready: bool = False  # its bytes are there and it was announced (``commit``)


def copy_block_runs(dst: torch.Tensor, dst_ids: Sequence[int], src: torch.Tensor,
                    src_ids: Sequence[int]) -> None:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for every i, one slice copy per run of pairs whose
    ids both go up by one (a chain that was allocated together copies as one memcpy).

    ``dst``/``src``: ``[num_blocks, ...]`` with equal block shapes; ids must not overlap within
    one tensor when ``dst is src``. Between two contiguous CPU tensors the runs are copied with
    numpy (a plain memcpy on the calling thread): torch's ``copy_`` opens an OpenMP region per
    call, and on the 2-core dev machine with the other core busy one 737 KB block then took
    12.8 ms instead of 0.2 ms (measured with 2 threads; 1 thread or numpy: 0.03-0.2 ms per
    block, so a step that offloads a few blocks costs well under a millisecond).
    """
    if len(dst_ids) != len(src_ids):
        raise ValueError(f"{len(dst_ids)} destination blocks for {len(src_ids)} source blocks")
    copy_run = _run_copier(dst, src)
    i, n = 0, len(dst_ids)
    while i < n:
        j = i + 1
        while j < n and dst_ids[j] == dst_ids[j - 1] + 1 and src_ids[j] == src_ids[j - 1] + 1:
            j += 1
        copy_run(dst_ids[i], src_ids[i], j - i)
        i = j


def _run_copier(dst: torch.Tensor, src: torch.Tensor) -> Callable[[int, int, int], None]:
    """``copy(d, s, n)``: blocks ``src[s:s+n]`` into ``dst[d:d+n]``."""
    if dst.device.type == src.device.type == "cpu" and dst.is_contiguous() and src.is_contiguous():
        dst_bytes, src_bytes = _byte_rows(dst), _byte_rows(src)

        def copy_numpy(d: int, s: int, n: int) -> None:
            np.copyto(dst_bytes[d:d + n], src_bytes[s:s + n])
        return copy_numpy

    def copy_torch(d: int, s: int, n: int) -> None:
        dst[d:d + n].copy_(src[s:s + n])
    return copy_torch


def _byte_rows(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor as ``[num_blocks, block_bytes]`` uint8, sharing its memory (any
    dtype, bfloat16 included, which numpy cannot view directly)."""
    return t.reshape(t.shape[0], -1).view(torch.uint8).numpy()


class HostBlockPool:
    """``num_blocks`` host slots holding cached blocks by hash, evicted least recently used first.

    Exceptions mean a caller bug; a full pool whose every entry is pinned makes ``reserve``
    return None (the block is simply not kept)."""

    def __init__(self, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 event_sink: Callable[[KVCacheEvent], None] | None = None,
                 on_evict: Callable[[list[EvictedBlock]], None] | None = None,
                 pin_memory: bool | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.num_blocks = num_blocks
        self.kv_cache = torch.empty((num_blocks, *block_shape), dtype=dtype, pin_memory=pin_memory)
        self.block_bytes = self.kv_cache[0].numel() * self.kv_cache.element_size()
        self._entries: OrderedDict[BlockHash, HostEntry] = OrderedDict()  # LRU first
        self._free_slots = list(range(num_blocks - 1, -1, -1))  # pop() gives the lowest slot
        self._num_ready = 0
        self.version = 0  # changes whenever a hash is added or removed
        self._events: list[KVCacheEvent] = []
        self._sink = event_sink if event_sink is not None else self._events.append
        self._on_evict = on_evict
        self.num_stored_blocks = 0
        self.num_evicted_blocks = 0

    def set_eviction_listener(self, on_evict: Callable[[list[EvictedBlock]], None] | None) -> None:
        """Who is offered the blocks the LRU evicts (``on_evict`` of the constructor)."""
        self._on_evict = on_evict

    @property
    def num_cached_blocks(self) -> int:
        """Ready entries (announced as stored). One read: safe from another thread (stats)."""
        return self._num_ready

    def get(self, block_hash: BlockHash) -> HostEntry | None:
        """The entry holding ``block_hash``, or None. Does not touch the LRU."""
        return self._entries.get(block_hash)

    def match_prefix(self, block_hashes: Sequence[BlockHash]) -> list[HostEntry]:
        """The ready entries of the leading run of ``block_hashes`` held here (stops at the first
        miss, or at an entry whose bytes are still on their way)."""
        run: list[HostEntry] = []
        for block_hash in block_hashes:
            entry = self._entries.get(block_hash)
            if entry is None or not entry.is_ready:
                break
            run.append(entry)
        return run

    def touch(self, entries: Sequence[HostEntry]) -> None:
        """Mark entries most recently used, in order (the last one is evicted last)."""
        for entry in entries:
            self._entries.move_to_end(entry.block_hash)

    def pin(self, entries: Sequence[HostEntry]) -> None:
        for entry in entries:
            entry.num_pins += 1

    def unpin(self, entries: Sequence[HostEntry]) -> None:
        for entry in entries:
            if entry.num_pins <= 0:
                raise RuntimeError(f"unpinning host slot {entry.slot} which is not pinned")
            entry.num_pins -= 1

    def reserve(self, block_hash: BlockHash, parent_hash: BlockHash | None,
                token_ids: Sequence[int]) -> HostEntry | None:
        """A new, not yet ready entry for ``block_hash`` whose slot the caller fills and then
        ``commit``s (or ``discard``s when the copy failed); it comes back pinned. Evicts the LRU
        unpinned entry if no slot is free. Returns None when the hash is already here (touched
        instead: nothing to copy) or every entry is pinned. Queues nothing."""
        existing = self._entries.get(block_hash)
        if existing is not None:
            self._entries.move_to_end(block_hash)
            return None
        if not self._free_slots and not self._evict(1):
            return None
        entry = HostEntry(self._free_slots.pop(), block_hash, parent_hash, tuple(token_ids), num_pins=1)
        self._entries[block_hash] = entry
        self.version += 1
        return entry

    def commit(self, entries: Sequence[HostEntry]) -> None:
        """The reserved entries' bytes have landed: unpin them (the reservation's pin), make
        them ready and queue ``BlockStored(HOST)`` for each, in order (a chain parents first
        coalesces into one event)."""
        for entry in entries:
            if self._entries.get(entry.block_hash) is not entry or entry.is_ready:
                raise RuntimeError(f"committing host slot {entry.slot}: not reserved here, or already ready")
        self.unpin(entries)
        for entry in entries:
            entry.is_ready = True
            self._num_ready += 1
            self.num_stored_blocks += 1
            self._sink(BlockStored([entry.block_hash], entry.parent_hash, list(entry.token_ids),
                                   len(entry.token_ids), Tier.HOST))

    def discard(self, entry: HostEntry) -> None:
        """Drop one unpinned entry whose data is bad (a failed copy): a ready one queues
        BlockRemoved(HOST); one never committed was never announced, and goes silently."""
        if self._entries.get(entry.block_hash) is not entry or entry.num_pins:
            raise RuntimeError(f"discarding host slot {entry.slot}: not held here, or pinned")
        del self._entries[entry.block_hash]
        self.version += 1
        self._free_slots.append(entry.slot)
        self._num_ready -= entry.is_ready
        if entry.is_ready:
            self.num_evicted_blocks += 1
            self._sink(BlockRemoved([entry.block_hash], Tier.HOST))

    def clear(self, emit: bool = True) -> None:
        """Forget every entry (``reset_prefix_cache``); with ``emit``, queue AllBlocksCleared(HOST).
        Raises RuntimeError if a copy is in flight (a pinned entry)."""
        pinned = [e.slot for e in self._entries.values() if e.num_pins]
        if pinned:
            raise RuntimeError(f"clearing the host pool while slots {pinned[:8]} are pinned by copies in flight")
        self._free_slots = list(range(self.num_blocks - 1, -1, -1))
        self._entries.clear()
        self.version += 1
        self._num_ready = 0
        if emit:
            self._sink(AllBlocksCleared(Tier.HOST))

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every hash held here now (ready entries), least recently used first."""
        return [h for h, e in self._entries.items() if e.is_ready]

    def pinned_slots(self) -> dict[int, int]:
        """Slot -> pins, for the entries pinned now."""
        return {e.slot: e.num_pins for e in self._entries.values() if e.num_pins}

    def take_events(self) -> list[KVCacheEvent]:
        """Drain events queued here (only when no ``event_sink`` was given), oldest first."""
        events = list(self._events)
        self._events.clear()  # in place: the default sink appends to this list
        return events

    def check_integrity(self, at_rest: bool = True) -> None:
        """Raise RuntimeError, with the numbers, if an invariant is broken; ``at_rest`` (between
        steps) also requires that nothing is pinned."""
        slots = [e.slot for e in self._entries.values()]
        free = set(self._free_slots)
        wrong_keys = [h.hex()[:8] for h, e in self._entries.items() if e.block_hash != h]
        num_ready = sum(1 for e in self._entries.values() if e.is_ready)
        if num_ready != self._num_ready:
            raise RuntimeError(f"host pool counts {self._num_ready} ready entries, holds {num_ready}")
        pinned = [e.slot for e in self._entries.values()
                  if e.num_pins < 0 or (at_rest and e.num_pins) or (not e.is_ready and not e.num_pins)]
        if (len(set(slots)) != len(slots) or len(free) != len(self._free_slots) or free & set(slots)
                or len(free) + len(slots) != self.num_blocks or wrong_keys or pinned
                or not all(0 <= s < self.num_blocks for s in slots + self._free_slots)):
            raise RuntimeError(
                f"host pool inconsistent: {len(slots)} entries on {len(set(slots))} distinct slots, "
                f"{len(self._free_slots)} free slots ({len(free)} distinct, {len(free & set(slots))} also "
                f"held), total {self.num_blocks}; entries under another hash: {wrong_keys[:8]}; "
                f"pinned{' at rest' if at_rest else ' negatively'} (or not ready and unpinned): {pinned[:8]}")

    def _evict(self, num_blocks: int) -> bool:
        """Free ``num_blocks`` slots from the LRU end, skipping pinned entries; offer them to
        ``on_evict`` first, then queue BlockRemoved(HOST). False (nothing evicted) if too few."""
        victims = list(islice((e for e in self._entries.values() if not e.num_pins), num_blocks))
        if len(victims) < num_blocks:
            return False
        if self._on_evict is not None:
            self._on_evict([EvictedBlock(e.block_hash, e.parent_hash, e.token_ids, self.kv_cache[e.slot])
                            for e in victims])
        for entry in victims:
            del self._entries[entry.block_hash]
            self._free_slots.append(entry.slot)
        self.version += 1
        self._num_ready -= len(victims)  # unpinned entries are ready
        self.num_evicted_blocks += len(victims)
        self._sink(BlockRemoved([e.block_hash for e in victims], Tier.HOST))
        return True

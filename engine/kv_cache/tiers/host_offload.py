"""The offload half of the host tier: the BlockPool's ``Offloader``, copying cached device
blocks down to host slots on the copier before the pool evicts them.

A free cached block is ``NEEDS_COPY`` until its bytes are on the host: ``start_offload``
reserves host slots (parents first, so a chain gets consecutive slots and one run copy) and
submits one copy job; the blocks are ``IN_FLIGHT`` until it lands, and the pool neither hands
them out nor lets anything write them. When a job lands (booked by ``poll``, or lazily when the
pool asks about one of its blocks) its entries are committed: ``BlockStored(HOST)``, one chain
event, touched tails first so the host LRU, like the device's, evicts a chain's tail before its
prefix. The pool's ``BlockRemoved(DEVICE)`` comes later, when it evicts the now ``READY`` block.
A failed copy loses those blocks, nothing else: the slots go back unannounced and the blocks
are evicted without a copy. ``flush`` starts the copies of the ``num_ahead`` free blocks at the
device LRU head, so the next step's allocations find them ready instead of waiting.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.kv_cache.block_pool import BlockPool, EvictionState, KVBlock
from engine.kv_cache.hashing import BlockHash
from engine.kv_cache.tiers.copier import CopyFn, CopyJob
from engine.kv_cache.tiers.host_pool import HostBlockPool, HostEntry
from engine.stats import TierCounters

CopyDown = Callable[[Sequence[int], Sequence[int]], None]
"""``copy(slots, block_ids)``: host[slots[i]] = device[block_ids[i]]; raises RuntimeError on failure."""


@dataclass(slots=True)
class OffloadStats:
    """How often the engine thread waited for a copy (the step-loop stalls), and how long; and
    how long the copies took (on the engine thread itself with an ``InlineCopier``)."""

    num_offload_waits: int = 0  # allocations that found nothing free but in-flight blocks
    num_load_waits: int = 0  # loads waited for (a reservation's, or when nothing else could run)
    wait_s: float = 0.0  # seconds the engine thread spent in those waits
    copy_s: float = 0.0  # seconds the copy jobs ran, booked ones
    num_offload_jobs: int = 0
    num_load_jobs: int = 0


@dataclass(slots=True, eq=False)
class _Offload:
    """Device blocks being copied to their reserved host entries (same order, parents first)."""

    job: CopyJob
    blocks: list[KVBlock]
    entries: list[HostEntry]


class HostOffloader:
    """Copies cached device blocks down to a ``HostBlockPool`` before the pool evicts them.
    ``submit``/``wait`` run and await copy jobs (the host tier's, timed); ``copy_down`` copies."""

    def __init__(self, host_pool: HostBlockPool, copy_down: CopyDown, submit: Callable[[CopyFn], CopyJob],
                 wait: Callable[[CopyJob], bool], counters: TierCounters, stats: OffloadStats) -> None:
        self.host_pool = host_pool
        self.counters, self.stats = counters, stats
        self.num_ahead = 0  # free blocks at the device LRU head that ``flush`` copies down early
        self._copy_down, self._submit, self._wait = copy_down, submit, wait
        self._block_pool: BlockPool | None = None
        self._offloads: deque[_Offload] = deque()  # in flight, oldest first
        self._in_flight: dict[int, _Offload] = {}  # device block id -> its offload
        self._given_up: set[int] = set()  # device block ids whose copy failed or found no slot
        self._walked: tuple[int, int] | None = None  # (free queue, host pool) versions at the last walk

    def attach(self, block_pool: BlockPool, num_ahead: int) -> None:
        if num_ahead < 0:
            raise ValueError(f"num_ahead must be >= 0, got {num_ahead}")
        self._block_pool, self.num_ahead = block_pool, num_ahead
        self._walked = None  # another pool, or another span to walk
        block_pool.set_offloader(self)

    def eviction_state(self, block: KVBlock) -> EvictionState:
        offload = self._in_flight.get(block.block_id)
        if offload is not None:
            if not offload.job.is_done:
                return EvictionState.IN_FLIGHT
            self.poll()
        if block.block_hash is None or block.block_id in self._given_up:
            return EvictionState.READY
        if self.host_pool.get(block.block_hash) is not None:
            return EvictionState.READY
        return EvictionState.NEEDS_COPY

    def start_offload(self, blocks: list[KVBlock]) -> None:
        entries: list[HostEntry] = []
        copied: list[KVBlock] = []
        for block in _parents_first(blocks):
            assert block.block_hash is not None
            entry = self.host_pool.reserve(block.block_hash, block.parent_hash, block.token_ids)
            if entry is None:  # every host slot pinned: this block is not kept
                self._given_up.add(block.block_id)
                continue
            entries.append(entry)
            copied.append(block)
        if not entries:
            return
        slots, block_ids, copy_down = [e.slot for e in entries], [b.block_id for b in copied], self._copy_down

        def job() -> int:
            try:
                copy_down(slots, block_ids)
            except RuntimeError:  # a failed copy down loses those blocks, nothing else
                return 0
            return len(slots)

        offload = _Offload(self._submit(job), copied, entries)
        self._offloads.append(offload)
        self._in_flight.update((b.block_id, offload) for b in copied)
        self.stats.num_offload_jobs += 1

    def wait_for_offload(self) -> None:
        if not self._offloads:
            raise RuntimeError("waiting for a copy down, but none is in flight")
        if self._wait(self._offloads[0].job):
            self.stats.num_offload_waits += 1
        self.poll()

    def on_evict(self, blocks: list[KVBlock]) -> None:
        """The evicted blocks' host copies become the most recent, tails first."""
        entries = []
        for block in _parents_first(blocks):
            self._given_up.discard(block.block_id)
            entry = self.host_pool.get(block.block_hash) if block.block_hash is not None else None
            if entry is not None and entry.is_ready:
                entries.append(entry)
        self.host_pool.touch(entries[::-1])

    def flush(self) -> None:
        """Start copying down the ``num_ahead`` blocks the next allocations would evict.

        After a walk none of them needs a copy (each is started, or ready, or given up), and
        one can need it again only by joining the free queue's head or by its hash leaving the
        host pool: while neither the queue nor the pool's hashes have changed, the walk (~0.5 us
        per block: 512 blocks with CUDA's defaults, every step) is skipped, and only the landed
        copies are booked."""
        pool = self._block_pool
        if pool is None:
            return
        if self._walked == (pool.free_queue_version, self.host_pool.version):
            self.poll()
            return
        pool.offload_ahead(self.num_ahead)
        self._walked = (pool.free_queue_version, self.host_pool.version)

    def poll(self) -> None:
        """Book the landed offloads, oldest first (jobs finish in submission order)."""
        while self._offloads and self._offloads[0].job.is_done:
            offload = self._offloads.popleft()
            self.stats.copy_s += offload.job.seconds
            for block in offload.blocks:
                del self._in_flight[block.block_id]
            if offload.job.error is not None:
                raise offload.job.error
            entries = offload.entries
            if offload.job.result == len(entries):
                self.host_pool.commit(entries)
                self.host_pool.touch(entries[::-1])
                self.counters.num_offloaded_bytes += len(entries) * self.host_pool.block_bytes
            else:
                self.host_pool.unpin(entries)
                for entry in entries:
                    self.host_pool.discard(entry)
                self._given_up.update(b.block_id for b in offload.blocks)

    def jobs(self) -> list[CopyJob]:
        return [o.job for o in self._offloads]

    def clear(self) -> None:
        """Forget failed copies (after a ``poll`` of every job: nothing in flight)."""
        self._given_up.clear()
        self._walked = None  # blocks given up on may need a copy again

    def pinned_slots(self) -> Counter[int]:
        """The host slots the offloads in flight pin (one pin each)."""
        return Counter(e.slot for o in self._offloads for e in o.entries)

    def check_integrity(self) -> None:
        in_flight = {b.block_id for o in self._offloads for b in o.blocks}
        if in_flight != set(self._in_flight):
            raise RuntimeError(f"offloader inconsistent: device blocks in flight {sorted(in_flight)}, "
                               f"marked {sorted(self._in_flight)}")


def _parents_first(blocks: list[KVBlock]) -> list[KVBlock]:
    """``blocks`` reordered so that a block whose parent is also among them comes after it."""
    by_hash = {b.block_hash: b for b in blocks}
    ordered: list[KVBlock] = []
    placed: set[BlockHash | None] = set()
    for block in blocks:
        ancestors: list[KVBlock] = []
        current: KVBlock | None = block
        while current is not None and current.block_hash not in placed:
            ancestors.append(current)
            placed.add(current.block_hash)
            current = by_hash.get(current.parent_hash)
        ordered.extend(reversed(ancestors))
    return ordered

"""The host tier at work: offload on device eviction, reload on a prefix hit, off the step loop.

Every copy between the device cache and the host pool runs on a ``Copier`` (``copier.py``: one
background thread; ``InlineCopier`` for the synchronous baseline), and the engine thread only
books what finished. Fences keep it correct:

Offload. The host tier is the BlockPool's ``Offloader``. A free cached block the pool would
evict is ``NEEDS_COPY`` until its bytes are on the host: ``start_offload`` reserves host slots
(parents first, so a chain gets consecutive slots and one run copy) and submits one copy job;
the blocks are ``IN_FLIGHT`` until it lands. The pool never hands out, and so nothing writes, an
in-flight block; it takes other free blocks first and waits (``wait_for_offload``, counted in
``num_offload_waits``) only when nothing else is free. When the job lands, the entries are
committed (``BlockStored(HOST)``, one chain event) and touched tails first, so the host LRU, like
the device's, evicts a chain's tail before its prefix; the pool's ``BlockRemoved(DEVICE)`` comes
later, when it evicts the now READY block. A failed copy loses those blocks, nothing else: the
slots go back unannounced and the blocks are evicted without a copy. ``flush`` (after each
schedule) starts the copies of the ``num_ahead`` free blocks at the device LRU head, so the next
step's allocations find them ready instead of waiting; the blocks stay cached on the device
meanwhile (a copy is a read: a prefix hit may still take them).

Reload. At admission, after the device prefix hit, the scheduler asks ``match`` for the host
entries continuing the chain (pinned, and only when ``LoadCostModel.should_load``), allocates
fresh device blocks for them and ``start_load``s them; the request waits (WAITING_FOR_HOST_KV)
while other requests step, and is scheduled once ``poll`` settled the load. A failed copy is
retried block by block on the copier: the request keeps the leading blocks that loaded and
recomputes from the first that did not (its entry is dropped from the host pool). The host copy
stays (inclusive), so evicting a reloaded block again needs no copy.

Below the host tier. With a ``LowerTierStager`` (the node's kvstore), ``match`` continues the
chain after the host hit from the lower tier, staged into host slots on the engine thread
(``lower_stage.py``), and the load moves those up with the host hits in one job.

Between steps, the host pool's pins are exactly those of the jobs in flight (``check_integrity``).
``clear`` and ``close`` first wait for every job and book it.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv_cache.block_pool import BlockPool, EvictionState, KVBlock
from engine.kv_cache.copier import Copier, CopyFn, CopyJob, InlineCopier
from engine.kv_cache.hashing import BlockHash
from engine.kv_cache.host_pool import HostBlockPool, HostEntry, copy_block_runs
from engine.kv_cache.load_cost import LoadCostModel
from engine.kv_cache.lower_stage import LowerTierStager
from engine.stats import TierCounters


@dataclass(slots=True, eq=False)
class _Offload:
    """Device blocks being copied to their reserved host entries (same order, parents first)."""

    job: CopyJob
    blocks: list[KVBlock]
    entries: list[HostEntry]


@dataclass(slots=True, eq=False)
class HostLoad:
    """Host entries being copied into device blocks (``HostTier.start_load``). Once
    ``is_settled``, ``num_loaded`` leading blocks hold their data."""

    job: CopyJob
    entries: list[HostEntry]
    block_ids: list[int]
    num_host_run: int  # of ``entries``, those the host held (the rest came from the lower tier)
    num_loaded: int = 0
    is_settled: bool = False


@dataclass(slots=True)
class OffloadStats:
    """How often the engine thread waited for a copy (the step-loop stalls), and how long."""

    num_offload_waits: int = 0  # allocations that found nothing free but in-flight blocks
    num_load_waits: int = 0  # loads waited for (a reservation's, or when nothing else could run)
    wait_s: float = 0.0  # seconds the engine thread spent in those waits
    num_offload_jobs: int = 0
    num_load_jobs: int = 0


class HostTier:
    """Moves cached blocks between a device KV cache and a ``HostBlockPool`` on a ``Copier``."""

    def __init__(self, host_pool: HostBlockPool, device_cache: torch.Tensor, cost: LoadCostModel,
                 lower: LowerTierStager | None = None, copier: Copier | None = None) -> None:
        if tuple(host_pool.kv_cache.shape[1:]) != tuple(device_cache.shape[1:]):
            raise ValueError(f"host blocks {tuple(host_pool.kv_cache.shape[1:])} and device blocks "
                             f"{tuple(device_cache.shape[1:])} differ in shape")
        self.host_pool = host_pool
        self.device_cache = device_cache
        self.cost = cost
        self.counters = TierCounters()
        self.lower = lower
        self.copier: Copier = copier if copier is not None else InlineCopier()
        self.stats = OffloadStats()
        self.num_ahead = 0  # free blocks at the device LRU head that ``flush`` copies down early
        self._block_pool: BlockPool | None = None
        self._num_host_run = 0  # host-held blocks in the last ``match`` (the rest came from below)
        self._offloads: deque[_Offload] = deque()  # in flight, oldest first
        self._in_flight: dict[int, _Offload] = {}  # device block id -> its offload
        self._given_up: set[int] = set()  # device block ids whose copy failed or found no slot
        self._loads: deque[HostLoad] = deque()  # not settled yet, oldest first
        self._stream = torch.cuda.Stream(device_cache.device) if device_cache.is_cuda else None  # type: ignore[no-untyped-call]

    def attach(self, block_pool: BlockPool, num_ahead: int = 0) -> None:
        """Become ``block_pool``'s offloader; ``flush`` keeps ``num_ahead`` head blocks copied."""
        if num_ahead < 0:
            raise ValueError(f"num_ahead must be >= 0, got {num_ahead}")
        self._block_pool, self.num_ahead = block_pool, num_ahead
        block_pool.set_offloader(self)

    # ---- the block pool's offloader --------------------------------------------------

    def eviction_state(self, block: KVBlock) -> EvictionState:
        offload = self._in_flight.get(block.block_id)
        if offload is not None:
            if not offload.job.is_done:
                return EvictionState.IN_FLIGHT
            self._settle_offloads()
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
        slots, block_ids = [e.slot for e in entries], [b.block_id for b in copied]

        def copy_down() -> int:
            try:
                self.copy_to_host(slots, block_ids)
            except RuntimeError:  # a failed copy down loses those blocks, nothing else
                return 0
            return len(slots)

        offload = _Offload(self._submit(copy_down), copied, entries)
        self._offloads.append(offload)
        self._in_flight.update((b.block_id, offload) for b in copied)
        self.stats.num_offload_jobs += 1

    def wait_for_offload(self) -> None:
        if not self._offloads:
            raise RuntimeError("waiting for a copy down, but none is in flight")
        if self._wait(self._offloads[0].job):
            self.stats.num_offload_waits += 1
        self._settle_offloads()

    def on_evict(self, blocks: list[KVBlock]) -> None:
        """The evicted blocks' host copies become the most recent, tails first."""
        entries = []
        for block in _parents_first(blocks):
            self._given_up.discard(block.block_id)
            entry = self.host_pool.get(block.block_hash) if block.block_hash is not None else None
            if entry is not None and entry.is_ready:
                entries.append(entry)
        self.host_pool.touch(entries[::-1])

    # ---- the engine's calls ------------------------------------------------------------

    def flush(self) -> None:
        """After a schedule: start copying down the ``num_ahead`` blocks the next allocations
        would evict, so the copies overlap the forward instead of stalling the next step."""
        if self._block_pool is not None:
            self._block_pool.offload_ahead(self.num_ahead)

    def poll(self) -> None:
        """Book every job that has finished (Stored(HOST) for landed offloads, settled loads)."""
        self._settle_offloads()
        self._settle_loads()

    def match(self, block_hashes: Sequence[BlockHash], parent_hash: BlockHash | None = None,
              token_ids: Sequence[int] | None = None) -> list[HostEntry]:
        """The host entries of the leading run of ``block_hashes`` (the chain after the device
        hit, capped by the caller), pinned for ``start_load`` or ``release``; [] when loading
        them is estimated slower than recomputing. With ``token_ids`` (the blocks' tokens) and a
        lower tier, the run continues with the lower tier's blocks staged into host slots;
        ``parent_hash`` is the block before ``block_hashes[0]`` (None at a sequence's start)."""
        run = self.host_pool.match_prefix(block_hashes)
        self._num_host_run = 0
        if run and not self.cost.should_load(len(run)):
            return []
        self.host_pool.pin(run)
        self._num_host_run = len(run)
        if self.lower is not None and token_ids is not None and len(run) < len(block_hashes):
            block_size = len(token_ids) // len(block_hashes)  # token_ids: exactly the blocks' tokens
            rest = len(run)
            run = run + self.lower.stage(block_hashes[rest:], block_hashes[rest - 1] if rest else parent_hash,
                                         token_ids[rest * block_size:], block_size)
        return run

    def release(self, entries: Sequence[HostEntry]) -> None:
        """Unpin entries from ``match`` that will not be loaded (the admission did not happen)."""
        self.host_pool.unpin(entries)

    def start_load(self, entries: Sequence[HostEntry], block_ids: Sequence[int]) -> HostLoad:
        """Start copying ``entries`` (from ``match``, pinned) into device blocks ``block_ids``,
        which nothing may read or write until the load is settled (``poll``)."""
        if len(entries) != len(block_ids):
            raise ValueError(f"{len(entries)} host entries to load into {len(block_ids)} device blocks")
        slots, targets = [e.slot for e in entries], list(block_ids)

        def copy_up() -> int:
            try:
                self.copy_to_device(targets, slots)
            except RuntimeError:
                return self._load_one_by_one(targets, slots)
            return len(slots)

        load = HostLoad(self._submit(copy_up), list(entries), targets, min(self._num_host_run, len(entries)))
        self._loads.append(load)
        self.stats.num_load_jobs += 1
        return load

    def wait_for_load(self, load: HostLoad) -> None:
        """Block until ``load`` is settled (counted in ``stats.num_load_waits`` if it was not)."""
        if not load.is_settled:
            if self._wait(load.job):
                self.stats.num_load_waits += 1
            self.poll()

    def load(self, entries: Sequence[HostEntry], block_ids: Sequence[int]) -> int:
        """``start_load`` and wait for it: how many leading blocks hold their data."""
        load = self.start_load(entries, block_ids)
        self.wait_for_load(load)
        return load.num_loaded

    def copy_to_host(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """``host[slots[i]] = device_cache[block_ids[i]]``; raises RuntimeError if a copy fails.
        Runs on the copier."""
        copy_block_runs(self.host_pool.kv_cache, slots, self.device_cache, block_ids)

    def copy_to_device(self, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        """``device_cache[block_ids[i]] = host[slots[i]]``; raises RuntimeError if a copy fails.
        Runs on the copier."""
        copy_block_runs(self.device_cache, block_ids, self.host_pool.kv_cache, slots)

    def _load_one_by_one(self, block_ids: Sequence[int], slots: Sequence[int]) -> int:
        for i, (block_id, slot) in enumerate(zip(block_ids, slots)):
            try:
                self.copy_to_device([block_id], [slot])
            except RuntimeError:
                return i
        return len(slots)

    def record_query(self, num_queried_blocks: int, num_hit_blocks: int, block_size: int,
                     num_host_run: int | None = None) -> None:
        """Count one admission's lookup: blocks asked of this tier and blocks it served;
        ``num_host_run``: of its match, the blocks the host held (default: the last match's)."""
        num_host_run = self._num_host_run if num_host_run is None else num_host_run
        num_host_hits = min(num_hit_blocks, num_host_run)  # the rest came from the lower tier
        self.counters.num_queried_blocks += num_queried_blocks
        self.counters.num_hit_blocks += num_host_hits
        self.counters.num_hit_tokens += num_host_hits * block_size
        self._num_host_run = 0

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A forward computed ``num_tokens`` prompt tokens in ``seconds``: feeds the recompute
        estimate of this tier's and the lower tier's load decisions."""
        self.cost.observe_prefill(num_tokens, seconds)
        if self.lower is not None:
            self.lower.cost.observe_prefill(num_tokens, seconds)

    def drain(self) -> None:
        """Wait for every job in flight and book it."""
        for job in [o.job for o in self._offloads] + [load.job for load in self._loads]:
            self._wait(job)
        self.poll()

    def clear(self, emit: bool) -> None:
        self.drain()
        self._given_up.clear()
        self.host_pool.clear(emit)

    def close(self) -> None:
        """Finish and book what is in flight, then stop the copier (engine shutdown)."""
        self.drain()
        self.copier.close()

    def cached_block_hashes(self) -> list[BlockHash]:
        return self.host_pool.cached_block_hashes()

    @property
    def has_jobs_in_flight(self) -> bool:
        return bool(self._offloads or self._loads)

    def check_integrity(self) -> None:
        """Between steps: the host pool is consistent and its pins are exactly the jobs' in flight."""
        self.host_pool.check_integrity(at_rest=False)
        expected: Counter[int] = Counter()
        for offload in self._offloads:
            expected.update(e.slot for e in offload.entries)
        for load in self._loads:
            expected.update(e.slot for e in load.entries)
        pins = self.host_pool.pinned_slots()
        in_flight = {b.block_id for o in self._offloads for b in o.blocks}
        if pins != dict(expected) or in_flight != set(self._in_flight):
            raise RuntimeError(f"host tier inconsistent: host pins {dict(sorted(pins.items()))} but jobs in "
                               f"flight pin {dict(sorted(expected.items()))}; device blocks in flight "
                               f"{sorted(in_flight)}, marked {sorted(self._in_flight)}")

    # ---- booking -----------------------------------------------------------------------

    def _submit(self, fn: CopyFn) -> CopyJob:
        """Submit ``fn``; on CUDA it runs on a side stream, after the work queued so far on the
        engine's stream (which wrote the blocks), and the job ends when its copies are done."""
        if self._stream is None:
            return self.copier.submit(fn)
        stream, ready = self._stream, torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record()

        def on_stream() -> int:
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                result = fn()
            stream.synchronize()
            return result
        return self.copier.submit(on_stream)

    def _wait(self, job: CopyJob) -> bool:
        """Block until ``job`` is done; returns whether it had to (the time is counted)."""
        start = time.perf_counter()
        has_blocked = self.copier.wait(job)
        self.stats.wait_s += time.perf_counter() - start
        return has_blocked

    def _settle_offloads(self) -> None:
        """Book the landed offloads, oldest first (jobs finish in submission order)."""
        while self._offloads and self._offloads[0].job.is_done:
            offload = self._offloads.popleft()
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

    def _settle_loads(self) -> None:
        while self._loads and self._loads[0].job.is_done:
            load = self._loads.popleft()
            if load.job.error is not None:
                raise load.job.error
            entries = load.entries
            num_loaded = min(max(load.job.result, 0), len(entries))
            self.host_pool.unpin(entries)
            self.cost.observe_load(len(entries), load.job.seconds)
            if num_loaded < len(entries):
                self.counters.num_load_failures += 1
                bad = entries[num_loaded]
                if self.host_pool.get(bad.block_hash) is bad and not bad.num_pins:  # no other load reads it
                    self.host_pool.discard(bad)
            self.host_pool.touch(entries[num_loaded - 1::-1] if num_loaded else [])  # the prefix stays longest
            self.counters.num_loaded_bytes += num_loaded * self.host_pool.block_bytes
            load.num_loaded, load.is_settled = num_loaded, True


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


class NoHostTier:
    """The host tier turned off (``cpu_offload_gb`` 0, or no prefix caching): nothing is kept."""

    has_jobs_in_flight = False

    def flush(self) -> None:
        pass

    def poll(self) -> None:
        pass

    def match(self, block_hashes: Sequence[BlockHash], parent_hash: BlockHash | None = None,
              token_ids: Sequence[int] | None = None) -> list[HostEntry]:
        return []

    def release(self, entries: Sequence[HostEntry]) -> None:
        pass

    def start_load(self, entries: Sequence[HostEntry], block_ids: Sequence[int]) -> HostLoad:
        raise ValueError("the host tier is off: there is nothing to load")

    def wait_for_load(self, load: HostLoad) -> None:
        raise ValueError("the host tier is off: there is nothing to load")

    def load(self, entries: Sequence[HostEntry], block_ids: Sequence[int]) -> int:
        if entries:
            raise ValueError("the host tier is off: there is nothing to load")
        return 0

    def record_query(self, num_queried_blocks: int, num_hit_blocks: int, block_size: int,
                     num_host_run: int | None = None) -> None:
        pass

    def clear(self, emit: bool) -> None:
        pass

    def close(self) -> None:
        pass

    def cached_block_hashes(self) -> list[BlockHash]:
        return []

    def check_integrity(self) -> None:
        pass

"""The host tier at work: offload on device eviction, reload on a prefix hit, off the step loop.

Every copy between the device cache and the host pool runs on a ``Copier`` (``copier.py``: one
background thread; ``InlineCopier`` for the synchronous baseline), and the engine thread only
books what finished. Fences keep it correct:

Offload. ``HostOffloader`` (``host_offload.py``) is the BlockPool's ``Offloader``: a cached
block is copied down before the pool evicts it, never handed out while its copy is in flight,
and announced ``Stored(HOST)`` once its bytes landed (before the pool's ``Removed(DEVICE)``).
``flush`` (after each schedule) copies down early what the next allocations will evict.

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
from collections import deque
from collections.abc import Sequence

import torch

from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.events import Tier
from engine.kv_cache.hashing import BlockHash
from engine.kv_cache.tiers.copier import Copier, CopyFn, CopyJob, InlineCopier
from engine.kv_cache.tiers.host_offload import HostOffloader, OffloadStats
from engine.kv_cache.tiers.host_pool import HostBlockPool, HostEntry, copy_block_runs
from engine.kv_cache.tiers.load_cost import LoadCostModel
from engine.kv_cache.tiers.lower_stage import LowerTierStager
from engine.kv_cache.tiers.protocol import HostLoad
from engine.stats import TierCounters, TierStats


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
        self._num_host_run = 0  # host-held blocks in the last ``match`` (the rest came from below)
        self._loads: deque[HostLoad] = deque()  # not settled yet, oldest first
        self._stream = torch.cuda.Stream(device_cache.device) if device_cache.is_cuda else None  # type: ignore[no-untyped-call]
        self.offloader = HostOffloader(host_pool, lambda slots, ids: self.copy_to_host(slots, ids),
                                       self._submit, self._wait, self.counters, self.stats)

    def attach(self, block_pool: BlockPool, num_ahead: int = 0) -> None:
        """Make the offload half ``block_pool``'s offloader; ``flush`` keeps ``num_ahead`` head
        blocks copied down ahead of their eviction."""
        self.offloader.attach(block_pool, num_ahead)

    # ---- the engine's calls ------------------------------------------------------------

    def flush(self) -> None:
        """After a schedule: start copying down the ``num_ahead`` blocks the next allocations
        would evict, so the copies overlap the forward instead of stalling the next step."""
        self.offloader.flush()

    def poll(self) -> None:
        """Book every job that has finished (Stored(HOST) for landed offloads, settled loads)."""
        self.offloader.poll()
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
        for job in self.offloader.jobs() + [load.job for load in self._loads]:
            self._wait(job)
        self.poll()

    def clear(self, emit: bool) -> None:
        self.drain()
        self.offloader.clear()
        self.host_pool.clear(emit)

    def close(self) -> None:
        """Finish and book what is in flight, then stop the copier (engine shutdown)."""
        self.drain()
        self.copier.close()

    def cached_block_hashes(self) -> list[BlockHash]:
        return self.host_pool.cached_block_hashes()

    def tier_stats(self) -> tuple[TierStats, ...]:
        """HOST, then KVSTORE with a lower tier: there, this worker's traffic (the store's
        capacity and holdings are in the store's own stats)."""
        pool = self.host_pool
        host = TierStats.of(Tier.HOST, pool.num_blocks, pool.num_cached_blocks, pool.num_stored_blocks,
                            pool.num_evicted_blocks, self.counters)
        if self.lower is None:
            return (host,)
        return host, TierStats.of(Tier.KVSTORE, 0, 0, self.lower.num_offered_blocks, 0, self.lower.counters)

    @property
    def has_jobs_in_flight(self) -> bool:
        return bool(self.offloader.jobs() or self._loads)

    def check_integrity(self) -> None:
        """Between steps: the host pool is consistent and its pins are exactly the jobs' in flight."""
        self.host_pool.check_integrity(at_rest=False)
        self.offloader.check_integrity()
        expected = self.offloader.pinned_slots()
        for load in self._loads:
            expected.update(e.slot for e in load.entries)
        pins = self.host_pool.pinned_slots()
        if pins != dict(expected):
            raise RuntimeError(f"host tier inconsistent: host pins {dict(sorted(pins.items()))} but jobs in "
                               f"flight pin {dict(sorted(expected.items()))}")

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

    def _settle_loads(self) -> None:
        while self._loads and self._loads[0].job.is_done:
            load = self._loads.popleft()
            self.stats.copy_s += load.job.seconds
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

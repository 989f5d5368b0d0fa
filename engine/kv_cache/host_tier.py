"""The host tier at work: offload on device eviction, reload on a prefix hit.

Offload. ``on_device_evict`` is the BlockPool's eviction listener: it reserves a host slot for
each evicted block (``Stored(HOST)`` is queued there, before the pool queues ``Removed(DEVICE)``)
and only records the copy. ``flush`` copies everything recorded in one batch of run copies. It
must run after the scheduler's last allocation and before anything writes a device block: the
evicted blocks keep their contents until their new owners write them, which happens in the
forward (or the copy-on-write copies, the layer-skip drafter, a remote KV write) of the same
step. The engine calls it right after ``schedule`` (and after ``reserve_remote``), and ``load``
calls it first, since a load may write into a block evicted earlier in the same schedule.
Cost (``copy_block_runs``): 30-250 us per 737 KB SmolLM2 block on the 2-core dev CPU, idle to
fully contended, against 50-80 ms to compute that block's 16 tokens at the 200-300 prefill tok/s
the engine measured there: offload adds well under 1 % to a step that evicts, so it runs inline
on the engine thread (no second thread to contend with the forward's OpenMP team).

Reload. At admission, after the device prefix hit, the scheduler asks ``match`` for the host
entries continuing the chain (pinned, and only when ``LoadCostModel.should_load``), allocates
fresh device blocks for them, and ``load`` copies them in one batch of run copies before the
forward. A failed copy is retried block by block: the request keeps the leading blocks that
loaded and recomputes from the first that did not (its entry is dropped from the host pool).
The host copy stays (inclusive), so evicting a reloaded block again needs no copy.

Below the host tier. With a ``LowerTierStager`` (the node's kvstore), ``match`` continues the
chain after the host hit from the lower tier, staged into host slots (``lower_stage.py``), and
``load`` moves those up with the host hits in one batch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from engine.kv_cache.block_pool import KVBlock
from engine.kv_cache.hashing import BlockHash
from engine.kv_cache.host_pool import HostBlockPool, HostEntry, copy_block_runs
from engine.kv_cache.load_cost import LoadCostModel
from engine.kv_cache.lower_stage import LowerTierStager
from engine.stats import TierCounters


class HostTier:
    """Moves cached blocks between a device KV cache and a ``HostBlockPool``."""

    def __init__(self, host_pool: HostBlockPool, device_cache: torch.Tensor, cost: LoadCostModel,
                 lower: LowerTierStager | None = None) -> None:
        if tuple(host_pool.kv_cache.shape[1:]) != tuple(device_cache.shape[1:]):
            raise ValueError(f"host blocks {tuple(host_pool.kv_cache.shape[1:])} and device blocks "
                             f"{tuple(device_cache.shape[1:])} differ in shape")
        self.host_pool = host_pool
        self.device_cache = device_cache
        self.cost = cost
        self.counters = TierCounters()
        self.lower = lower
        self._num_host_run = 0  # host-held blocks in the last ``match`` (the rest came from below)
        self._pending: list[tuple[int, HostEntry]] = []  # (device block id, pinned host entry)

    def on_device_evict(self, blocks: list[KVBlock]) -> None:
        """BlockPool eviction listener: reserve host slots and record the copies (see ``flush``).

        The pool evicts a chain tail first; the slots are reserved parents first, so a chain
        gets consecutive slots (one run copy) and one coalesced Stored(HOST), and then touched
        tails first, so the host LRU, like the device's, evicts a chain's tail before its prefix."""
        entries = []
        for block in _parents_first(blocks):
            assert block.block_hash is not None
            entry = self.host_pool.reserve(block.block_hash, block.parent_hash, block.token_ids)
            if entry is not None:
                self._pending.append((block.block_id, entry))
                entries.append(entry)
        self.host_pool.touch(entries[::-1])

    def flush(self) -> None:
        """Copy the recorded offloads down, in one batch. Call before any device block is written."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        entries = [entry for _, entry in pending]
        try:
            self.copy_to_host([e.slot for e in entries], [block_id for block_id, _ in pending])
        except RuntimeError:  # a failed copy down loses those blocks, nothing else
            self.host_pool.unpin(entries)
            for entry in entries:
                self.host_pool.discard(entry)
            return
        self.host_pool.unpin(entries)
        self.counters.num_offloaded_bytes += len(entries) * self.host_pool.block_bytes

    def match(self, block_hashes: Sequence[BlockHash], parent_hash: BlockHash | None = None,
              token_ids: Sequence[int] | None = None) -> list[HostEntry]:
        """The host entries of the leading run of ``block_hashes`` (the chain after the device
        hit, capped by the caller), pinned for ``load`` or ``release``; [] when loading them is
        estimated slower than recomputing. With ``token_ids`` (the blocks' tokens) and a lower
        tier, the run continues with the lower tier's blocks staged into host slots;
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

    def load(self, entries: Sequence[HostEntry], block_ids: Sequence[int]) -> int:
        """Copy ``entries`` (from ``match``) into device blocks ``block_ids`` and unpin them.
        Returns how many leading blocks hold their data; the caller recomputes the rest."""
        if len(entries) != len(block_ids):
            raise ValueError(f"{len(entries)} host entries to load into {len(block_ids)} device blocks")
        self.flush()
        start = time.perf_counter()
        slots = [e.slot for e in entries]
        num_loaded = len(entries)
        try:
            self.copy_to_device(block_ids, slots)
        except RuntimeError:
            num_loaded = self._load_one_by_one(block_ids, slots)
        finally:
            self.host_pool.unpin(entries)
        self.cost.observe_load(len(entries), time.perf_counter() - start)
        if num_loaded < len(entries):
            self.counters.num_load_failures += 1
            self.host_pool.discard(entries[num_loaded])
        self.host_pool.touch(entries[num_loaded - 1::-1] if num_loaded else [])  # the prefix stays longest
        self.counters.num_loaded_bytes += num_loaded * self.host_pool.block_bytes
        return num_loaded

    def copy_to_host(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """``host[slots[i]] = device_cache[block_ids[i]]``; raises RuntimeError if a copy fails."""
        copy_block_runs(self.host_pool.kv_cache, slots, self.device_cache, block_ids)

    def copy_to_device(self, block_ids: Sequence[int], slots: Sequence[int]) -> None:
        """``device_cache[block_ids[i]] = host[slots[i]]``; raises RuntimeError if a copy fails."""
        copy_block_runs(self.device_cache, block_ids, self.host_pool.kv_cache, slots)

    def _load_one_by_one(self, block_ids: Sequence[int], slots: Sequence[int]) -> int:
        for i, (block_id, slot) in enumerate(zip(block_ids, slots)):
            try:
                self.copy_to_device([block_id], [slot])
            except RuntimeError:
                return i
        return len(slots)

    def record_query(self, num_queried_blocks: int, num_hit_blocks: int, block_size: int) -> None:
        """Count one admission's lookup: blocks asked of this tier and blocks it served."""
        num_host_hits = min(num_hit_blocks, self._num_host_run)  # the rest came from the lower tier
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

    def clear(self, emit: bool) -> None:
        self.flush()
        self.host_pool.clear(emit)

    def cached_block_hashes(self) -> list[BlockHash]:
        return self.host_pool.cached_block_hashes()

    def check_integrity(self) -> None:
        if self._pending:
            raise RuntimeError(f"{len(self._pending)} offload copies recorded but not flushed between steps")
        self.host_pool.check_integrity(at_rest=True)


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

    def flush(self) -> None:
        pass

    def match(self, block_hashes: Sequence[BlockHash], parent_hash: BlockHash | None = None,
              token_ids: Sequence[int] | None = None) -> list[HostEntry]:
        return []

    def release(self, entries: Sequence[HostEntry]) -> None:
        pass

    def load(self, entries: Sequence[HostEntry], block_ids: Sequence[int]) -> int:
        if entries:
            raise ValueError("the host tier is off: there is nothing to load")
        return 0

    def record_query(self, num_queried_blocks: int, num_hit_blocks: int, block_size: int) -> None:
        pass

    def clear(self, emit: bool) -> None:
        pass

    def cached_block_hashes(self) -> list[BlockHash]:
        return []

    def check_integrity(self) -> None:
        pass

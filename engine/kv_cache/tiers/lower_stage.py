"""The lower tier (the node's kvstore) at admission: stage its continuation of a chain in host slots.

After the host tier's own hit, ``LowerTierStager.stage`` asks the lower tier how many of the
following hashes it holds (``LowerTier.match``), and, when its own ``LoadCostModel`` (measured
loads from this tier, measured prefill rate) says loading them beats recomputing, reserves host
slots for them (``BlockStored(HOST)`` with parent and token ids) and has the lower tier write
them there (``LowerTier.load``). The staged entries come back pinned and follow the host hit in
the list the host tier hands the scheduler, so the host tier's ``load`` moves them into fresh
device blocks in the same batch of run copies as its own hits; they stay host-cached
(inclusive), and become device-cached like any host hit.

A short count (the store died, a block was evicted, a deadline passed) keeps the leading blocks
that were written; the slots reserved for the others are dropped (never announced) and the
request recomputes from the first block not written. Nothing here raises on a lower-tier failure.

Counters (``TierCounters`` of ``Tier.KVSTORE``): queried/hit blocks are counted here, when the
lower tier is asked (an admission that then does not fit finds the staged blocks on host when it
is retried); loaded bytes are bytes written into host slots by the lower tier; offloaded bytes
are the bytes of the blocks offered to it on host eviction (it may drop them: it is a cache).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from engine.kv_cache.hashing import BlockHash
from engine.kv_cache.tiers.host_pool import HostBlockPool, HostEntry
from engine.kv_cache.tiers.load_cost import LoadCostDefaults, LoadCostModel
from engine.kv_cache.tiers.lower_tier import EvictedBlock, LowerTier
from engine.stats import TierCounters

# Before the first measurement: a 737 KB block over loopback gRPC costs about 1 ms on the 2-core
# dev CPU (copies on both sides plus framing), against 50-80 ms to recompute its 16 tokens.
LOWER_TIER_COST_DEFAULTS = LoadCostDefaults(load_us_per_block=1000.0)


class LowerTierStager:
    """Stages a lower tier's blocks into a host pool at admission, and offers it host evictions."""

    def __init__(self, lower: LowerTier, host_pool: HostBlockPool, cost: LoadCostModel) -> None:
        self.lower = lower
        self.host_pool = host_pool
        self.cost = cost
        self.counters = TierCounters()
        self.num_offered_blocks = 0

    def offer(self, blocks: list[EvictedBlock]) -> None:
        """The host pool's eviction listener: hand the blocks down (the lower tier never blocks)."""
        self.lower.offer(blocks)
        self.num_offered_blocks += len(blocks)
        self.counters.num_offloaded_bytes += len(blocks) * self.host_pool.block_bytes

    def stage(self, block_hashes: Sequence[BlockHash], parent_hash: BlockHash | None,
              token_ids: Sequence[int], block_size: int) -> list[HostEntry]:
        """Host entries (pinned) holding the lower tier's leading run of ``block_hashes``, the
        chain after the host hit; ``parent_hash`` is the block before ``block_hashes[0]`` (None
        at the start of a sequence) and ``token_ids`` their tokens, ``block_size`` per block.
        [] when the lower tier misses or loading is estimated slower than recomputing."""
        if not block_hashes:
            return []
        if len(token_ids) < len(block_hashes) * block_size:
            raise ValueError(f"{len(block_hashes)} blocks of {block_size} tokens need "
                             f"{len(block_hashes) * block_size} token ids, got {len(token_ids)}")
        num_held = min(max(self.lower.match(block_hashes), 0), len(block_hashes))
        self.counters.num_queried_blocks += len(block_hashes)
        if not self.cost.should_load(num_held):
            return []
        entries = self._reserve(block_hashes[:num_held], parent_hash, token_ids, block_size)
        if not entries:
            return []
        start = time.perf_counter()
        num_loaded = min(max(self.lower.load([e.block_hash for e in entries], self.host_pool.kv_cache,
                                             [e.slot for e in entries]), 0), len(entries))
        self.cost.observe_load(len(entries), time.perf_counter() - start)
        if num_loaded < len(entries):
            self.counters.num_load_failures += 1
            self._drop(entries[num_loaded:])
        loaded = entries[:num_loaded]
        self.host_pool.commit(loaded)  # Stored(HOST) now that the bytes are there
        self.host_pool.pin(loaded)  # for the host tier's load up, as its own hits are
        self.counters.num_hit_blocks += num_loaded
        self.counters.num_hit_tokens += num_loaded * block_size
        self.counters.num_loaded_bytes += num_loaded * self.host_pool.block_bytes
        return loaded

    def _reserve(self, block_hashes: Sequence[BlockHash], parent_hash: BlockHash | None,
                 token_ids: Sequence[int], block_size: int) -> list[HostEntry]:
        """Pinned host entries for the leading ``block_hashes`` that get a slot (stops at the
        first that does not: already on host, or every slot pinned)."""
        entries: list[HostEntry] = []
        for i, block_hash in enumerate(block_hashes):
            parent = block_hashes[i - 1] if i else parent_hash
            entry = self.host_pool.reserve(block_hash, parent, token_ids[i * block_size:(i + 1) * block_size])
            if entry is None:
                break
            entries.append(entry)
        return entries

    def _drop(self, entries: Sequence[HostEntry]) -> None:
        """Forget reserved slots the lower tier did not fill."""
        self.host_pool.unpin(entries)
        for entry in entries:
            self.host_pool.discard(entry)

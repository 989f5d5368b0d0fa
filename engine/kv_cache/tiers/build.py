"""The host tier an engine gets for its cache settings: the real one wired up, or NoHostTier."""

from __future__ import annotations

import torch

from engine.config import CacheConfig
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.storage import host_pool_num_blocks
from engine.kv_cache.tiers.copier import BackgroundCopier, Copier, InlineCopier
from engine.kv_cache.tiers.host_pool import HostBlockPool
from engine.kv_cache.tiers.host_tier import HostTier
from engine.kv_cache.tiers.load_cost import LoadCostModel
from engine.kv_cache.tiers.lower_stage import LOWER_TIER_COST_DEFAULTS, LowerTierStager
from engine.kv_cache.tiers.lower_tier import LowerTier
from engine.kv_cache.tiers.protocol import HostTierProtocol, NoHostTier
from engine.mathutils import cdiv


def build_host_tier(cache: CacheConfig, kv_cache: torch.Tensor, block_pool: BlockPool,
                    max_num_batched_tokens: int, lower_tier: LowerTier | None = None) -> HostTierProtocol:
    """The host tier sized by ``cache.cpu_offload_bytes``, ``block_pool``'s offloader, copying
    on a background thread (inline with ``kv_offload_sync``); NoHostTier when it is 0 (or fits
    no block) or prefix caching is off. ``lower_tier`` (a kvstore client) is offered the blocks
    the host evicts and asked, at admission, for the chain after a host hit."""
    block_bytes = kv_cache[0].numel() * kv_cache.element_size()
    num_host_blocks = host_pool_num_blocks(cache, block_bytes, block_pool.num_blocks)
    if not cache.enable_prefix_caching or num_host_blocks < 1:
        return NoHostTier()
    host_pool = HostBlockPool(num_host_blocks, tuple(kv_cache.shape[1:]), kv_cache.dtype,
                              event_sink=block_pool.queue_event, pin_memory=kv_cache.is_cuda)
    stager = None
    if lower_tier is not None:  # host evictions go down; admission continues a host hit from it
        stager = LowerTierStager(lower_tier, host_pool, LoadCostModel(cache.block_size, LOWER_TIER_COST_DEFAULTS))
        host_pool.set_eviction_listener(stager.offer)
    copier: Copier = InlineCopier() if cache.kv_offload_sync else BackgroundCopier()
    host_tier = HostTier(host_pool, kv_cache, LoadCostModel(cache.block_size), stager, copier)
    # Copied ahead: about what one step allocates (its token budget), a quarter of the pool at most.
    num_ahead = 0 if cache.kv_offload_sync else min(
        cdiv(max_num_batched_tokens, cache.block_size), block_pool.num_blocks // 4)
    host_tier.attach(block_pool, num_ahead)
    return host_tier

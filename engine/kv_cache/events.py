"""Prefix-cache events a worker publishes so the router's prefix index can follow its cache.

Plain, torch-free data. The block pool queues them in the order they happened; a service drains
them (``BlockPool.take_events``) and converts them to protobuf at its edge. The index is advisory:
a consumer that missed events is merely less accurate, never wrong about correctness.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntFlag

from engine.kv_cache.hashing import BlockHash


class Tier(IntFlag):
    """Where a cached block lives, fastest first. Flag values so an index can keep a tier mask
    per (block, worker): the prefix index stores ``DEVICE | HOST`` for a block held on both."""

    DEVICE = 1   # the worker's paged KV pool
    HOST = 2     # the worker's host-memory pool, filled by eviction from DEVICE
    KVSTORE = 4  # the node's kvstore service, filled by eviction from HOST


@dataclass(frozen=True)
class BlockStored:
    """Blocks entered the prefix cache.

    ``block_hashes`` is a chain: each block's parent is the previous one, and the first one's
    parent is ``parent_block_hash`` (None: the first block of a sequence, parent = the root).
    ``token_ids`` are the blocks' tokens concatenated: ``len(token_ids) == len(block_hashes) * block_size``.
    Every tier's Stored event carries the parent and the tokens, so a consumer can rebuild the chain
    from any of them. A block that moves down a tier is announced Stored on the lower tier before
    it is Removed from the upper one.
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    tier: Tier = Tier.DEVICE


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks left ``tier`` of the prefix cache (evicted to make room); their hashes no longer
    resolve on that tier here (they may still on another)."""

    block_hashes: list[BlockHash]
    tier: Tier = Tier.DEVICE


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped (``reset_prefix_cache``): on ``tier``, or on every
    tier when ``tier`` is None."""

    tier: Tier | None = None


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared

"""Prefix-cache events a worker publishes so the router's prefix index can follow its cache.

Plain, torch-free data. The block pool queues them in the order they happened; a service drains
them (``BlockPool.take_events``) and converts them to protobuf at its edge. The index is advisory:
a consumer that missed events is merely less accurate, never wrong about correctness.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache.hashing import BlockHash


@dataclass(frozen=True)
class BlockStored:
    """Blocks entered the prefix cache.

    ``block_hashes`` is a chain: each block's parent is the previous one, and the first one's
    parent is ``parent_block_hash`` (None: the first block of a sequence, parent = the root).
    ``token_ids`` are the blocks' tokens concatenated: ``len(token_ids) == len(block_hashes) * block_size``.
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks left the prefix cache (evicted to make room); their hashes no longer resolve here."""

    block_hashes: list[BlockHash]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped (``reset_prefix_cache``)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared

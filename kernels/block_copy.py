"""Move whole cache blocks: pack for transfer/offload, unpack on arrival, copy for copy-on-write.

A block is one contiguous region across all layers (``kv_cache[block_id]``, see CacheConfig), so
packing n blocks is n contiguous copies of ``block_numel`` elements into ``packed: [n, block_numel]``.
"""

from __future__ import annotations

import math

import torch

from kernels._checks import check_tensor
from kernels._triton import check_launchable, tl, triton


def _check_cache(kv_cache: torch.Tensor) -> int:
    """Return block_numel; each block (dims 1..) must be contiguous, blocks may be strided."""
    check_tensor("kv_cache", kv_cache)
    if kv_cache.dim() < 2:
        raise ValueError(f"kv_cache must be [num_blocks, ...], got shape {tuple(kv_cache.shape)}")
    inner = kv_cache[0] if kv_cache.shape[0] else kv_cache.new_empty(kv_cache.shape[1:])
    block_numel = math.prod(kv_cache.shape[1:])
    if not inner.is_contiguous() or (kv_cache.shape[0] > 1 and kv_cache.stride(0) < block_numel):
        raise ValueError(f"kv_cache must hold each block contiguously (strides of dims 1.. contiguous, "
                         f"stride(0) >= {block_numel}), got strides {kv_cache.stride()}")
    return block_numel


def _check_ids(name: str, ids: torch.Tensor, kv_cache: torch.Tensor, length: int | None = None) -> None:
    check_tensor(name, ids, shape=(length,), dtypes=(torch.int64, torch.int32), device=kv_cache.device)


def gather_blocks_ref(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """kv_cache: [num_blocks, ...]; block_ids: [n] -> packed [n, block_numel] (contiguous)."""
    block_numel = _check_cache(kv_cache)
    _check_ids("block_ids", block_ids, kv_cache)
    return kv_cache.index_select(0, block_ids.long()).reshape(-1, block_numel)


def scatter_blocks_ref(packed: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """packed: [n, block_numel] -> kv_cache[block_ids[i]] = packed[i], in place."""
    block_numel = _check_cache(kv_cache)
    _check_ids("block_ids", block_ids, kv_cache)
    check_tensor("packed", packed, shape=(block_ids.shape[0], block_numel), dtypes=(kv_cache.dtype,),
                 device=kv_cache.device)
    kv_cache.index_copy_(0, block_ids.long(), packed.reshape(-1, *kv_cache.shape[1:]))


def copy_blocks_ref(kv_cache: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """kv_cache[dst_ids[i]] = kv_cache[src_ids[i]] for all i (sources are read before any write)."""
    _check_cache(kv_cache)
    _check_ids("src_ids", src_ids, kv_cache)
    _check_ids("dst_ids", dst_ids, kv_cache, src_ids.shape[0])
    kv_cache.index_copy_(0, dst_ids.long(), kv_cache.index_select(0, src_ids.long()))

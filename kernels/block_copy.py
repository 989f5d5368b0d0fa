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


@triton.jit
def _copy_blocks_kernel(  # type: ignore[no-untyped-def]  # JIT kernel (kernels/_triton.py)
    src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, block_numel, src_stride, dst_stride,
    SRC_INDEXED: tl.constexpr, DST_INDEXED: tl.constexpr, BLOCK: tl.constexpr,
):
    # Program (i, j) copies chunk j of block i. A side that is not indexed is the packed buffer,
    # whose row i is block i.
    i = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    src_row = i
    dst_row = i
    if SRC_INDEXED:
        src_row = tl.load(src_ids_ptr + i).to(tl.int64)
    if DST_INDEXED:
        dst_row = tl.load(dst_ids_ptr + i).to(tl.int64)
    data = tl.load(src_ptr + src_row * src_stride + offs, mask=mask)
    tl.store(dst_ptr + dst_row * dst_stride + offs, data, mask=mask)


def _launch(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor | None, dst_ids: torch.Tensor | None,
            num: int, block_numel: int, src_stride: int, dst_stride: int) -> None:
    check_launchable(src.device)
    if num == 0 or block_numel == 0:
        return
    block = min(4096, triton.next_power_of_2(block_numel))
    ids = src_ids if src_ids is not None else dst_ids
    _copy_blocks_kernel[(num, triton.cdiv(block_numel, block))](
        src, dst, src_ids if src_ids is not None else ids, dst_ids if dst_ids is not None else ids,
        block_numel, src_stride, dst_stride,
        SRC_INDEXED=src_ids is not None, DST_INDEXED=dst_ids is not None, BLOCK=block)


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`gather_blocks_ref`."""
    block_numel = _check_cache(kv_cache)
    _check_ids("block_ids", block_ids, kv_cache)
    packed = torch.empty((block_ids.shape[0], block_numel), dtype=kv_cache.dtype, device=kv_cache.device)
    _launch(kv_cache, packed, block_ids, None, block_ids.shape[0], block_numel, kv_cache.stride(0),
            block_numel)
    return packed


def scatter_blocks(packed: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Triton version of :func:`scatter_blocks_ref`; ``packed`` must be contiguous."""
    block_numel = _check_cache(kv_cache)
    _check_ids("block_ids", block_ids, kv_cache)
    check_tensor("packed", packed, shape=(block_ids.shape[0], block_numel), dtypes=(kv_cache.dtype,),
                 device=kv_cache.device)
    if not packed.is_contiguous():
        raise ValueError(f"packed must be contiguous, got strides {packed.stride()}")
    _launch(packed, kv_cache, None, block_ids, block_ids.shape[0], block_numel, block_numel,
            kv_cache.stride(0))


def copy_blocks(kv_cache: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """Triton version of :func:`copy_blocks_ref`. Unlike the reference, blocks are copied in
    parallel, so ``dst_ids`` must be distinct and disjoint from ``src_ids`` (not checked: that
    would need a device sync; copy-on-write targets are fresh blocks)."""
    block_numel = _check_cache(kv_cache)
    _check_ids("src_ids", src_ids, kv_cache)
    _check_ids("dst_ids", dst_ids, kv_cache, src_ids.shape[0])
    _launch(kv_cache, kv_cache, src_ids, dst_ids, src_ids.shape[0], block_numel, kv_cache.stride(0),
            kv_cache.stride(0))

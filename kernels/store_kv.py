"""Write this step's keys and values into the paged cache, one slot per token.

slot = block_id * block_size + offset_in_block; a negative slot marks a padding token whose K/V
are dropped. The caches are the strided per-layer views of the 6-d cache (see CacheConfig), so
they are written in place through their strides, never copied.
"""

from __future__ import annotations

import torch

from kernels._checks import FLOAT_DTYPES, check_tensor
from kernels._triton import check_launchable, tl, triton


def _check_args(key, value, key_cache, value_cache, slot_mapping) -> None:
    check_tensor("key_cache", key_cache, ndim=4, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    _, _, num_kv_heads, head_dim = key_cache.shape
    device = key_cache.device
    check_tensor("value_cache", value_cache, shape=tuple(key_cache.shape), dtypes=(key_cache.dtype,),
                 device=device, last_dim_contiguous=True)
    if value_cache.stride() != key_cache.stride():
        raise ValueError(f"value_cache must have the strides of key_cache {key_cache.stride()}, "
                         f"got {value_cache.stride()}")
    check_tensor("key", key, shape=(None, num_kv_heads, head_dim), dtypes=FLOAT_DTYPES, device=device,
                 last_dim_contiguous=True)
    check_tensor("value", value, shape=tuple(key.shape), dtypes=FLOAT_DTYPES, device=device,
                 last_dim_contiguous=True)
    check_tensor("slot_mapping", slot_mapping, shape=(key.shape[0],), dtypes=(torch.int64, torch.int32),
                 device=device)


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value: [N, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads,
    head_dim] (strided views); slot_mapping: [N] int64, < 0 = skip. Writes in place; K/V are cast
    to the cache dtype."""
    _check_args(key, value, key_cache, value_cache, slot_mapping)
    block_size = key_cache.shape[1]
    slots = slot_mapping.long()
    if slots.numel() and bool((slots < 0).any()):
        valid = slots >= 0
        slots, key, value = slots[valid], key[valid], value[valid]
    block_ids, offsets = slots // block_size, slots % block_size
    key_cache[block_ids, offsets] = key.to(key_cache.dtype)
    value_cache[block_ids, offsets] = value.to(value_cache.dtype)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    num_kv_heads, head_dim, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per token: copy its [num_kv_heads, head_dim] K and V into its slot.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_kv_heads) & (dims < head_dim)
        dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_co + heads * stride_ch + dims
        k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
        v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
        tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton version of :func:`store_kv_ref` (same contract)."""
    _check_args(key, value, key_cache, value_cache, slot_mapping)
    check_launchable(key.device)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        num_kv_heads, head_dim, key_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )

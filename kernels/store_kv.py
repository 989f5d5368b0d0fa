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

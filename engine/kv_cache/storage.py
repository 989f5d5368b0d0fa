"""The paged KV cache tensor: sizing, allocation, per-layer views and block copies.

Layout (see ``CacheConfig``)::

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    layer_kv(kv_cache, l) -> key, value: [num_blocks, block_size, num_kv_heads, head_dim] (strided views)

One block is one contiguous region across all layers: a single descriptor for KV transfer
and offload, and one indexed copy for copy-on-write (``kernels.block_copy``). A quantized cache
(int8, float8_e4m3fn) stores ``head_dim + 4`` one-byte elements per row: the codes, then the
row's fp32 scale (``engine/kv_cache/quant_format.py``).
"""

from __future__ import annotations

import os

import torch

from engine.config import CacheConfig, ConfigError, ModelConfig
from engine.kv_cache.quant_format import stored_head_dim

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}


def kv_dtype(cache_config: CacheConfig) -> torch.dtype:
    return _DTYPES[cache_config.dtype]


def bytes_per_block(model_config: ModelConfig, cache_config: CacheConfig) -> int:
    """Bytes of one block: K and V of ``block_size`` tokens in every layer (scales included)."""
    element_size = torch.empty((), dtype=kv_dtype(cache_config)).element_size()
    return (model_config.num_layers * 2 * cache_config.block_size * model_config.num_kv_heads
            * stored_head_dim(cache_config.dtype, model_config.head_dim) * element_size)


def num_blocks_for_budget(model_config: ModelConfig, cache_config: CacheConfig,
                          budget_bytes: int | None = None) -> int:
    """``cache_config.num_blocks`` if set, else how many blocks fit in ``budget_bytes``
    (default ``cache_config.memory_budget_bytes``). Raises ConfigError if none fit."""
    if cache_config.num_blocks is not None:
        return cache_config.num_blocks
    budget = cache_config.memory_budget_bytes if budget_bytes is None else budget_bytes
    block_bytes = bytes_per_block(model_config, cache_config)
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ConfigError(
            f"KV cache budget of {budget} bytes fits no block: one block of {cache_config.block_size} "
            f"tokens for {model_config.name!r} ({model_config.num_layers} layers, {model_config.num_kv_heads} "
            f"KV heads, head_dim {model_config.head_dim}, {cache_config.dtype}) needs {block_bytes} bytes; "
            f"raise CacheConfig.memory_budget_bytes, lower block_size, or set num_blocks")
    return num_blocks


def allocate_kv_cache(model_config: ModelConfig, cache_config: CacheConfig,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed cache ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``
    (``head_dim + 4`` for a quantized dtype: zero codes with a zero scale read as 0.0)."""
    num_blocks = num_blocks_for_budget(model_config, cache_config)
    return torch.zeros(num_blocks, model_config.num_layers, 2, cache_config.block_size,
                       model_config.num_kv_heads,
                       stored_head_dim(cache_config.dtype, model_config.head_dim),
                       dtype=kv_dtype(cache_config), device=device)


def layer_kv(kv_cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value caches of one layer, each ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
    if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
        raise ValueError(f"expected kv_cache [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(kv_cache.shape)}")
    return kv_cache[:, layer, 0], kv_cache[:, layer, 1]



def host_pool_num_blocks(cache_config: CacheConfig, block_bytes: int, num_device_blocks: int) -> int:
    """Blocks of the host tier: ``cpu_offload_bytes // block_bytes`` when set (0: off), else twice
    the device pool (a host tier smaller than the device pool churns), capped at a quarter of the
    memory available now so a 24 GB machine running several workers keeps room to spare."""
    if cache_config.cpu_offload_bytes is not None:
        return cache_config.cpu_offload_bytes // block_bytes
    return min(2 * num_device_blocks, _available_memory_bytes() // 4 // block_bytes)


def _available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

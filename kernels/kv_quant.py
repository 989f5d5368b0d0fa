"""Quantized KV rows: the reference encoding the store and attention kernels share.

A quantized cache row (one token, one KV head) is ``head_dim + SCALE_BYTES`` one-byte elements::

    row[:head_dim]                 codes: int8, or float8_e4m3fn bit patterns
    row[head_dim:head_dim + 4]     fp32 scale (native byte order), scale = max|x| / QMAX
    value = code * scale

int8 codes are ``round_half_even(x / scale)`` in [-127, 127]; fp8 codes are
``float8_e4m3fn(x / scale)`` in [-448, 448]. A row of zeros has scale 0 (and decodes to zeros),
so a zeroed cache reads as 0.0 like a float one. The engine's side of the format (sizes, names)
is ``engine/kv_cache/quant_format.py``; kernels import nothing from the engine, so
``SCALE_BYTES`` is written twice and a test pins that they agree.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4
QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def is_quantized_cache(cache: torch.Tensor) -> bool:
    return cache.dtype in QUANT_DTYPES


def stored_head_dim(cache_dtype: torch.dtype, head_dim: int) -> int:
    """Elements per stored row for ``head_dim`` values in a cache of ``cache_dtype``."""
    return head_dim + SCALE_BYTES if cache_dtype in QUANT_DTYPES else head_dim


def quantize_rows(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x: [..., head_dim] float -> rows [..., head_dim + 4] of ``cache_dtype`` (codes | scale)."""
    if cache_dtype not in QUANT_DTYPES:
        raise ValueError(f"cache_dtype must be int8|float8_e4m3fn, got {cache_dtype}")
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = amax / QMAX[cache_dtype]
    inv = torch.where(amax > 0, 1.0 / torch.where(amax > 0, scale, 1.0), 0.0)
    scaled = x * inv
    if cache_dtype == torch.int8:
        codes = torch.round(scaled).clamp_(-127, 127).to(torch.int8).view(torch.uint8)
    else:
        codes = scaled.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    scale_bytes = scale.contiguous().view(torch.uint8)  # [..., 4]
    return torch.cat([codes, scale_bytes], dim=-1).view(cache_dtype)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """rows [..., head_dim + 4] of a quantized dtype -> values [..., head_dim] fp32."""
    if rows.dtype not in QUANT_DTYPES:
        raise ValueError(f"rows must be int8|float8_e4m3fn, got {rows.dtype}")
    head_dim = rows.shape[-1] - SCALE_BYTES
    codes = rows[..., :head_dim].float()
    scale = rows[..., head_dim:].contiguous().view(torch.uint8).view(torch.float32)  # [..., 1]
    return codes * scale


def check_quantized_cache(name: str, cache: torch.Tensor, head_dim: int) -> None:
    """ValueError unless ``cache`` rows hold ``head_dim`` codes and a scale."""
    if cache.shape[-1] != head_dim + SCALE_BYTES:
        raise ValueError(f"{name} is {str(cache.dtype).removeprefix('torch.')}: its rows must hold "
                         f"head_dim + {SCALE_BYTES} = {head_dim + SCALE_BYTES} elements (codes, then "
                         f"the fp32 scale), got shape {tuple(cache.shape)}")


def check_scale_alignment(cache: torch.Tensor, head_dim: int) -> None:
    """The Triton kernels read a row's scale through a float32 view of the cache: every stride,
    the storage offset and head_dim must be multiples of 4 bytes (true for the engine's layout
    whenever head_dim is). ValueError otherwise."""
    if head_dim % 4 or any(stride % 4 for stride in cache.stride()[:-1]) or cache.storage_offset() % 4:
        raise ValueError(f"a quantized cache on the Triton path needs head_dim and the cache's strides "
                         f"and offset in multiples of 4 (the fp32 scales are read in place), got "
                         f"head_dim {head_dim}, strides {cache.stride()}, offset {cache.storage_offset()}")

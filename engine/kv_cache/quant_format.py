"""The quantized KV cache formats: what ``--kv-cache-dtype`` names and how a row is stored.

Torch-free (the router and the kvstore read it). A quantized cache keeps the 6-d block layout of
:class:`engine.config.CacheConfig`; only its last dimension grows by the row's scale::

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim + SCALE_BYTES]
                                                                    ^ 1-byte elements
    one row = K (or V) of one token and one KV head:
        bytes [0, head_dim)                 head_dim codes (int8, or float8_e4m3fn bits)
        bytes [head_dim, head_dim + 4)      the row's fp32 scale, native byte order
        value[d] = code[d] * scale          scale = max|x| / QMAX (0 for an all-zero row)

Why per token and KV head (not per block): a block fills one token at a time, so a per-block
scale would have to be fixed before the block's later tokens are seen (or every earlier row
requantized when one exceeds it); a per-row scale is written once with its row, needs no state,
and costs 4 bytes per 64 (3.77x smaller than fp32 for head_dim 64 instead of 4x). The scale sits
inside the row, so a block stays one contiguous region (one NIXL descriptor, one offload copy)
and everything that moves blocks moves the scales with them without knowing they are there.
"""

from __future__ import annotations

# --kv-cache-dtype values (vLLM's flag names): auto = the model's dtype (the cache as before);
# bf16 stores bfloat16 rows (no scale: half of fp32's bytes), read by widening in the kernels
KV_CACHE_DTYPES = ("auto", "fp32", "bf16", "int8", "fp8")
# CacheConfig.dtype names of the quantized layouts (torch dtype names of their codes)
QUANT_KV_DTYPES = ("int8", "float8_e4m3fn")
SCALE_BYTES = 4  # one fp32 scale per row; kernels.kv_quant.SCALE_BYTES is the same number
QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}  # largest code magnitude used


def cache_dtype_for(kv_cache_dtype: str, model_dtype: str) -> str:
    """The ``CacheConfig.dtype`` name of a ``--kv-cache-dtype`` value: 'auto' keeps the model's
    dtype, 'fp32' is float32, 'bf16' bfloat16, 'int8' int8 and 'fp8' float8_e4m3fn. ValueError
    otherwise."""
    names = {"auto": model_dtype, "fp32": "float32", "bf16": "bfloat16", "int8": "int8",
             "fp8": "float8_e4m3fn"}
    if kv_cache_dtype not in names:
        raise ValueError(f"kv_cache_dtype must be {'|'.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return names[kv_cache_dtype]


def is_quantized(dtype: str) -> bool:
    """True for a cache dtype whose rows carry codes and a scale."""
    return dtype in QUANT_KV_DTYPES


def stored_head_dim(dtype: str, head_dim: int) -> int:
    """Elements of one stored row: ``head_dim``, plus the scale's bytes when quantized."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def bytes_per_token(dtype: str, num_layers: int, num_kv_heads: int, head_dim: int,
                    element_size: int) -> int:
    """KV bytes of one token across all layers (K and V, scales included)."""
    return num_layers * 2 * num_kv_heads * stored_head_dim(dtype, head_dim) * element_size

"""Rotary embedding and the KV store in one launch: q rotated in place, k rotated on its way
into the cache, v copied into it (one program per token). A decode layer launches one kernel
fewer and k is neither written back nor read again.

The contract is ``rotary`` then ``store_kv`` (``rotary_store_kv_ref``): same arguments, same
results, except that ``k`` itself is left unrotated (nothing reads it after the store). A
quantized cache (int8 / fp8 rows with a scale) takes the two kernels one after the other.
"""

from __future__ import annotations

import torch

from kernels._triton import check_launchable, tl, triton
from kernels.kv_quant import QUANT_DTYPES
from kernels.rotary import check_rotary_args, rotary, rotary_ref, rotate_heads, token_cos_sin
from kernels.store_kv import bf16_bits, check_store_kv_args, store_kv, store_kv_ref


def rotary_store_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        cos_sin_cache: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    """q: [N, Hq, D] rotated in place; rotated k and v: [N, Hkv, D] into the caches at
    ``slot_mapping`` (< 0: skipped). k may be rotated in place or not (unspecified)."""
    rotary_ref(q, k, positions, cos_sin_cache)
    store_kv_ref(k, v, key_cache, value_cache, slot_mapping)


@triton.jit
def _rotary_store_kv_kernel(  # type: ignore[no-untyped-def]  # JIT kernel (kernels/_triton.py)
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_sin_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    num_heads, num_kv_heads, half, block_size,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cache,
    stride_cb, stride_co, stride_ch,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BF16_BITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cos, sin = token_cos_sin(positions_ptr, cos_sin_ptr, token, half, stride_cache, BLOCK_HALF)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cs_mask = dims < half
    rotate_heads(q_ptr + token * stride_qt, stride_qh, num_heads, cos, sin, half, BLOCK_HQ, BLOCK_HALF)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_HK)[:, None]
        mask = (heads < num_kv_heads) & cs_mask
        src = token * stride_kt + heads * stride_kh + dims
        x1 = tl.load(k_ptr + src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(k_ptr + src + half, mask=mask, other=0.0).to(tl.float32)
        r1 = x1 * cos - x2 * sin
        r2 = x2 * cos + x1 * sin
        dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_co + heads * stride_ch + dims
        vsrc = token * stride_vt + heads * stride_vh + dims
        v1 = tl.load(v_ptr + vsrc, mask=mask, other=0.0)
        v2 = tl.load(v_ptr + vsrc + half, mask=mask, other=0.0)
        if BF16_BITS:  # fp32 K/V into a bfloat16 cache seen as int16, rounded like torch's cast
            tl.store(key_cache_ptr + dst, bf16_bits(r1), mask=mask)
            tl.store(key_cache_ptr + dst + half, bf16_bits(r2), mask=mask)
            tl.store(value_cache_ptr + dst, bf16_bits(v1.to(tl.float32)), mask=mask)
            tl.store(value_cache_ptr + dst + half, bf16_bits(v2.to(tl.float32)), mask=mask)
        else:
            # k's rounding to its own dtype first, as rotary's in-place result then store_kv's cast
            r1 = r1.to(k_ptr.dtype.element_ty)
            r2 = r2.to(k_ptr.dtype.element_ty)
            tl.store(key_cache_ptr + dst, r1.to(key_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(key_cache_ptr + dst + half, r2.to(key_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(value_cache_ptr + dst, v1.to(value_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(value_cache_ptr + dst + half, v2.to(value_cache_ptr.dtype.element_ty), mask=mask)


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_sin_cache: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Triton version of :func:`rotary_store_kv_ref` (same contract)."""
    if key_cache.dtype in QUANT_DTYPES:
        rotary(q, k, positions, cos_sin_cache)
        store_kv(k, v, key_cache, value_cache, slot_mapping)
        return
    check_rotary_args(q, k, positions, cos_sin_cache)
    check_store_kv_args(k, v, key_cache, value_cache, slot_mapping)
    check_launchable(q.device)
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    bf16_bits = key_cache.dtype == torch.bfloat16 and k.dtype == torch.float32
    caches = (key_cache.view(torch.int16), value_cache.view(torch.int16)) if bf16_bits else (key_cache, value_cache)
    _rotary_store_kv_kernel[(num_tokens,)](
        q, k, v, positions, cos_sin_cache, *caches, slot_mapping,
        num_heads, k.shape[1], head_dim // 2, key_cache.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        BLOCK_HQ=triton.next_power_of_2(num_heads), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2), BF16_BITS=bf16_bits,
    )

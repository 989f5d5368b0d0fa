"""Write this step's keys and values into the paged cache, one slot per token.

slot = block_id * block_size + offset_in_block; a negative slot marks a padding token whose K/V
are dropped. The caches are the strided per-layer views of the 6-d cache (see CacheConfig), so
they are written in place through their strides, never copied.

A quantized cache (int8 or float8_e4m3fn, rows of ``head_dim + 4``: codes then an fp32 scale,
see ``kernels.kv_quant``) is written quantized: each token's K and V row per KV head gets its
own scale.
"""

from __future__ import annotations

import torch

from kernels._checks import FLOAT_DTYPES, check_tensor
from kernels._triton import check_launchable, tl, triton
from kernels.kv_quant import QUANT_DTYPES, SCALE_BYTES, check_scale_alignment, quantize_rows


def check_store_kv_args(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                        value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> int:
    """Returns head_dim (the cache's row width, less the scale's bytes when quantized)."""
    check_tensor("key_cache", key_cache, ndim=4, dtypes=FLOAT_DTYPES + QUANT_DTYPES,
                 last_dim_contiguous=True)
    _, _, num_kv_heads, head_dim = key_cache.shape
    if key_cache.dtype in QUANT_DTYPES:
        head_dim -= SCALE_BYTES
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
    return head_dim


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value: [N, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads,
    head_dim] (strided views; head_dim + 4 when quantized); slot_mapping: [N] int64, < 0 = skip.
    Writes in place; K/V are cast to the cache dtype, or quantized per row."""
    check_store_kv_args(key, value, key_cache, value_cache, slot_mapping)
    block_size = key_cache.shape[1]
    slots = slot_mapping.long()
    if slots.numel() and bool((slots < 0).any()):
        valid = slots >= 0
        slots, key, value = slots[valid], key[valid], value[valid]
    block_ids, offsets = slots // block_size, slots % block_size
    if key_cache.dtype in QUANT_DTYPES:
        key_cache[block_ids, offsets] = quantize_rows(key, key_cache.dtype)
        value_cache[block_ids, offsets] = quantize_rows(value, key_cache.dtype)
        return
    key_cache[block_ids, offsets] = key.to(key_cache.dtype)
    value_cache[block_ids, offsets] = value.to(value_cache.dtype)


@triton.jit
def bf16_bits(x):  # type: ignore[no-untyped-def]  # JIT kernel (kernels/_triton.py)
    """fp32 -> bfloat16 bit patterns (int16), rounded to nearest even like torch's cast (Triton
    3.9's interpreter truncates in .to(tl.bfloat16)); NaN -> 0x7FC0, torch's NaN."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, rounded).to(tl.int16)


@triton.jit
def _store_kv_kernel(  # type: ignore[no-untyped-def]  # JIT kernel (kernels/_triton.py)
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    num_kv_heads, head_dim, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BF16_BITS: tl.constexpr,
):
    # One program per token: copy its [num_kv_heads, head_dim] K and V into its slot. BF16_BITS:
    # fp32 K/V into a bfloat16 cache seen as int16, rounded by bf16_bits.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_kv_heads) & (dims < head_dim)
        dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_co + heads * stride_ch + dims
        k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
        v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
        if BF16_BITS:
            tl.store(key_cache_ptr + dst, bf16_bits(k.to(tl.float32)), mask=mask)
            tl.store(value_cache_ptr + dst, bf16_bits(v.to(tl.float32)), mask=mask)
        else:
            tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize(  # type: ignore[no-untyped-def]  # JIT kernel (kernels/_triton.py)
    x, mask, QMAX: tl.constexpr, IS_FP8: tl.constexpr,
):
    """Rows of x [BLOCK_H, BLOCK_D] fp32 -> (codes as uint8 bit patterns, scales [BLOCK_H])."""
    x = tl.where(mask, x, 0.0)
    amax = tl.max(tl.abs(x), axis=1)
    # IEEE divisions (div_rn) like the reference's torch ops: on CUDA Triton's `/` on fp32 is the
    # approximate div.full.f32 (2 ulp), which made the scales differ bitwise from the reference
    scale = tl.math.div_rn(amax, QMAX)
    inv = tl.where(amax > 0, tl.math.div_rn(1.0, tl.where(amax > 0, scale, 1.0)), 0.0)
    scaled = tl.minimum(tl.maximum(x * inv[:, None], -QMAX), QMAX)
    if IS_FP8:
        # float8_e4m3fn by its bits, ties to even (Triton 3.9's interpreter drops the carry
        # when .to(tl.float8e4nv) rounds up into the next binade): normals round fp32's mantissa
        # to 3 bits, the carry moving into the exponent; below 2^-6, m * 2^-9 with m = rint(a * 512)
        a = tl.abs(scaled)
        bits = a.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
        subnormal = ((a * 512.0 + 12582912.0) - 12582912.0).to(tl.int32)
        magnitude = tl.where(a >= 0.015625, normal, subnormal)
        codes = (magnitude | tl.where(scaled < 0, 0x80, 0)).to(tl.uint8)
    else:
        # round half to even: adding 1.5 * 2^23 leaves the integer in the low mantissa bits
        rounded = (scaled + 12582912.0) - 12582912.0
        codes = rounded.to(tl.int32).to(tl.int8).to(tl.uint8, bitcast=True)
    return codes, scale


@triton.jit
def _store_kv_quant_kernel(  # type: ignore[no-untyped-def]  # JIT kernel (kernels/_triton.py)
    key_ptr, value_ptr, key_codes_ptr, value_codes_ptr, key_scale_ptr, value_scale_ptr, slot_ptr,
    num_kv_heads, head_dim, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QMAX: tl.constexpr, IS_FP8: tl.constexpr,
):
    # One program per token: quantize its K and V rows, one scale per KV head. Codes go through a
    # uint8 view of the cache (bytes), scales through a float32 view (element = 4 bytes), so the
    # row at byte offset r has its scale at float offset (r + head_dim) / 4.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads[:, None] < num_kv_heads) & (dims < head_dim)
        row = (slot // block_size) * stride_cb + (slot % block_size) * stride_co + heads * stride_ch
        k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims, mask=mask, other=0.0)
        v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims, mask=mask, other=0.0)
        k_codes, k_scale = _quantize(k.to(tl.float32), mask, QMAX, IS_FP8)
        v_codes, v_scale = _quantize(v.to(tl.float32), mask, QMAX, IS_FP8)
        tl.store(key_codes_ptr + row[:, None] + dims, k_codes, mask=mask)
        tl.store(value_codes_ptr + row[:, None] + dims, v_codes, mask=mask)
        head_valid = heads < num_kv_heads
        tl.store(key_scale_ptr + (row + head_dim) // 4, k_scale, mask=head_valid)
        tl.store(value_scale_ptr + (row + head_dim) // 4, v_scale, mask=head_valid)


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton version of :func:`store_kv_ref` (same contract; a quantized cache gets the same
    codes up to a rounding tie, where the division by the scale may land either side)."""
    head_dim = check_store_kv_args(key, value, key_cache, value_cache, slot_mapping)
    check_launchable(key.device)
    num_tokens, num_kv_heads, _ = key.shape
    if num_tokens == 0:
        return
    common = (num_kv_heads, head_dim, key_cache.shape[1],
              key.stride(0), key.stride(1), value.stride(0), value.stride(1),
              key_cache.stride(0), key_cache.stride(1), key_cache.stride(2))
    blocks = dict(BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim))
    if key_cache.dtype in QUANT_DTYPES:
        check_scale_alignment(key_cache, head_dim)
        _store_kv_quant_kernel[(num_tokens,)](
            key, value, key_cache.view(torch.uint8), value_cache.view(torch.uint8),
            key_cache.view(torch.float32), value_cache.view(torch.float32), slot_mapping, *common,
            QMAX=448.0 if key_cache.dtype == torch.float8_e4m3fn else 127.0,
            IS_FP8=key_cache.dtype == torch.float8_e4m3fn, **blocks)
        return
    if key_cache.dtype == torch.bfloat16 and key.dtype == torch.float32:
        _store_kv_kernel[(num_tokens,)](key, value, key_cache.view(torch.int16), value_cache.view(torch.int16),
                                        slot_mapping, *common, BF16_BITS=True, **blocks)
        return
    _store_kv_kernel[(num_tokens,)](key, value, key_cache, value_cache, slot_mapping, *common,
                                    BF16_BITS=False, **blocks)

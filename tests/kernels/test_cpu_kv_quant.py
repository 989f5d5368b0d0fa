"""The quantized KV cache on CPU: the row encoding (kernels/kv_quant.py), the compiled store_kv
writing it and the compiled paged attention reading it, against the torch reference.

Tolerances. The compiled kernels and the reference compute the same codes (exactly: same
arithmetic, same rounding) and attend over the same dequantized values, so they agree to fp32
rounding (1e-5). Against attention over the unquantized fp32 cache the error is the
quantization's: int8 rounds each value by at most scale / 2 = max|row| / 254, fp8 keeps 3
mantissa bits (relative error <= 1/16); on unit-normal K/V with head_dim 64 that bounds the
output error by 0.03 (int8) and 0.15 (fp8), what the assertions allow.
"""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import quant_format
from kernels import kv_quant
from kernels.cpu import CpuKernelsUnavailable, library
from kernels.kv_quant import dequantize_rows, quantize_rows
from kernels.paged_attention_ref import paged_attention_ref
from kernels.store_kv import store_kv_ref

try:
    library("attention")
    library("elementwise")
except CpuKernelsUnavailable as exc:  # no C++ compiler here: the engine falls back to the reference
    pytest.skip(str(exc), allow_module_level=True)

from kernels.cpu import elementwise  # noqa: E402
from kernels.cpu.attention import paged_attention  # noqa: E402

QUANT = [torch.int8, torch.float8_e4m3fn]
VS_FP32_ATOL = {torch.int8: 0.03, torch.float8_e4m3fn: 0.15}
MIXED = ([37, 1, 64, 50, 24, 90, 16], [1, 1, 32, 20, 24, 4, 1])  # decode, prefill chunks, verify
DECODE_LONG = ([700, 300], [1, 1])  # long enough to split the keys across threads


def test_scale_bytes_agree_between_engine_and_kernels():
    assert quant_format.SCALE_BYTES == kv_quant.SCALE_BYTES == 4
    assert quant_format.stored_head_dim("int8", 64) == kv_quant.stored_head_dim(torch.int8, 64) == 68
    assert quant_format.stored_head_dim("float32", 64) == 64


@pytest.mark.parametrize("dtype", QUANT)
def test_rows_round_trip_within_the_format_error(dtype):
    x = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(0)) * 3
    x[0, 0] = 0.0  # an all-zero row: scale 0, decodes to zeros
    rows = quantize_rows(x, dtype)
    assert rows.shape == (50, 3, 68) and rows.dtype == dtype
    back = dequantize_rows(rows)
    amax = x.abs().amax(-1, keepdim=True)
    if dtype == torch.int8:
        assert bool(((back - x).abs() <= amax / 254 * 1.0001 + 1e-7).all())
    else:  # 3 mantissa bits: half an ulp is 1/16 relative, subnormals 2^-10 * scale absolute
        assert bool(((back - x).abs() <= x.abs() / 16 + amax / 448 * 2**-10 + 1e-7).all())
    assert bool((back[0, 0] == 0).all())
    assert bool((back.abs().amax(-1, keepdim=True) - amax).abs().le(amax * 1e-6).all())


def _quantized_cache(num_blocks, num_layers, block_size, num_kv_heads, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim, generator=gen)
    return values, quantize_rows(values, dtype)


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_compiled_store_writes_the_reference_codes(dtype, num_threads):
    torch.set_num_threads(num_threads)
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, heads, head_dim = 6, 16, 3, 64
    _, cache_ref = _quantized_cache(num_blocks, 3, block_size, heads, head_dim, dtype)
    cache = cache_ref.clone()
    num_tokens = 40
    key = torch.randn(num_tokens, heads, head_dim, generator=gen) * 4
    value = torch.randn(num_tokens, heads, head_dim, generator=gen) * 0.01
    key[3] = 0.0
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[5] = -1  # padding: dropped
    store_kv_ref(key, value, cache_ref[:, 1, 0], cache_ref[:, 1, 1], slots)
    elementwise.store_kv(key, value, cache[:, 1, 0], cache[:, 1, 1], slots)
    assert torch.equal(cache.view(torch.uint8), cache_ref.view(torch.uint8))
    written = dequantize_rows(cache[:, 1, 0].reshape(-1, heads, head_dim + 4)[slots[slots >= 0]])
    torch.testing.assert_close(written, key[slots >= 0], atol=float(key.abs().max()) / 15, rtol=0.07)


def _case(seq_lens, query_lens, num_heads, num_kv_heads, dtype, head_dim=64, block_size=16, seed=0):
    """(args over the quantized cache, args over its fp32 original): layer-1 strided views,
    shuffled block ids, junk past each sequence's last block."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    values, cache = _quantized_cache(num_blocks, 3, block_size, num_kv_heads, head_dim, dtype, seed)
    return paged_case_args(values, cache, seq_lens, query_lens, blocks_per_seq, num_heads, head_dim, gen)


def paged_case_args(values, cache, seq_lens, query_lens, blocks_per_seq, num_heads, head_dim, gen):
    """Attention arguments over ``cache`` and over ``values`` (its unquantized original, same
    layout): layer-1 strided views, shuffled block ids, junk past each sequence's last block."""
    ids = torch.randperm(values.shape[0], generator=gen)
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 2), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = ids[used:used + n]
        block_tables[i, n + 1] = 10**6
        used += n
    cu = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    query = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen)
    rest = (block_tables, torch.tensor(seq_lens, dtype=torch.int32), cu, max(query_lens), head_dim ** -0.5)
    return ((query, cache[:, 1, 0], cache[:, 1, 1], *rest), (query, values[:, 1, 0], values[:, 1, 1], *rest))


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("batch", [MIXED, DECODE_LONG], ids=["mixed", "decode-long"])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)], ids=["gqa3", "mha"])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_compiled_attention_reads_the_quantized_cache(dtype, batch, heads, num_threads):
    torch.set_num_threads(num_threads)
    quantized, original = _case(*batch, *heads, dtype)
    actual = paged_attention(*quantized)
    torch.testing.assert_close(actual, paged_attention_ref(*quantized), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(actual, paged_attention_ref(*original), rtol=0, atol=VS_FP32_ATOL[dtype])


@pytest.mark.parametrize("dtype", QUANT)
def test_head_dim_128_and_a_long_prompt_chunk(dtype):
    quantized, original = _case([40], [40], 8, 2, dtype, head_dim=128, block_size=8)
    torch.testing.assert_close(paged_attention(*quantized), paged_attention_ref(*quantized),
                               rtol=1e-5, atol=1e-5)
    quantized, original = _case([1100], [1050], 2, 1, dtype)  # past LONG_QUERY_THRESHOLD: SDPA path
    torch.testing.assert_close(paged_attention(*quantized), paged_attention_ref(*original), rtol=0,
                               atol=VS_FP32_ATOL[dtype])


def test_a_quantized_cache_without_scale_bytes_is_refused():
    quantized, _ = _case([20], [1], 4, 4, torch.int8)
    query, key_cache, value_cache, *rest = quantized
    narrow_k, narrow_v = key_cache[..., :64], value_cache[..., :64]
    for attention in (paged_attention, paged_attention_ref):
        with pytest.raises(ValueError, match="key_cache"):
            attention(query, narrow_k, narrow_v, *rest)
    with pytest.raises(ValueError, match="scale"):
        elementwise.store_kv(torch.zeros(1, 4, 68), torch.zeros(1, 4, 68), key_cache[..., :4],
                             value_cache[..., :4], torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="key"):
        store_kv_ref(torch.zeros(1, 4, 68), torch.zeros(1, 4, 68), key_cache, value_cache,
                     torch.zeros(1, dtype=torch.int64))

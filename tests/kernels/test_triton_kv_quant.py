"""The Triton store_kv and paged attention on a quantized KV cache (int8, float8_e4m3fn) against
the torch reference; on CPU under TRITON_INTERPRET=1 (small shapes: the interpreter is slow).

Tolerances: the Triton store divides by the scale where the reference multiplies by its
inverse, so a value at a rounding tie may land on the neighbouring code (at most 1 int8 code or
one fp8 ulp, on a few of the values); the scales are bit-identical. Attention over the same
quantized cache agrees with the reference to fp32 rounding (1e-4, the fp32 tolerance of the
other Triton attention tests); against the unquantized fp32 cache, to the quantization error
bounds of tests/kernels/test_cpu_kv_quant.py.
"""

from __future__ import annotations

import pytest
import torch

from kernels.kv_quant import SCALE_BYTES, dequantize_rows
from kernels.paged_attention import paged_attention
from kernels.paged_attention_ref import paged_attention_ref
from kernels.store_kv import store_kv, store_kv_ref
from tests.kernels.helpers import DEVICE, requires_triton
from tests.kernels.test_cpu_kv_quant import QUANT, VS_FP32_ATOL, _case

pytestmark = requires_triton


@pytest.mark.parametrize("dtype", QUANT)
def test_triton_store_writes_the_reference_codes(dtype):
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, heads, head_dim = 4, 8, 3, 64
    cache_ref = torch.zeros(num_blocks, 2, 2, block_size, heads, head_dim + SCALE_BYTES, dtype=dtype)
    cache = cache_ref.clone().to(DEVICE)
    key = torch.randn(10, heads, head_dim, generator=gen) * 3
    value = torch.randn(10, heads, head_dim, generator=gen)
    key[2] = 0.0
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:10]
    slots[4] = -1
    store_kv_ref(key, value, cache_ref[:, 1, 0], cache_ref[:, 1, 1], slots)
    store_kv(key.to(DEVICE), value.to(DEVICE), cache[:, 1, 0], cache[:, 1, 1], slots.to(DEVICE))
    cache = cache.cpu()
    scales, scales_ref = cache[..., head_dim:], cache_ref[..., head_dim:]
    assert torch.equal(scales.view(torch.uint8), scales_ref.view(torch.uint8))
    codes, codes_ref = cache[..., :head_dim].float(), cache_ref[..., :head_dim].float()
    differ = codes != codes_ref
    assert int(differ.sum()) <= codes.numel() // 100, "more than 1% of the codes differ"
    step = 1.0 if dtype == torch.int8 else codes_ref.abs() / 8 + 2**-9
    assert bool(((codes - codes_ref).abs() <= step).all())
    torch.testing.assert_close(dequantize_rows(cache), dequantize_rows(cache_ref),
                               atol=float(key.abs().max()) / 100, rtol=0.07)


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("num_splits", [1, 2])
def test_triton_attention_reads_the_quantized_cache(dtype, num_splits):
    # decode, a prefill chunk on a prefix, a whole prompt: 9 query / 3 KV heads (SmolLM2's GQA)
    quantized, original = _case([37, 20, 9], [1, 6, 9], 9, 3, dtype, block_size=8)
    on_device = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in quantized]
    actual = paged_attention(*on_device, num_splits=num_splits).cpu()
    torch.testing.assert_close(actual, paged_attention_ref(*quantized), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(actual, paged_attention_ref(*original), rtol=0, atol=VS_FP32_ATOL[dtype])

"""The bfloat16 KV cache on CPU (``--kv-cache-dtype bf16``): the compiled store_kv writing it and
the compiled paged attention reading it, against the torch reference.

Tolerances. The compiled store rounds to nearest even like ``Tensor.to(torch.bfloat16)``, so its
bits equal the reference's. The compiled attention and the reference attend over the same bf16
values widened to fp32 (exact), so they agree to fp32 rounding (1e-5). Against attention over the
fp32 values before rounding, the error is bf16's: 8 significant bits, a relative error of at
most 2^-9 per value; on unit-normal K/V with head_dim 64 that moves a score by about
|q| |k| 2^-9 / sqrt(64) ~ 0.01 and the output by well under 0.02, what the assertion allows.
"""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import quant_format
from kernels.cpu import CpuKernelsUnavailable, library
from kernels.paged_attention_ref import paged_attention_ref
from kernels.store_kv import store_kv_ref

try:
    library("attention")
    library("elementwise")
except CpuKernelsUnavailable as exc:  # no C++ compiler here: the engine falls back to the reference
    pytest.skip(str(exc), allow_module_level=True)

from kernels.cpu import elementwise  # noqa: E402
from kernels.cpu.attention import paged_attention  # noqa: E402
from tests.kernels.test_cpu_kv_quant import paged_case_args  # noqa: E402

VS_FP32_ATOL = 0.02
# decode, prefill chunks on a prefix (the multi-query step), whole prompts, spec verification
MIXED = ([37, 1, 64, 50, 24, 90, 16, 53], [1, 1, 32, 20, 24, 4, 1, 9])
DECODE_LONG = ([700, 300], [1, 1])  # long enough to split the keys across threads
PREFIX_HIT = ([1012, 1012], [112, 1])  # 112 new tokens on a cached prefix, and a decode


def test_bf16_halves_the_bytes_per_token():
    assert quant_format.cache_dtype_for("bf16", "float32") == "bfloat16"
    assert not quant_format.is_quantized("bfloat16")
    fp32 = quant_format.bytes_per_token("float32", 30, 3, 64, 4)
    assert quant_format.bytes_per_token("bfloat16", 30, 3, 64, 2) * 2 == fp32


def _case(seq_lens, query_lens, num_heads, num_kv_heads, head_dim=64, block_size=16, seed=0):
    """(args over a bf16 cache, args over the same values in fp32 before rounding): layer-1
    strided views of a 3-layer engine-layout cache, shuffled block ids, junk past each table."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    values = torch.randn(num_blocks, 3, 2, block_size, num_kv_heads, head_dim, generator=gen)
    cache = values.bfloat16()
    return paged_case_args(values, cache, seq_lens, query_lens, blocks_per_seq, num_heads, head_dim, gen)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_compiled_store_writes_the_reference_bits(num_threads):
    torch.set_num_threads(num_threads)
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, heads, head_dim = 6, 16, 3, 64
    cache_ref = torch.randn(num_blocks, 3, 2, block_size, heads, head_dim, generator=gen).bfloat16()
    cache = cache_ref.clone()
    num_tokens = 40
    key = torch.randn(num_tokens, heads, head_dim, generator=gen) * 4
    value = torch.randn(num_tokens, heads, head_dim, generator=gen) * 1e-3
    key[3, 0, :4] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -0.0, float("inf")])  # ties, signs
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[5] = -1  # padding: dropped
    store_kv_ref(key, value, cache_ref[:, 1, 0], cache_ref[:, 1, 1], slots)
    elementwise.store_kv(key, value, cache[:, 1, 0], cache[:, 1, 1], slots)
    assert torch.equal(cache.view(torch.int16), cache_ref.view(torch.int16))


@pytest.mark.parametrize("batch", [MIXED, DECODE_LONG, PREFIX_HIT], ids=["mixed", "decode-long", "prefix-hit"])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)], ids=["gqa3", "mha"])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_compiled_attention_reads_the_bf16_cache(batch, heads, num_threads):
    torch.set_num_threads(num_threads)
    bf16, original = _case(*batch, *heads)
    actual = paged_attention(*bf16)
    torch.testing.assert_close(actual, paged_attention_ref(*bf16), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(actual, paged_attention_ref(*original), rtol=0, atol=VS_FP32_ATOL)


def test_head_dim_128_and_partial_blocks():
    bf16, _ = _case([40, 29], [40, 9], 8, 2, head_dim=128, block_size=8)
    torch.testing.assert_close(paged_attention(*bf16), paged_attention_ref(*bf16), rtol=1e-5, atol=1e-5)


def test_mismatched_caches_are_refused():
    bf16, original = _case([20], [1], 4, 4)
    query, key_cache, _, *rest = bf16
    with pytest.raises(ValueError, match="value_cache must have the dtype of key_cache"):
        paged_attention(query, key_cache, original[2], *rest)
    with pytest.raises(ValueError, match="value_cache"):
        elementwise.store_kv(torch.zeros(1, 4, 64), torch.zeros(1, 4, 64), key_cache, original[2],
                             torch.zeros(1, dtype=torch.int64))

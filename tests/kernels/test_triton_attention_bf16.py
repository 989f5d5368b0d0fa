"""The Triton store_kv and paged attention on a bfloat16 KV cache under fp32 queries
(``--kv-cache-dtype bf16`` with an fp32 model) against the torch reference; on CPU under
TRITON_INTERPRET=1 (small shapes: the interpreter is slow).

Tolerances: the store's cast rounds to nearest even like the reference's, so the bits agree.
Attention over the same bf16 cache agrees with the reference to fp32 rounding (1e-4, the fp32
tolerance of the other Triton attention tests); against the fp32 values before rounding, to
bf16's error bound of tests/kernels/test_cpu_attention_bf16.py.
"""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import paged_attention
from kernels.paged_attention_ref import paged_attention_ref
from kernels.store_kv import store_kv, store_kv_ref
from tests.kernels.helpers import DEVICE, requires_triton
from tests.kernels.test_cpu_attention_bf16 import VS_FP32_ATOL, _case

pytestmark = requires_triton


def test_triton_store_writes_the_reference_bits():
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, heads, head_dim = 4, 8, 3, 64
    cache_ref = torch.zeros(num_blocks, 2, 2, block_size, heads, head_dim, dtype=torch.bfloat16)
    cache = cache_ref.clone().to(DEVICE)
    key = torch.randn(10, heads, head_dim, generator=gen) * 3
    value = torch.randn(10, heads, head_dim, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:10]
    slots[4] = -1
    store_kv_ref(key, value, cache_ref[:, 1, 0], cache_ref[:, 1, 1], slots)
    store_kv(key.to(DEVICE), value.to(DEVICE), cache[:, 1, 0], cache[:, 1, 1], slots.to(DEVICE))
    assert torch.equal(cache.cpu().view(torch.int16), cache_ref.view(torch.int16))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_triton_attention_reads_the_bf16_cache(num_splits):
    # decode, a prefill chunk on a prefix, a whole prompt: 9 query / 3 KV heads (SmolLM2's GQA)
    bf16, original = _case([37, 20, 9], [1, 6, 9], 9, 3, block_size=8)
    on_device = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in bf16]
    actual = paged_attention(*on_device, num_splits=num_splits).cpu()
    torch.testing.assert_close(actual, paged_attention_ref(*bf16), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(actual, paged_attention_ref(*original), rtol=0, atol=VS_FP32_ATOL)

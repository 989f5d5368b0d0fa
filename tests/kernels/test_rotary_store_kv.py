"""The fused rotary + KV store (kernels/rotary_store_kv.py) against ``rotary`` then ``store_kv``'s
references: q rotated in place, the rotated k and v in their slots, skipped slots untouched, every
cache dtype; on CPU under TRITON_INTERPRET=1, natively on CUDA."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_quant import SCALE_BYTES
from kernels.rotary import build_cos_sin_cache
from kernels.rotary_store_kv import rotary_store_kv, rotary_store_kv_ref
from tests.kernels.helpers import DEVICE, requires_triton

pytestmark = requires_triton


def _case(dtype: torch.dtype, cache_dtype: torch.dtype, num_tokens: int = 7, heads: int = 9, kv_heads: int = 3,
          head_dim: int = 64, block_size: int = 8, num_blocks: int = 4):
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = torch.split(qkv, [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.reshape(num_tokens, heads, head_dim)  # strided views of one qkv matmul, as the model has
    k, v = k.reshape(num_tokens, kv_heads, head_dim), v.reshape(num_tokens, kv_heads, head_dim)
    width = head_dim + SCALE_BYTES if cache_dtype in (torch.int8, torch.float8_e4m3fn) else head_dim
    cache = torch.zeros(num_blocks, 2, 2, block_size, kv_heads, width).to(cache_dtype)
    positions = torch.randint(0, 500, (num_tokens,), generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[2] = -1
    return q, k, v, positions, build_cos_sin_cache(head_dim, 512, 10000.0), cache, slots


def _run(fn, case, device):
    q, k, v, positions, cos_sin, cache, slots = (t.clone().to(device) for t in case)
    fn(q, k, v, positions, cos_sin, cache[:, 1, 0], cache[:, 1, 1], slots)
    return q.cpu(), cache.cpu()


@pytest.mark.parametrize("dtype, cache_dtype", [
    (torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16), (torch.float32, torch.int8)])
def test_fused_equals_rotary_then_store(dtype, cache_dtype):
    case = _case(dtype, cache_dtype)
    q_ref, cache_ref = _run(rotary_store_kv_ref, case, "cpu")
    q, cache = _run(rotary_store_kv, case, DEVICE)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=tol, atol=tol)
    if cache_dtype == torch.int8:  # the quantized path is the two kernels: codes within one step
        assert ((cache.float() - cache_ref.float()).abs() <= 1).all()
        return
    torch.testing.assert_close(cache.float(), cache_ref.float(), rtol=tol, atol=tol)
    assert torch.count_nonzero(cache[:, 0]) == 0  # the other layer's blocks untouched


def test_skipped_and_empty():
    q, k, v, positions, cos_sin, cache, slots = (t.to(DEVICE) for t in _case(torch.float32, torch.float32))
    slots.fill_(-1)
    rotary_store_kv(q, k, v, positions, cos_sin, cache[:, 1, 0], cache[:, 1, 1], slots)
    assert torch.count_nonzero(cache) == 0
    rotary_store_kv(q[:0], k[:0], v[:0], positions[:0], cos_sin, cache[:, 1, 0], cache[:, 1, 1], slots[:0])
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_store_kv(q, k, v, positions, cos_sin, cache[:, 1, 0], cache[:, 1, 1], slots[:3])

"""The decode step's fused rotary + KV store + paged attention (``rotary_store_attention``,
kernels/paged_attention.py) against the two kernels it replaces and against the references:
the same output and the same cache, q and k left as they were, every split count (the split
that walks the last key tile is the one that stores), skipped slots, bad arguments refused;
on CPU under TRITON_INTERPRET=1, natively on CUDA."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import (
    paged_attention,
    rotary_store_attention,
    rotary_store_attention_ref,
)
from kernels.rotary import build_cos_sin_cache
from kernels.rotary_store_kv import rotary_store_kv
from tests.kernels.helpers import DEVICE, assert_close, make_attention_case, requires_triton

pytestmark = requires_triton

# ragged contexts: a first token, block boundaries (16, 32, 33), one past a 64-key tile, long
SEQ_LENS = [1, 300, 16, 33, 129, 64, 65]


def _case(num_heads: int, num_kv_heads: int, dtype: torch.dtype, block_size: int = 16,
          head_dim: int = 64, seq_lens: list[int] = SEQ_LENS, skip_row: int | None = 2):
    case = make_attention_case(seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, head_dim,
                               block_size, dtype)
    base = case.key_cache._base  # the engine's 6-d cache; each run gets its own copy
    assert base is not None and base.dim() == 6
    gen = torch.Generator().manual_seed(3)
    num = len(seq_lens)
    # q, k, v as strided views of one qkv row per token, as the model has them
    qkv = torch.randn(num, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k, v = torch.split(qkv, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    q = q.reshape(num, num_heads, head_dim)
    k, v = k.reshape(num, num_kv_heads, head_dim), v.reshape(num, num_kv_heads, head_dim)
    positions = case.seq_lens.long() - 1
    last_block = case.block_tables.long().gather(1, (positions // block_size)[:, None])[:, 0]
    slots = last_block * block_size + positions % block_size
    if skip_row is not None:
        slots[skip_row] = -1  # not stored: the cache's own value at that position is attended
    cos_sin = build_cos_sin_cache(head_dim, 512, 10000.0).to(DEVICE)
    return case, base, q, k, v, positions, cos_sin, slots


def _fused(case, base, q, k, v, positions, cos_sin, slots, impl=rotary_store_attention, **kw):
    cache = base.clone()
    out = impl(q, k, v, positions, cos_sin, cache[:, 1, 0], cache[:, 1, 1], slots, case.block_tables,
               case.seq_lens, case.cu_seqlens_q, case.scale, **kw)
    return out, cache


def _two_kernels(case, base, q, k, v, positions, cos_sin, slots, **kw):
    cache = base.clone()
    q, k = q.clone(), k.clone()
    rotary_store_kv(q, k, v, positions, cos_sin, cache[:, 1, 0], cache[:, 1, 1], slots)
    out = paged_attention(q, cache[:, 1, 0], cache[:, 1, 1], case.block_tables, case.seq_lens,
                          case.cu_seqlens_q, 1, case.scale, **kw)
    return out, cache


# each dtype with each GQA ratio (1, 3, 8) and each split count (unsplit, uneven, more splits
# than a short context has key tiles)
@pytest.mark.parametrize("dtype, num_heads, num_kv_heads, num_splits", [
    (torch.float32, 4, 4, 1), (torch.float32, 9, 3, 3), (torch.float32, 8, 1, 8),
    (torch.bfloat16, 4, 4, 8), (torch.bfloat16, 9, 3, 1), (torch.bfloat16, 8, 1, 3)])
def test_fused_equals_the_two_kernels(dtype, num_heads, num_kv_heads, num_splits):
    args = _case(num_heads, num_kv_heads, dtype)
    q0, k0 = args[2].clone(), args[3].clone()
    out, cache = _fused(*args, num_splits=num_splits)
    out_two, cache_two = _two_kernels(*args, num_splits=num_splits)
    if DEVICE.type == "cpu":  # the interpreter: the same arithmetic in the same order
        assert torch.equal(out, out_two)
        assert torch.equal(cache, cache_two)
    else:  # compiled separately: a product may be contracted differently
        assert_close(out, out_two, dtype)
        assert_close(cache, cache_two, dtype)
    assert torch.equal(args[2], q0) and torch.equal(args[3], k0)  # q and k left unrotated
    stored = (cache_two != args[1]).any(dim=(1, 2, 3, 4, 5)).nonzero().flatten().tolist()
    assert stored  # the case stores keys (else the comparison above would prove little)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_the_reference(dtype, block_size):
    args = _case(6, 2, dtype, block_size=block_size)
    out, cache = _fused(*args)
    out_ref, cache_ref = _fused(*args, impl=rotary_store_attention_ref)
    assert_close(out, out_ref, dtype)
    assert_close(cache, cache_ref, dtype)  # the rotated keys and the values in their slots
    base = args[1]
    assert torch.equal(cache[:, 0], base[:, 0])  # the other layer untouched


def test_skipped_slot_reads_the_cache_and_stores_nothing():
    args = _case(4, 4, torch.float32, skip_row=None)
    case, base, q, k, v, positions, cos_sin, slots = args
    slots = torch.full_like(slots, -1)
    out, cache = _fused(case, base, q, k, v, positions, cos_sin, slots, num_splits=3)
    assert torch.equal(cache, base)
    out_ref, _ = _fused(case, base, q, k, v, positions, cos_sin, slots, impl=rotary_store_attention_ref)
    assert_close(out, out_ref, torch.float32)


def test_refuses_what_it_does_not_fuse():
    case, base, q, k, v, positions, cos_sin, slots = _case(4, 4, torch.float32)
    cache = base.to(torch.bfloat16)
    with pytest.raises(ValueError, match="query's dtype"):
        rotary_store_attention(q, k, v, positions, cos_sin, cache[:, 1, 0], cache[:, 1, 1], slots,
                               case.block_tables, case.seq_lens, case.cu_seqlens_q, case.scale)
    with pytest.raises(ValueError, match="decode steps"):
        rotary_store_attention(q[:3], k[:3], v[:3], positions[:3], cos_sin, base[:, 1, 0], base[:, 1, 1],
                               slots[:3], case.block_tables, case.seq_lens, case.cu_seqlens_q, case.scale)
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_store_attention(q, k, v, positions, cos_sin, base[:, 1, 0], base[:, 1, 1], slots[:2],
                               case.block_tables, case.seq_lens, case.cu_seqlens_q, case.scale)



def test_engine_warm_up_falls_back_to_the_two_kernels_when_the_fused_one_fails(monkeypatch, caplog):
    from engine.models.llama import LlamaForCausalLM
    from engine.runner.warmup import warm_up_fused_decode
    from kernels import paged_attention as module
    from kernels.ops import get_ops
    from tests.unit.test_cuda_graphs import CONFIG, random_weights

    model = LlamaForCausalLM(CONFIG, random_weights(CONFIG), get_ops("triton"), DEVICE)
    cache = torch.zeros(4, 1, 2, 4, CONFIG.num_kv_heads, CONFIG.head_dim, device=DEVICE)
    assert warm_up_fused_decode(model, cache[:, 0, 0], cache[:, 0, 1])  # compiles: decode takes it
    assert model.ops.rotary_store_attention is module.rotary_store_attention
    assert not warm_up_fused_decode(model, cache[:, 0, 0].bfloat16(), cache[:, 0, 1].bfloat16())
    assert model.ops.rotary_store_attention is not None  # another dtype's cache: not for it, still on

    def fails(*args, **kwargs):
        raise RuntimeError("PassManager::run failed")  # as a Triton compile error reads

    monkeypatch.setattr(module, "warm_up_fused", fails)
    with caplog.at_level("ERROR", logger="engine.runner.warmup"):
        assert not warm_up_fused_decode(model, cache[:, 0, 0], cache[:, 0, 1])
    assert model.ops.rotary_store_attention is None  # decode steps take the two kernels
    assert "rotary_store_attention" in caplog.text and "PassManager" in caplog.text
    # and the model still decodes: one token of one sequence through the two kernels
    from engine.models.llama import AttentionMetadata

    attn = AttentionMetadata(slot_mapping=torch.tensor([5], device=DEVICE),
                             block_tables=torch.tensor([[1, 2]], dtype=torch.int32, device=DEVICE),
                             seq_lens=torch.tensor([2], dtype=torch.int32, device=DEVICE),
                             cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE), max_seqlen_q=1)
    kv = torch.zeros(4, CONFIG.num_layers, 2, 4, CONFIG.num_kv_heads, CONFIG.head_dim, device=DEVICE)
    hidden = model.forward(torch.tensor([3], device=DEVICE), torch.tensor([1], device=DEVICE), attn, kv)
    assert hidden.shape == (1, CONFIG.hidden_size) and torch.isfinite(hidden).all()

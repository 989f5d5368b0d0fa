"""The compiled CPU rms_norm, rotary, store_kv and silu_and_mul against the torch references: fp32,
the views the model passes (q/k/v split from one fused qkv matmul, per-layer cache views), ragged
vector tails, and bad arguments raising ValueError named like the references'."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache.storage import layer_kv
from kernels.activation import silu_and_mul_ref
from kernels.cpu import CpuKernelsUnavailable
from kernels.rms_norm import rms_norm_ref
from kernels.rotary import build_cos_sin_cache, rotary_ref
from kernels.store_kv import store_kv_ref

try:
    from kernels.cpu import elementwise as cpu
except CpuKernelsUnavailable as exc:
    pytest.skip(f"compiled CPU kernels unavailable: {exc}", allow_module_level=True)

TOL = dict(atol=1e-5, rtol=1e-5)  # only summation order, FMA contraction and exp's last ulp differ


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _split_qkv(num_tokens, num_heads, num_kv_heads, head_dim, seed=0):
    """q, k, v as the model makes them: reshaped column slices of one [T, (Hq + 2 Hkv) * D] matmul output."""
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, seed=seed)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (qkv, q.reshape(num_tokens, num_heads, head_dim), k.reshape(num_tokens, num_kv_heads, head_dim),
            v.reshape(num_tokens, num_kv_heads, head_dim))


@pytest.mark.parametrize("num_rows,hidden", [(1, 576), (5, 100), (3, 7), (0, 64)])
def test_rms_norm_matches_reference(num_rows, hidden):
    x = _randn(num_rows, hidden + 3)[:, :hidden]  # row stride != hidden
    w = _randn(hidden, seed=1)
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), **TOL)


@pytest.mark.parametrize("num_rows,hidden", [(1, 576), (4, 100), (0, 64)])
def test_rms_norm_residual_matches_reference(num_rows, hidden):
    x, w = _randn(num_rows, hidden), _randn(hidden, seed=1)
    residual = _randn(num_rows, 2 * hidden, seed=2)[:, hidden:]
    x_before, residual_before = x.clone(), residual.clone()
    out, residual_out = cpu.rms_norm(x, w, 1e-5, residual)
    ref_out, ref_residual_out = rms_norm_ref(x, w, 1e-5, residual)
    torch.testing.assert_close(out, ref_out, **TOL)
    assert torch.equal(residual_out, ref_residual_out)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 2, 40), (2, 1, 6)])
def test_rotary_matches_reference_on_split_views(dtype, num_heads, num_kv_heads, head_dim):
    max_pos = 8192
    cache = build_cos_sin_cache(head_dim, max_pos, 100000.0)
    positions = torch.tensor([0, 1, 17, 1000, 4095, max_pos - 1], dtype=dtype)
    qkv, q, k, _ = _split_qkv(len(positions), num_heads, num_kv_heads, head_dim)
    expected, q_ref, k_ref, _ = _split_qkv(len(positions), num_heads, num_kv_heads, head_dim)
    cpu.rotary(q, k, positions, cache)
    rotary_ref(q_ref, k_ref, positions, cache)
    torch.testing.assert_close(qkv, expected, **TOL)  # q and k rotated, v untouched


def test_rotary_without_tokens_is_a_no_op():
    cache = build_cos_sin_cache(8, 16, 10000.0)
    cpu.rotary(torch.empty(0, 2, 8), torch.empty(0, 1, 8), torch.empty(0, dtype=torch.int64), cache)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_store_kv_matches_reference_in_a_multi_layer_cache(dtype):
    num_blocks, num_layers, block_size, num_kv_heads, head_dim = 5, 3, 4, 3, 16
    kv_cache = _randn(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim, seed=3)
    expected = kv_cache.clone()
    _, _, key, value = _split_qkv(6, 2, num_kv_heads, head_dim)
    slot_mapping = torch.tensor([7, -1, 0, 19, -1, 12], dtype=dtype)
    cpu.store_kv(key, value, *layer_kv(kv_cache, 1), slot_mapping)
    store_kv_ref(key, value, *layer_kv(expected, 1), slot_mapping)
    assert torch.equal(kv_cache, expected)  # a copy: bit-exact, other layers and slots untouched


@pytest.mark.parametrize("num_rows,inter", [(1, 1536), (3, 20), (0, 16)])
def test_silu_and_mul_matches_reference(num_rows, inter):
    x = _randn(num_rows, 2 * inter + 5, scale=4.0)[:, :2 * inter]
    out = cpu.silu_and_mul(x)
    assert out.shape == (num_rows, inter)
    torch.testing.assert_close(out, silu_and_mul_ref(x), **TOL)


def test_silu_and_mul_extreme_gates():
    gate = torch.tensor([-1e4, -100.0, -88.0, -87.0, -20.0, -1e-8, 0.0, 1e-8, 20.0, 88.0, 100.0, 1e4] + [0.5] * 4)
    x = torch.cat([gate, torch.full_like(gate, 1.5)])[None]
    torch.testing.assert_close(cpu.silu_and_mul(x), silu_and_mul_ref(x), **TOL)


def test_prefill_sized_batches_split_across_threads():
    torch.set_num_threads(2)  # the conftest fixture restores the count
    x, w, residual = _randn(300, 576), _randn(576, seed=1), _randn(300, 576, seed=2)
    for got, want in zip(cpu.rms_norm(x, w, 1e-6, residual), rms_norm_ref(x, w, 1e-6, residual)):
        torch.testing.assert_close(got, want, **TOL)
    gate_up = _randn(64, 2 * 1536, scale=3.0)
    torch.testing.assert_close(cpu.silu_and_mul(gate_up), silu_and_mul_ref(gate_up), **TOL)


def _rms_norm_args():
    return dict(x=_randn(3, 8), weight=torch.ones(8), eps=1e-5, residual=_randn(3, 8, seed=1))


def _rotary_args():
    _, q, k, _ = _split_qkv(3, 4, 2, 8)
    return dict(q=q, k=k, positions=torch.tensor([0, 5, 15]), cos_sin_cache=build_cos_sin_cache(8, 16, 10000.0))


def _store_kv_args():
    key_cache, value_cache = layer_kv(torch.zeros(4, 2, 2, 4, 2, 8), 1)
    return dict(key=_randn(3, 2, 8), value=_randn(3, 2, 8, seed=1), key_cache=key_cache,
                value_cache=value_cache, slot_mapping=torch.tensor([0, -1, 15]))


BAD = {
    "rms_norm x 3-d": (cpu.rms_norm, _rms_norm_args, dict(x=_randn(3, 8, 1)), "x must be 2-d"),
    "rms_norm x half": (cpu.rms_norm, _rms_norm_args, dict(x=_randn(3, 8).half()), "x must have dtype float32"),
    "rms_norm x strided": (cpu.rms_norm, _rms_norm_args, dict(x=_randn(8, 3).t()), "x must have stride 1"),
    "rms_norm weight shape": (cpu.rms_norm, _rms_norm_args, dict(weight=torch.ones(7)), "weight must have shape"),
    "rms_norm weight bf16": (cpu.rms_norm, _rms_norm_args, dict(weight=torch.ones(8, dtype=torch.bfloat16)),
                             "weight must have dtype float32"),
    "rms_norm weight None": (cpu.rms_norm, _rms_norm_args, dict(weight=None), "weight must be a torch.Tensor"),
    "rms_norm residual half": (cpu.rms_norm, _rms_norm_args, dict(residual=_randn(3, 8).half()),
                               "residual must have dtype"),
    "rms_norm residual shape": (cpu.rms_norm, _rms_norm_args, dict(residual=_randn(2, 8)), "residual must have shape"),
    "rotary q 2-d": (cpu.rotary, _rotary_args, dict(q=_randn(3, 32)), "q must be 3-d"),
    "rotary odd head_dim": (cpu.rotary, _rotary_args, dict(q=_randn(3, 4, 7)), "q must have an even head_dim"),
    "rotary k tokens": (cpu.rotary, _rotary_args, dict(k=_randn(2, 2, 8)), "k must have shape"),
    "rotary k half": (cpu.rotary, _rotary_args, dict(k=_randn(3, 2, 8).half()), "k must have dtype float32"),
    "rotary positions float": (cpu.rotary, _rotary_args, dict(positions=torch.zeros(3)), "positions must have dtype"),
    "rotary positions too large": (cpu.rotary, _rotary_args, dict(positions=torch.tensor([0, 16, 1])),
                                   r"positions must be in \[0, 16\)"),
    "rotary positions negative": (cpu.rotary, _rotary_args, dict(positions=torch.tensor([0, 1, -1])),
                                  r"positions must be in \[0, 16\)"),
    "rotary cache head_dim": (cpu.rotary, _rotary_args, dict(cos_sin_cache=build_cos_sin_cache(6, 16, 1e4)),
                              "cos_sin_cache must have shape"),
    "rotary cache strided": (cpu.rotary, _rotary_args, dict(cos_sin_cache=_randn(16, 16)[:, :8]),
                             "cos_sin_cache must be contiguous"),
    "store_kv cache 3-d": (cpu.store_kv, _store_kv_args, dict(key_cache=torch.zeros(4, 4, 16)),
                           "key_cache must be 4-d"),
    "store_kv value_cache strides": (cpu.store_kv, _store_kv_args, dict(value_cache=torch.zeros(4, 4, 2, 8)),
                                     "value_cache must have the strides"),
    "store_kv key heads": (cpu.store_kv, _store_kv_args, dict(key=_randn(3, 1, 8)), "key must have shape"),
    "store_kv value tokens": (cpu.store_kv, _store_kv_args, dict(value=_randn(2, 2, 8)), "value must have shape"),
    "store_kv key half": (cpu.store_kv, _store_kv_args, dict(key=_randn(3, 2, 8).half()), "key must have dtype"),
    "store_kv slots length": (cpu.store_kv, _store_kv_args, dict(slot_mapping=torch.tensor([0, 1])),
                              "slot_mapping must have shape"),
    "store_kv slot too large": (cpu.store_kv, _store_kv_args, dict(slot_mapping=torch.tensor([0, 16, 1])),
                                "slot_mapping must be < num_blocks"),
    "silu_and_mul odd": (cpu.silu_and_mul, lambda: dict(x=_randn(2, 5)), {}, "x must have an even last dim"),
    "silu_and_mul half": (cpu.silu_and_mul, lambda: dict(x=_randn(2, 6).half()), {}, "x must have dtype float32"),
}


IN_PLACE = ("q", "k", "key_cache", "value_cache")


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_arguments_raise_value_error_naming_them(bad):
    fn, make_args, changes, message = BAD[bad]
    args = make_args() | changes
    before = {name: args[name].clone() for name in IN_PLACE if isinstance(args.get(name), torch.Tensor)}
    with pytest.raises(ValueError, match=message):
        fn(**args)
    # Every check runs before the first write: what is updated in place is untouched.
    assert all(torch.equal(args[name], tensor) for name, tensor in before.items())


@pytest.mark.parametrize("vocab", [49152, 37, 5])  # whole vectors, a ragged tail, a tail only
def test_row_argmax_is_torch_max_indices(vocab):
    from engine.sampling.sampler import argmax_rows

    logits = _randn(4, vocab + 3)[:, :vocab]  # row stride != vocab
    logits[1, vocab // 3] = logits[1, vocab - 1] = logits[1].max() + 1  # a tie: the first index wins
    logits[2, vocab - 1] = logits[2].max() + 1  # the maximum in the tail
    logits[3] = 0.0
    logits[3, vocab // 2] = -0.0  # all equal (-0.0 == 0.0): index 0, as torch's
    assert cpu.row_argmax(logits) == argmax_rows(logits) == logits.max(dim=-1).indices.tolist()
    assert cpu.row_argmax(logits)[1] == vocab // 3
    assert cpu.row_argmax(logits[:0]) == []


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "all -inf"])
def test_row_argmax_defers_rows_without_a_finite_maximum(bad):
    logits = _randn(3, 100)
    if bad == "all -inf":
        logits[1] = float("-inf")
    else:
        logits[1, 77] = bad
    assert cpu.row_argmax(logits) is None
    logits[1] = torch.arange(100.0)
    logits[0, :50] = float("-inf")  # -inf values beside a finite maximum are fine
    assert cpu.row_argmax(logits) == logits.max(dim=-1).indices.tolist()


def test_row_argmax_rejects_bad_logits():
    with pytest.raises(ValueError, match="logits must be 2-d"):
        cpu.row_argmax(torch.zeros(10))
    with pytest.raises(ValueError, match="float32"):
        cpu.row_argmax(torch.zeros(2, 10, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="at least one column"):
        cpu.row_argmax(torch.zeros(2, 0))

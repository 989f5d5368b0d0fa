"""Backend dispatch, and the launcher argument checks (shared by the torch and Triton launchers):
each bad argument raises ValueError naming it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import cpu as cpu_kernels
from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.block_copy import copy_blocks_ref, gather_blocks, gather_blocks_ref, scatter_blocks_ref
from kernels.ops import BACKEND_ENV, Ops, get_ops, select_backend
from kernels.paged_attention import paged_attention, paged_attention_ref
from kernels.rms_norm import rms_norm, rms_norm_ref
from kernels.rotary import rotary, rotary_ref
from kernels.store_kv import store_kv, store_kv_ref
from tests.kernels.helpers import DEVICE, make_attention_case, make_kv_cache, requires_triton


def test_select_backend_by_device_and_dtype(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert select_backend("cpu") == ("cpu" if cpu_kernels.available() else "torch")
    assert select_backend("cpu", torch.bfloat16) == "torch"  # the compiled CPU kernels are fp32
    assert select_backend(torch.device("cuda", 0)) == "triton"


def test_select_backend_env_override(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert select_backend("cpu") == "triton"
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert select_backend("cuda") == "torch"
    monkeypatch.setenv(BACKEND_ENV, "cpu")
    assert select_backend("cpu", torch.bfloat16) == "cpu"
    monkeypatch.setenv(BACKEND_ENV, "flash")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        select_backend("cpu")


def test_get_ops_tables():
    torch_ops, triton_ops = get_ops("torch"), get_ops("triton")
    assert torch_ops.paged_attention is paged_attention_ref and torch_ops.rms_norm is rms_norm_ref
    assert triton_ops.paged_attention is paged_attention and triton_ops.store_kv is store_kv
    assert {f.name for f in dataclasses.fields(Ops)} == {
        "rms_norm", "rotary", "silu_and_mul", "store_kv", "paged_attention", "pack_linear", "linear",
        "pack_quant", "quant_linear", "norm_quant_linear", "decoder_stack", "stack_max_tokens",
        "argmax_rows", "rotary_store_kv", "rotary_store_attention", "norm_linear", "silu_and_mul_linear"}
    from kernels.paged_attention import rotary_store_attention
    from kernels.rotary_store_kv import rotary_store_kv

    assert triton_ops.rotary_store_kv is rotary_store_kv and torch_ops.rotary_store_kv is None  # the model composes
    assert triton_ops.rotary_store_attention is rotary_store_attention
    assert torch_ops.rotary_store_attention is None
    assert torch_ops.decoder_stack is None and triton_ops.decoder_stack is None  # the compiled CPU path only
    assert torch_ops.argmax_rows is None and triton_ops.argmax_rows is None  # the runner takes torch's
    from kernels.quant import quant_linear_ref
    from kernels.quant_triton import quant_linear

    assert torch_ops.quant_linear is quant_linear_ref and triton_ops.quant_linear is quant_linear
    assert torch_ops.norm_quant_linear is None and triton_ops.norm_quant_linear is None  # not fused
    from kernels import gemv

    assert triton_ops.linear is gemv.linear and triton_ops.norm_linear is gemv.norm_linear
    assert triton_ops.silu_and_mul_linear is gemv.silu_and_mul_linear
    assert torch_ops.norm_linear is None and torch_ops.silu_and_mul_linear is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        torch_ops.rms_norm = None
    with pytest.raises(ValueError, match="backend"):
        get_ops("cuda")


def test_triton_launch_refused_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if DEVICE.type == "cuda":
        pytest.skip("CUDA is available: CPU tensors are the only refused case")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        silu_and_mul(torch.randn(2, 4))



def _attention_args():
    case = make_attention_case([20, 5], [3, 1], 4, 2, 16, 16)
    return dict(query=case.query, key_cache=case.key_cache, value_cache=case.value_cache,
                block_tables=case.block_tables, seq_lens=case.seq_lens, cu_seqlens_q=case.cu_seqlens_q,
                max_seqlen_q=case.max_seqlen_q, scale=case.scale)


BAD_ATTENTION = {
    "query 2-d": (lambda a: a.update(query=a["query"].flatten(1)), "query must be 3-d"),
    "query int": (lambda a: a.update(query=a["query"].long()), "query must have dtype"),
    "query strided head_dim": (lambda a: a.update(query=a["query"].transpose(0, 2).contiguous().transpose(0, 2)),
                               "query must have stride 1"),
    "heads not multiple": (lambda a: a.update(query=a["query"][:, :3]), "multiple of key_cache"),
    "head_dim mismatch": (lambda a: a.update(query=a["query"][..., :8]), "key_cache must have shape"),
    "value strides": (lambda a: a.update(value_cache=a["value_cache"].contiguous()),
                      "value_cache must have the strides"),
    "value dtype": (lambda a: a.update(value_cache=a["value_cache"].half()), "value_cache must have dtype"),
    "block_tables float": (lambda a: a.update(block_tables=a["block_tables"].float()), "block_tables must have dtype"),
    "seq_lens length": (lambda a: a.update(seq_lens=a["seq_lens"][:1]), "seq_lens must have shape"),
    "cu_seqlens_q length": (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"][1:]), "cu_seqlens_q must have shape"),
    "max_seqlen_q zero": (lambda a: a.update(max_seqlen_q=0), "max_seqlen_q must be an int"),
    "scale negative": (lambda a: a.update(scale=-1.0), "scale must be a positive"),
    "out dtype": (lambda a: a.update(out=torch.empty_like(a["query"], dtype=torch.float16)), "out must have dtype"),
    "out shape": (lambda a: a.update(out=torch.empty_like(a["query"][:1])), "out must have shape"),
}


@pytest.mark.parametrize("fn", [paged_attention_ref, pytest.param(paged_attention, marks=requires_triton)])
@pytest.mark.parametrize("bad", list(BAD_ATTENTION))
def test_paged_attention_rejects(fn, bad):
    args = _attention_args()
    mutate, message = BAD_ATTENTION[bad]
    mutate(args)
    with pytest.raises(ValueError, match=message):
        fn(**args)


def test_paged_attention_ref_rejects_bad_lengths():
    args = _attention_args()
    args["seq_lens"] = torch.tensor([2, 5], dtype=torch.int32, device=DEVICE)  # 3 queries, 2 keys
    with pytest.raises(ValueError, match="sequence 0: query length 3"):
        paged_attention_ref(**args)
    args = _attention_args()
    args["seq_lens"] = torch.tensor([20, 500], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="exceeds block_tables capacity"):
        paged_attention_ref(**args)



@pytest.mark.parametrize("impl", [rms_norm_ref, pytest.param(rms_norm, marks=requires_triton)])
def test_rms_norm_rejects(impl):
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight must have shape"):
        impl(x, torch.ones(7, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="residual must have dtype"):
        impl(x, torch.ones(8, device=DEVICE), 1e-5, residual=x.half())
    with pytest.raises(ValueError, match="x must have stride 1"):
        impl(x.t(), torch.ones(3, device=DEVICE), 1e-5)


@pytest.mark.parametrize("impl", [silu_and_mul_ref, pytest.param(silu_and_mul, marks=requires_triton)])
def test_silu_and_mul_rejects(impl):
    with pytest.raises(ValueError, match="x must have an even last dim"):
        impl(torch.randn(2, 5, device=DEVICE))
    with pytest.raises(ValueError, match="x must be 2-d"):
        impl(torch.randn(2, 2, 4, device=DEVICE))


@pytest.mark.parametrize("impl", [rotary_ref, pytest.param(rotary, marks=requires_triton)])
def test_rotary_rejects(impl):
    q, k = torch.randn(4, 2, 8, device=DEVICE), torch.randn(4, 1, 8, device=DEVICE)
    cache = torch.randn(16, 8, device=DEVICE)
    with pytest.raises(ValueError, match="positions must have shape"):
        impl(q, k, torch.arange(3, device=DEVICE), cache)
    with pytest.raises(ValueError, match="cos_sin_cache must have dtype"):
        impl(q, k, torch.arange(4, device=DEVICE), cache.half())
    with pytest.raises(ValueError, match="k must have dtype"):
        impl(q, k.half(), torch.arange(4, device=DEVICE), cache)


@pytest.mark.parametrize("impl", [store_kv_ref, pytest.param(store_kv, marks=requires_triton)])
def test_store_kv_rejects(impl):
    kv_cache = make_kv_cache(4, 16, 2, 8, torch.float32)
    kc, vc = kv_cache[:, 0, 0], kv_cache[:, 0, 1]
    key = torch.randn(3, 2, 8, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping must have shape"):
        impl(key, key, kc, vc, slots[:2])
    with pytest.raises(ValueError, match="slot_mapping must have dtype"):
        impl(key, key, kc, vc, slots.float())
    with pytest.raises(ValueError, match="key must have shape"):
        impl(key[:, :1], key, kc, vc, slots)
    with pytest.raises(ValueError, match="value_cache must have the strides"):
        impl(key, key, kc, vc.contiguous(), slots)


def test_block_copy_rejects():
    kv_cache = make_kv_cache(4, 16, 2, 8, torch.float32)
    ids = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="each block contiguously"):
        gather_blocks_ref(kv_cache.transpose(1, 2), ids)
    with pytest.raises(ValueError, match="packed must have shape"):
        scatter_blocks_ref(torch.zeros(3, kv_cache[0].numel(), device=DEVICE), kv_cache, ids)
    with pytest.raises(ValueError, match="dst_ids must have shape"):
        copy_blocks_ref(kv_cache, ids, ids[:1])
    with pytest.raises(ValueError, match="block_ids must have dtype"):
        gather_blocks_ref(kv_cache, ids.float())


@requires_triton
def test_block_copy_triton_rejects():
    kv_cache = make_kv_cache(4, 16, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="each block contiguously"):
        gather_blocks(kv_cache.transpose(1, 2), torch.tensor([0], device=DEVICE))

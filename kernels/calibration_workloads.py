"""What the calibration (``kernels.calibration``) times: for an op at a size, a call on inputs of
the model's own shapes (``workload``), and the best time of each candidate (``best_times``).

Kept apart from the table and its cache so that each reads on its own; this file's source is
part of the calibration cache key, as the kernel sources are, so a changed workload re-measures.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kernels.model_dims import ModelDims
    from kernels.op_table import Ops

BLOCK_SIZE = 16
DECODE_BATCH, DECODE_CONTEXT = 8, 512  # attention's q_len-1 class: this many sequences this long
MIN_SECONDS, MIN_CALLS, MAX_CALLS = 0.05, 3, 20
# Matmuls up to this many rows are bound by reading the weights, so they are timed over every
# layer's weights (distinct tensors, up to LINEAR_WORKING_SET bytes), as a decode step reads
# them: one layer's weights timed again and again sit in the cache, which favoured torch's GEMM
# at 9..16 rows by 10% here where over the whole model the compiled kernel is 1.6x faster.
# Bigger M is bound by arithmetic: one layer is enough.
WEIGHT_BOUND_ROWS, LINEAR_WORKING_SET = 16, 512 << 20


def best_times(fns: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Best time of each function, calls interleaved so drift hits every candidate alike."""
    for fn in fns.values():
        fn()  # warm: first-call allocations, lazy library loads
    best = dict.fromkeys(fns, float("inf"))
    spent, calls = 0.0, 0
    while calls < MIN_CALLS or (spent < MIN_SECONDS and calls < MAX_CALLS):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t0
            best[name] = min(best[name], elapsed)
            spent += elapsed
        calls += 1
    return best


def workload(op: str, size: int, dims: ModelDims, ops: Ops, impl: str) -> Callable[[], object]:
    """A call of ``op`` at ``size`` on inputs of the model's shapes."""
    if op == "quant_linear":
        return _quant_workload(size, dims, ops, impl)
    if op == "linear":
        layer_bytes = 4 * sum(k * n for k, n in dims.linear_shapes)
        copies = (max(1, min(dims.num_layers, LINEAR_WORKING_SET // layer_bytes))
                  if size <= WEIGHT_BOUND_ROWS else 1)
        layer = [torch.randn(k, n) * k ** -0.5 for k, n in dims.linear_shapes]
        weights = [w.clone() for _ in range(copies) for w in layer]
        xs = [torch.randn(size, w.shape[0]) for w in weights]
        if impl == "cpu":
            packed = [ops.pack_linear(w) for w in weights]
            return lambda: [ops.linear(x, w) for x, w in zip(xs, packed)]
        return lambda: [torch.mm(x, w) for x, w in zip(xs, weights)]
    heads, kv_heads, head_dim = dims.num_heads, dims.num_kv_heads, dims.head_dim
    if op == "paged_attention":
        return attention_workload(size, heads, kv_heads, head_dim, ops)
    if op == "rms_norm":
        x, residual = torch.randn(size, dims.hidden_size), torch.randn(size, dims.hidden_size)
        weight = torch.rand(dims.hidden_size)
        return lambda: ops.rms_norm(x, weight, 1e-5, residual)
    if op == "silu_and_mul":
        x = torch.randn(size, 2 * dims.intermediate_size)
        return lambda: ops.silu_and_mul(x)
    if op == "rotary":
        from kernels.rotary import build_cos_sin_cache

        cache = build_cos_sin_cache(head_dim, 4096, 10000.0)
        qkv = torch.randn(size, (heads + 2 * kv_heads) * head_dim)
        q = qkv[:, :heads * head_dim].view(size, heads, head_dim)
        k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(size, kv_heads, head_dim)
        positions = torch.arange(size)
        return lambda: ops.rotary(q, k, positions, cache)
    if op == "store_kv":
        key_cache, value_cache = kv_cache(-(-size // BLOCK_SIZE) + 1, kv_heads, head_dim)
        key, value = torch.randn(size, kv_heads, head_dim), torch.randn(size, kv_heads, head_dim)
        slots = torch.randperm(key_cache.shape[0] * BLOCK_SIZE)[:size]
        return lambda: ops.store_kv(key, value, key_cache, value_cache, slots)
    raise ValueError(f"no workload for op {op!r}")


def _quant_workload(size: int, dims: ModelDims, ops: Ops, impl: str) -> Callable[[], object]:
    """Q4_1 matmuls over as many layers as the fp32 ones (the same weight-bound rule)."""
    from kernels.quant import pack_quant_ref, random_rows

    layer_bytes = 4 * sum(k * n for k, n in dims.linear_shapes)
    copies = (max(1, min(dims.num_layers, LINEAR_WORKING_SET // layer_bytes))
              if size <= WEIGHT_BOUND_ROWS else 1)
    blocks = [random_rows(n, k, "q4_1", seed=i) for i in range(copies) for k, n in dims.linear_shapes]
    xs = [torch.randn(size, b.in_features) for b in blocks]
    if impl == "cpu":
        packed = [ops.pack_quant(b) for b in blocks]
        return lambda: [ops.quant_linear(x, w) for x, w in zip(xs, packed)]
    plain = [pack_quant_ref(b) for b in blocks]
    return lambda: [torch.mm(x, w) for x, w in zip(xs, plain)]


def kv_cache(num_blocks: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer K and V views of a two-layer block cache: the strides the model passes."""
    cache = torch.randn(num_blocks, 2, 2, BLOCK_SIZE, kv_heads, head_dim)
    return cache[:, 0, 0], cache[:, 0, 1]


def attention_workload(q_len: int, heads: int, kv_heads: int, head_dim: int,
                       ops: Ops) -> Callable[[], object]:
    """q_len 1: a decode batch; up to 8: a few sequences verifying drafts on a context; longer:
    one prompt chunk, fresh (the common case of a prefill)."""
    if q_len == 1:
        num_seqs, context = DECODE_BATCH, DECODE_CONTEXT
    elif q_len <= 8:
        num_seqs, context = 4, DECODE_CONTEXT
    else:
        num_seqs, context = 1, q_len
    blocks_per_seq = -(-context // BLOCK_SIZE)
    key_cache, value_cache = kv_cache(num_seqs * blocks_per_seq, kv_heads, head_dim)
    block_tables = torch.randperm(num_seqs * blocks_per_seq).to(torch.int32).view(num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
    cu_seqlens_q = torch.arange(0, (num_seqs + 1) * q_len, q_len, dtype=torch.int32)
    query = torch.randn(num_seqs * q_len, heads, head_dim)
    scale = head_dim ** -0.5
    return lambda: ops.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                       cu_seqlens_q, q_len, scale)

"""Paged attention on CPU: the compiled kernel ``csrc/attention.cpp``: fp32 queries over an fp32
or bfloat16 cache, or a quantized one (int8 / float8_e4m3fn rows with their scale,
``kernels.kv_quant``).

Same contract as ``kernels.paged_attention_ref.paged_attention_ref`` (read its module
docstring): K/V rows are read in place from the strided per-layer views of the block cache, one
work item per (sequence, KV head, up to 16 query rows), online softmax in fp32.

Sequences whose query is longer than ``LONG_QUERY_THRESHOLD`` tokens go to the torch
reference's per-sequence SDPA path instead: SDPA's blocked matmuls catch up with the kernel's
multi-query step once a fresh prompt is about a thousand tokens long.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from kernels.cpu import library
from kernels.paged_attention_ref import extend_attention

# One sequence, 9 query / 3 KV heads, head_dim 64 (python -m kernels.bench --cpu), AVX-512, SDPA
# time over kernel time with the multi-query step, one thread on a shared machine (load 5-7):
# fresh prompt 512: 1.4x; 1024: 1.0-1.2x; 2000: 0.8-1.5x; 112 tokens on a 1,900-token prefix:
# 0.9-1.1x on one thread, 1.2-3x on two. The kernel wins or ties up to ~1k query tokens and
# the measurements do not separate the two beyond, so only longer prompt chunks go to SDPA (the
# default step budget, SchedulerConfig.max_num_batched_tokens = 512, keeps every chunk here).
LONG_QUERY_THRESHOLD = 1024


@functools.cache
def _kernel() -> Callable[..., object]:
    kernel: Callable[..., object] = library("attention").paged_attention.default
    return kernel


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    max_seqlen_q: int, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring. Raises ValueError naming the argument for a bad shape, dtype
    (float32 queries; float32, bfloat16, int8 or float8_e4m3fn caches) or value (q_len >
    seq_len, seq_len beyond block_tables, bad block id)."""
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    # validates every argument and value, then computes the sequences with short queries
    _kernel()(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q,
              scale, out, LONG_QUERY_THRESHOLD)
    if max_seqlen_q > LONG_QUERY_THRESHOLD:
        cu = cu_seqlens_q.tolist()
        for i, seq_len in enumerate(seq_lens.tolist()):
            if cu[i + 1] - cu[i] > LONG_QUERY_THRESHOLD:
                extend_attention(query, key_cache, value_cache, block_tables[i], seq_len, cu[i], cu[i + 1],
                        scale, out)
    return out

"""Shared builders for the kernel tests: devices, tolerances, paged caches in the engine layout."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kernels._triton import can_launch_on

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

requires_triton = pytest.mark.skipif(
    not can_launch_on(DEVICE),
    reason="Triton kernels need CUDA, or TRITON_INTERPRET=1 in the environment for CPU "
           "(`make test` sets it)")

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def make_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, num_layers: int = 2, generator: torch.Generator | None = None
                  ) -> torch.Tensor:
    """The engine's 6-d cache [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]."""
    return torch.randn(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim,
                       generator=generator).to(dtype=dtype, device=DEVICE)


@dataclass
class AttentionCase:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # strided view kv_cache[:, layer, 0]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, shuffled ids, padded with junk
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    scale: float

    def args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                self.cu_seqlens_q, self.max_seqlen_q, self.scale)


def make_attention_case(seq_lens: list[int], query_lens: list[int], num_heads: int, num_kv_heads: int,
                        head_dim: int, block_size: int, dtype: torch.dtype = torch.float32,
                        seed: int = 0, layer: int = 1) -> AttentionCase:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq) + 1  # one spare column of junk for every sequence
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
    kv_cache = make_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, generator=gen)
    ids = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = ids[used:used + n]
        used += n
    block_tables[::2, -1] = 10**6  # junk past the end must never be dereferenced
    cu = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    query = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    return AttentionCase(query, kv_cache[:, layer, 0], kv_cache[:, layer, 1], block_tables.to(DEVICE),
                         torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), cu.to(DEVICE),
                         max(query_lens), head_dim ** -0.5)


def dense_attention(case: AttentionCase) -> torch.Tensor:
    """Dead-simple oracle: per sequence, gather K/V slot by slot into contiguous tensors and call
    SDPA in float64 with an explicit causal mask."""
    q_all, kc, vc = case.query.double(), case.key_cache.double(), case.value_cache.double()
    block_size, num_kv_heads = kc.shape[1], kc.shape[2]
    group = q_all.shape[1] // num_kv_heads
    cu = case.cu_seqlens_q.tolist()
    out = torch.empty_like(q_all)
    for i, seq_len in enumerate(case.seq_lens.tolist()):
        q = q_all[cu[i]:cu[i + 1]]
        q_len = q.shape[0]
        if q_len == 0:
            continue
        slots = [(int(case.block_tables[i, p // block_size]), p % block_size) for p in range(seq_len)]
        k = torch.stack([kc[b, o] for b, o in slots]).repeat_interleave(group, dim=1)
        v = torch.stack([vc[b, o] for b, o in slots]).repeat_interleave(group, dim=1)
        positions = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= positions[:, None]
        res = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             attn_mask=mask, scale=case.scale)
        out[cu[i]:cu[i + 1]] = res.transpose(0, 1)
    return out


def draw_attention_batch(data, *, long_query: int, head_groups: list[tuple[int, int]],
                         block_sizes: list[int]) -> dict:
    """A random batch for the hypothesis tests (``data`` is ``st.data()``): 1-5 sequences of 1-100
    tokens, each with a decode, 3-token, ``long_query``-token or whole-prompt query. Returns the
    shape arguments every attention case builder takes: seq_lens, query_lens, num_heads,
    num_kv_heads, block_size, seed."""
    from hypothesis import strategies as st

    num_seqs = data.draw(st.integers(1, 5))
    seq_lens = data.draw(st.lists(st.integers(1, 100), min_size=num_seqs, max_size=num_seqs))
    query_lens = [data.draw(st.sampled_from([1, 1, min(n, 3), min(n, long_query), n])) for n in seq_lens]
    num_kv_heads, group = data.draw(st.sampled_from(head_groups))
    return dict(seq_lens=seq_lens, query_lens=query_lens, num_heads=num_kv_heads * group,
                num_kv_heads=num_kv_heads, block_size=data.draw(st.sampled_from(block_sizes)),
                seed=data.draw(st.integers(0, 2**16)))

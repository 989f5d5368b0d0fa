"""The compiled CPU paged attention (``kernels.cpu.attention``) against torch SDPA on the same
data, at SmolLM2-135M's shapes (9 query / 3 KV heads, head_dim 64, block size 16), in one run.

    python -m kernels.bench --cpu [--isa native|avx2] [--threads 2] [--repeats 30]

Cases (one layer each): the prefix hit of ``loadtests/bench_prefix.py`` (112 new tokens on a
1,900-token cached prefix), fresh 512-, 1,024- and 2,000-token prompts (causal; 2,000 is that
bench's miss), and decode of batch 1 and 16 at 2,000 tokens of context. Prompt cases report
GFLOP/s: 4 * head_dim flops per (query head, visible key), QK^T and P x V; decode reports GB/s
of K/V read. The baseline is SDPA over K/V gathered into contiguous tensors outside the timing
(GQA expanded; an explicit causal mask where q_len < seq_len), as ``kernels.paged_attention_ref``
calls it. Each time is the best of ``--repeats`` calls after two warm-up calls. Prints the CPU,
the ISA, the thread count and the load average, since the machine may be shared.
"""

from __future__ import annotations

import argparse
import functools
import os

import torch
import torch.nn.functional as F

from kernels.timing import best_seconds

# paged attention's positional arguments: query, key_cache, value_cache, block_tables, seq_lens,
# cu_seqlens_q, max_seqlen_q, scale
AttentionArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float]

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
# name, number of sequences, context (seq_len), new tokens per sequence (q_len)
CASES = [("prefix hit: 112 on 1,900 cached", 1, 2012, 112), ("prompt 512, fresh", 1, 512, 512),
         ("prompt 1024, fresh", 1, 1024, 1024), ("prompt 2000, fresh (the miss)", 1, 2000, 2000),
         ("decode batch 1 x 2000", 1, 2000, 1),
         ("decode batch 16 x 2000", 16, 2000, 1)]


def _case(num_seqs: int, seq_len: int, q_len: int, seed: int = 0
          ) -> tuple[AttentionArgs, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """(kernel args over a paged layer view with shuffled block ids, SDPA's q, k, v, mask)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    # a 2-layer cache in the engine's layout: the layer views are strided like the model's
    cache = torch.randn(num_blocks, 2, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    key_cache, value_cache = cache[:, 0, 0], cache[:, 0, 1]
    block_tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    cu = torch.arange(0, (num_seqs + 1) * q_len, q_len, dtype=torch.int32)
    query = torch.randn(num_seqs * q_len, HEADS, HEAD_DIM, generator=gen)
    args = (query, key_cache, value_cache, block_tables, seq_lens, cu, q_len, HEAD_DIM ** -0.5)

    def dense(layer: torch.Tensor) -> torch.Tensor:  # -> [num_seqs, HEADS, seq_len, HEAD_DIM]
        rows = layer[block_tables.long()].flatten(1, 2)[:, :seq_len]
        return rows.repeat_interleave(HEADS // KV_HEADS, dim=2).transpose(1, 2).contiguous()

    q = query.view(num_seqs, q_len, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    mask = None
    if 1 < q_len < seq_len:
        positions = torch.arange(seq_len - q_len, seq_len)
        mask = torch.arange(seq_len)[None, :] <= positions[:, None]
    return args, (q, dense(key_cache), dense(value_cache), mask)


def _work(num_seqs: int, seq_len: int, q_len: int) -> tuple[float, str]:
    """(GFLOP or GB of one call, unit): flops of the visible (query, key) pairs for prompts,
    K/V bytes for decode."""
    if q_len == 1:
        return num_seqs * seq_len * KV_HEADS * HEAD_DIM * 4 * 2 / 1e9, "GB/s"
    visible = sum(seq_len - q_len + i + 1 for i in range(q_len))
    return num_seqs * visible * HEADS * 4 * HEAD_DIM / 1e9, "GFLOP/s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", choices=("native", "avx2", "avx512"), default=None)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    if args.isa:
        os.environ["PDSERVE_CPU_ISA"] = args.isa
    from kernels.cpu import cpu_identity, default_isa, library

    torch.set_num_threads(args.threads)
    kernel = library("attention").paged_attention.default
    print(f"cpu: {cpu_identity()}\nisa {default_isa()}, {args.threads} threads, "
          f"load average {os.getloadavg()[0]:.2f} at start")
    print(f"{'case':<34}{'kernel ms':>10}{'SDPA ms':>9}{'SDPA/kernel':>12}{'kernel':>9}{'SDPA':>8}  unit")
    for name, num_seqs, seq_len, q_len in CASES:
        kernel_args, (q, k, v, mask) = _case(num_seqs, seq_len, q_len)
        out = torch.empty_like(kernel_args[0])
        ours = best_seconds(functools.partial(kernel, *kernel_args, out, -1), args.repeats, warmup=2)
        base = best_seconds(functools.partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask,
                                               is_causal=mask is None and q_len > 1, scale=HEAD_DIM ** -0.5),
                             args.repeats, warmup=2)
        amount, unit = _work(num_seqs, seq_len, q_len)
        print(f"{name:<34}{ours * 1e3:>10.3f}{base * 1e3:>9.3f}{base / ours:>11.2f}x"
              f"{amount / ours:>9.1f}{amount / base:>8.1f}  {unit}")
    print(f"load average {os.getloadavg()[0]:.2f} at end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

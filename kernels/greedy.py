"""Each row's greedy token in one launch: the first index of the row's maximum, -1 where the
row has no finite maximum (a NaN anywhere, +inf, or every entry -inf).

The torch spelling (``engine.sampling.sampler.greedy_tokens``: ``max(dim=-1)``, ``isfinite``,
``where``) is three launches, and its reduction of one 49,152-wide row took 12.4 us of an H100
decode step at batch 1 (docs/gpu/h100-2026-11-26/run4/profile.txt). Here one program per row
walks it in ``BLOCK`` wide tiles, keeping the running maximum and its first index.
"""

from __future__ import annotations

import torch

from kernels._checks import FLOAT_DTYPES, check_tensor
from kernels._triton import check_launchable, tl, triton

BLOCK = 2048


def greedy_rows_ref(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] int64: the reference (torch's ops)."""
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES)
    values, indices = logits.max(dim=-1)
    return torch.where(torch.isfinite(values), indices, -1)


@triton.jit
def _greedy_kernel(  # type: ignore[no-untyped-def]  # JIT kernel (kernels/_triton.py)
    logits_ptr, out_ptr, vocab, stride_row, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    best_at = tl.full((BLOCK,), 0, dtype=tl.int32)
    bad = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab,
                    other=float("-inf")).to(tl.float32)
        bad = bad | (x != x).to(tl.int32) | (x == float("inf")).to(tl.int32)
        better = x > best  # strictly: a lane keeps its first maximum
        best = tl.where(better, x, best)
        best_at = tl.where(better, cols, best_at)
    top = tl.max(best, axis=0)
    # the first index among the lanes holding the maximum (each lane's own is its first)
    first = tl.min(tl.where(best == top, best_at, vocab), axis=0)
    ok = (tl.max(bad, axis=0) == 0) & (top > float("-inf"))
    tl.store(out_ptr + row, tl.where(ok, first, -1).to(tl.int64))


def greedy_rows(logits: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`greedy_rows_ref` (same result)."""
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_launchable(logits.device)
    num_rows, vocab = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows and vocab:
        _greedy_kernel[(num_rows,)](logits, out, vocab, logits.stride(0), BLOCK=BLOCK, num_warps=8)
    elif num_rows:
        out.fill_(-1)
    return out

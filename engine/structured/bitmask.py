"""The grammar mask of a batch: filled on the CPU from the matchers, applied on the device.

Layout (xgrammar's and llguidance's): row r of ``bitmask`` [R, ceil(V / 32)] int32 admits token t
iff bit t % 32 of word t // 32 is set. Only constrained rows have a bitmask row; ``rows`` maps
them to logits rows::

    logits rows    0 (free)   1 (json)   2 (free)   3 4 5 (regex, 2 drafts + bonus)
    mask.rows                 1                     3 4 5
    mask.bitmask              [w...]                [w...] [w...] [w...]

``build_grammar_mask`` is the CPU side (one pinned buffer, one non-blocking copy on CUDA).
``apply_token_bitmask`` applies it where the logits are: on CUDA the pure-torch
``apply_token_bitmask_ref`` (unpack and masked_fill, no host sync); on CPU xgrammar's C++ kernel
row by row, measured 45x faster here (16 rows of 49,152: 66 us against 3.0 ms for the reference).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.structured.protocol import MatcherProtocol

NEG_INF = float("-inf")


@dataclass(slots=True)
class GrammarMask:
    rows: torch.Tensor  # [R] int64, the constrained logits rows, on the logits' device
    bitmask: torch.Tensor  # [R, ceil(V / 32)] int32, on the logits' device
    row_ids: list[int]  # ``rows`` on the host (the CPU kernel walks them)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def build_grammar_mask(entries: Sequence[tuple[MatcherProtocol, Sequence[int]]], vocab_size: int,
                       device: torch.device | str = "cpu") -> GrammarMask | None:
    """One entry per request, in logits-row order: its matcher (already synced) and its draft
    tokens; it owns len(drafts) + 1 consecutive rows. None when no matcher constrains."""
    rows: list[int] = []
    constrained: list[tuple[MatcherProtocol, Sequence[int], int]] = []
    first_row = 0
    for matcher, drafts in entries:
        if matcher.is_constrained:
            constrained.append((matcher, drafts, len(rows)))
            rows.extend(range(first_row, first_row + len(drafts) + 1))
        first_row += len(drafts) + 1
    if not rows:
        return None
    pin = torch.device(device).type == "cuda"
    bitmask = torch.empty(len(rows), bitmask_width(vocab_size), dtype=torch.int32, pin_memory=pin)
    for matcher, drafts, first in constrained:
        matcher.fill(bitmask, first, drafts)
    return GrammarMask(torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True),
                       bitmask.to(device, non_blocking=True), rows)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab_size] bool, True = admitted."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # made there: no copy
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab_size]


def apply_token_bitmask(logits: torch.Tensor, mask: GrammarMask) -> None:
    """logits [B, V] fp32, in place: tokens a constrained row does not admit become -inf."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.stride(1) != 1:
        apply_token_bitmask_ref(logits, mask)
        return
    # imported here, not at module load: every engine imports this module, and xgrammar's import
    # costs ~0.7 s per process, which only processes serving a constrained request should pay
    from xgrammar.kernels.apply_token_bitmask_inplace_cpu import apply_token_bitmask_inplace_cpu

    vocab_size = logits.shape[1]
    for i, row in enumerate(mask.row_ids):
        apply_token_bitmask_inplace_cpu(logits[row], mask.bitmask[i], vocab_size=vocab_size)


def apply_token_bitmask_ref(logits: torch.Tensor, mask: GrammarMask) -> None:
    """``apply_token_bitmask`` in torch ops, on any device."""
    allowed = unpack_bitmask(mask.bitmask, logits.shape[1])
    logits[mask.rows] = logits[mask.rows].masked_fill(~allowed, NEG_INF)

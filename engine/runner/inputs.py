"""Pure input builders: the scheduled sequences of one step -> the model's flat tensors.

Index regions of one step with three sequences (a decode, a prefill chunk, a verify)::

    input_ids     | d0 | p0 p1 p2 p3 | v0 v1 v2 |
    cu_seqlens_q  0    1             5          8
    logits rows        ^(1)          ^(0: partial chunk)  ^^^(3: k drafts + bonus)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.mathutils import cdiv
from engine.models.llama import AttentionMetadata


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step.

    token_ids: the tokens computed this step (their KV is written), starting at position
    ``start_pos`` (= the sequence's num_computed_tokens). block_ids: the sequence's block table.
    num_logits: how many trailing positions need next-token logits (0 for a prefill chunk that
    does not reach the end of the prompt, 1 for decode, k + 1 for speculative verification).
    """

    token_ids: list[int]
    start_pos: int
    block_ids: Sequence[int]
    num_logits: int = 1


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [num_logit_rows] int64, rows of the flat batch

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def build_model_input(seqs: list[ScheduledSeq], block_size: int,
                      device: torch.device | str = "cpu") -> ModelInput:
    """Flatten ``seqs`` into model inputs. Raises ValueError if a block table is too short."""
    if not seqs:
        raise ValueError("build_model_input needs at least one scheduled sequence")
    if all(len(s.token_ids) == 1 and s.num_logits == 1 for s in seqs):
        return _decode_input(seqs, block_size, device)
    return _general_input(seqs, block_size, device)


def _general_input(seqs: list[ScheduledSeq], block_size: int, device: torch.device | str) -> ModelInput:
    """``build_model_input`` for any batch (prompt chunks, verification rows, decodes)."""
    q_lens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=len(seqs))
    cu_seqlens_q = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu_seqlens_q[1:])
    starts = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=len(seqs))
    seq_lens = starts + q_lens
    max_blocks = max(len(s.block_ids) for s in seqs)
    block_tables = np.zeros((len(seqs), max_blocks), dtype=np.int32)
    for i, s in enumerate(seqs):
        needed = cdiv(int(seq_lens[i]), block_size)
        if len(s.block_ids) < needed:
            raise ValueError(f"sequence {i} needs {needed} blocks for {seq_lens[i]} tokens, "
                             f"its block table has {len(s.block_ids)}")
        block_tables[i, :len(s.block_ids)] = s.block_ids

    input_ids = np.fromiter((t for s in seqs for t in s.token_ids), dtype=np.int64,
                            count=int(cu_seqlens_q[-1]))
    seq_index = np.repeat(np.arange(len(seqs)), q_lens)
    positions = np.arange(int(cu_seqlens_q[-1]), dtype=np.int64) - cu_seqlens_q[seq_index] + starts[seq_index]
    block_ids = block_tables[seq_index, positions // block_size].astype(np.int64)
    slot_mapping = block_ids * block_size + positions % block_size

    logits_indices = np.concatenate([
        np.arange(cu_seqlens_q[i + 1] - s.num_logits, cu_seqlens_q[i + 1], dtype=np.int64)
        for i, s in enumerate(seqs)
    ])
    def to(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device)

    attn = AttentionMetadata(
        slot_mapping=to(slot_mapping),
        block_tables=to(block_tables),
        seq_lens=to(seq_lens.astype(np.int32)),
        cu_seqlens_q=to(cu_seqlens_q.astype(np.int32)),
        max_seqlen_q=int(q_lens.max()),
    )
    return ModelInput(to(input_ids), to(positions), attn, to(logits_indices))


def _decode_input(seqs: list[ScheduledSeq], block_size: int, device: torch.device | str) -> ModelInput:
    """``build_model_input`` for a batch of decodes (one token and one logits row per sequence):
    the same tensors from Python lists, without the general path's numpy passes (a batch-1
    decode step built its inputs in ~90 us of a ~3 ms step)."""
    positions = [s.start_pos for s in seqs]
    for i, (s, pos) in enumerate(zip(seqs, positions)):
        if len(s.block_ids) * block_size <= pos:
            needed = cdiv(pos + 1, block_size)
            raise ValueError(f"sequence {i} needs {needed} blocks for {pos + 1} tokens, "
                             f"its block table has {len(s.block_ids)}")
    width = max(len(s.block_ids) for s in seqs)
    n = len(seqs)
    attn = AttentionMetadata(
        slot_mapping=torch.tensor([s.block_ids[pos // block_size] * block_size + pos % block_size
                                   for s, pos in zip(seqs, positions)], dtype=torch.int64, device=device),
        block_tables=torch.tensor([[*s.block_ids, *[0] * (width - len(s.block_ids))] for s in seqs],
                                  dtype=torch.int32, device=device),
        seq_lens=torch.tensor([pos + 1 for pos in positions], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32, device=device),
        max_seqlen_q=1,
    )
    return ModelInput(torch.tensor([s.token_ids[0] for s in seqs], dtype=torch.int64, device=device),
                      torch.tensor(positions, dtype=torch.int64, device=device), attn,
                      torch.arange(n, dtype=torch.int64, device=device))

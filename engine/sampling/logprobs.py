"""Logprobs of sampled and prompt tokens: tensors on the device, small objects for the wire.

A position's logprobs are the chosen token's logprob and rank plus the top-N alternatives.
Rank is 1 + the number of tokens strictly more likely than the chosen one. Top entries can be
-inf when fewer than N tokens are possible (top-k, masks); the HTTP layer must map -inf to a
JSON number (vLLM sends -9999.0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class PositionLogprobs:
    """One position: the chosen token, its logprob and rank, and the top-N (id, logprob),
    most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(slots=True)
class LogprobsTensors:
    """Logprobs for B positions, still on the device."""

    token_ids: torch.Tensor  # [B] int64: the chosen tokens
    token_logprobs: torch.Tensor  # [B] fp32
    ranks: torch.Tensor  # [B] int64
    top_token_ids: torch.Tensor  # [B, N] int64
    top_logprobs: torch.Tensor  # [B, N] fp32

    def tolists(self, num_top: Sequence[int | None]) -> list[PositionLogprobs | None]:
        """One entry per row: None where ``num_top[row]`` is None, else that row's top-N."""
        token_ids, logprobs = self.token_ids.tolist(), self.token_logprobs.tolist()
        ranks = self.ranks.tolist()
        top_ids, top_logprobs = self.top_token_ids.tolist(), self.top_logprobs.tolist()
        result: list[PositionLogprobs | None] = []
        for row, n in enumerate(num_top):
            if n is None:
                result.append(None)
                continue
            top = list(zip(top_ids[row][:n], top_logprobs[row][:n]))
            result.append(PositionLogprobs(token_ids[row], logprobs[row], ranks[row], top))
        return result


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                    num_top: int) -> LogprobsTensors:
    """logprobs: [B, V] (a log_softmax); token_ids: [B] int64; num_top: N >= 0."""
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [B]
    ranks = (logprobs > token_logprobs.unsqueeze(1)).sum(dim=-1) + 1
    top = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
    return LogprobsTensors(token_ids, token_logprobs, ranks, top.indices, top.values)


def compute_prompt_logprobs(logits: torch.Tensor, next_token_ids: torch.Tensor, num_top: int,
                            *, include_first: bool = True) -> list[PositionLogprobs | None]:
    """Prompt logprobs from the model's raw logits (no sampling processors, as in vLLM).

    logits: [T, V], row t predicts prompt token t+1; next_token_ids: [T] = prompt[1:T+1].
    Returns T entries, preceded by None for prompt position 0 (which nothing predicts) when
    ``include_first`` — pass False for every prefill chunk after the first.
    """
    logprobs = logits.to(torch.float32).log_softmax(dim=-1)
    entries = gather_logprobs(logprobs, next_token_ids.to(torch.int64), num_top)
    positions = entries.tolists([num_top] * logits.shape[0])
    return [None, *positions] if include_first else positions

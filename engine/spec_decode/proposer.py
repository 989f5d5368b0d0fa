"""The proposer interface: whatever drafts tokens for speculative decoding implements it."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ProposalInput:
    """One request to draft for. ``token_ids`` is prompt + output so far (a list or a 1-D numpy array)."""

    request_id: str
    token_ids: Sequence[int]


@dataclass(frozen=True, slots=True)
class Proposal:
    """Drafts for one request.

    ``draft_probs`` is [len(draft_token_ids), V] fp32: row j is the distribution q_j that
    draft j was sampled from, after the same logits processing (temperature, top-k/p) as the
    target. None means the proposer has no distribution (n-gram lookup); the rejection
    sampler then treats q_j as the point mass on draft j.
    """

    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.draft_probs is not None and (
                self.draft_probs.dim() != 2 or self.draft_probs.shape[0] != len(self.draft_token_ids)):
            raise ValueError(
                f"draft_probs must be [{len(self.draft_token_ids)}, V], got {tuple(self.draft_probs.shape)}")


class Proposer(abc.ABC):
    """Drafts up to k tokens per request.

    Contract:
    - ``propose(requests, k)`` returns one Proposal per request, in order; ``k[i] >= 0`` is
      request i's cap. A proposal may hold fewer than k[i] tokens, including zero (nothing
      worth proposing); the engine then verifies only what it got. k[i] == 0 must give zero.
    - Drafts are only suggestions: correctness never depends on them, because the rejection
      sampler keeps the output distribution equal to the target's. A proposer that returns
      ``draft_probs`` must return the true q its drafts were sampled from, or exactness is lost.
    - ``remove(request_id)`` is called once when a request finishes or is aborted, so a
      proposer with per-request state (a draft model's KV cache) can free it.
    """

    @abc.abstractmethod
    def propose(self, requests: list[ProposalInput], k: list[int]) -> list[Proposal]:
        """One Proposal per request, each with at most k[i] drafts."""

    def remove(self, request_id: str) -> None:
        """Forget ``request_id``; stateless proposers keep nothing."""


def pack_proposals(
    proposals: Sequence[Proposal], vocab_size: int, device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    """Flatten proposals into the rejection sampler's inputs.

    Returns (draft_token_ids [num_draft_total] int64, num_draft_tokens [num_reqs],
    draft_probs [num_draft_total, V] fp32 or None). draft_probs is None only when no proposal
    carries probabilities; in a mixed batch the point-mass proposals get one-hot rows.
    """
    num_draft_tokens = [len(p.draft_token_ids) for p in proposals]
    flat = [t for p in proposals for t in p.draft_token_ids]
    draft_token_ids = torch.tensor(flat, dtype=torch.int64, device=device)
    if all(p.draft_probs is None for p in proposals):
        return draft_token_ids, num_draft_tokens, None
    rows = []
    for p in proposals:
        if p.draft_probs is not None:
            if p.draft_probs.shape[1] != vocab_size:
                raise ValueError(f"draft_probs has V={p.draft_probs.shape[1]}, expected {vocab_size}")
            rows.append(p.draft_probs.to(device=device, dtype=torch.float32))
        else:
            one_hot = torch.zeros(len(p.draft_token_ids), vocab_size, dtype=torch.float32, device=device)
            one_hot[torch.arange(len(p.draft_token_ids)), p.draft_token_ids] = 1.0
            rows.append(one_hot)
    return draft_token_ids, num_draft_tokens, torch.cat(rows)

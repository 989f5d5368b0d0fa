"""Exact speculative sampling: verify a batch of draft tokens against the target model.

Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", arXiv:2211.17192; Chen et al. 2023, "Accelerating Large Language
Model Decoding with Speculative Sampling", arXiv:2302.01318): a cheap proposer drafts k
tokens x_1..x_k from its distributions q_1..q_k, one target pass scores all of them and
gives the target distributions p_1..p_{k+1}, and for each draft position j in order:

    accept x_j with probability min(1, p_j(x_j) / q_j(x_j))

Vocabulary of this module (STYLE.md):

- *accepted* tokens: the leading drafts that passed the test, in order.
- *recovered* token: at the first rejected position j, one token sampled from the residual
  norm(max(0, p_j - q_j)) in place of the rejected draft; nothing after j is kept.
- *bonus* token: when all k drafts are accepted, one extra token sampled from p_{k+1}.

Every call therefore emits num_accepted + 1 tokens per request, and the emitted stream has
exactly the distribution of sampling token by token from p (the tests check it by
simulation). Per position, with alpha = sum_y min(p(y), q(y)) and sum_y max(0, p(y) - q(y))
= 1 - alpha:

    P(emit x) = q(x) min(1, p(x)/q(x)) + (1 - alpha) max(0, p(x) - q(x)) / (1 - alpha)
              = min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x).

Greedy requests accept while the draft equals argmax(p_j) and emit argmax of the first
mismatching (or the bonus) row, which is exactly greedy decoding.

Randomness: a request with its own ``torch.Generator`` draws, per call and in this order,
k uniforms (one per draft, for the acceptance test) and then V exponentials (the
recovered / bonus draw, an exponential race: argmax(w / E) with E ~ Exp(1) picks index i with
probability w_i / sum(w), so w need not be normalised). It draws these whatever the
outcome, and a greedy request draws nothing, so a seeded request gives the same tokens
whatever else is in the batch. Requests without a generator share ``default_generator``
(torch's global one when None), drawn in one batched call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

PLACEHOLDER = -1  # pads output_token_ids after each request's last emitted token


class RejectionSampleOutput(NamedTuple):
    """What one verification step emits; unpacks as ``(output_token_ids, num_accepted)``."""

    output_token_ids: torch.Tensor  # [num_reqs, max_k + 1] int64: accepted drafts, then one
    #                                   recovered or bonus token, then PLACEHOLDER
    num_accepted: torch.Tensor  # [num_reqs] int64: accepted drafts; emitted = num_accepted + 1


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [num_draft_total] int64, request i owns a contiguous run
    num_draft_tokens: Sequence[int],  # [num_reqs] k_i >= 0, sum == num_draft_total
    draft_probs: torch.Tensor | None,  # [num_draft_total, V] fp32 q; None: point mass on drafts
    target_probs: torch.Tensor,  # [num_draft_total + num_reqs, V] fp32 processed p, k_i+1 rows each
    generators: Sequence[torch.Generator | None],  # [num_reqs] request-local RNG, None: shared
    is_greedy: torch.Tensor | Sequence[bool],  # [num_reqs] bool
    *,
    default_generator: torch.Generator | None = None,  # the shared RNG; None: torch's global one
) -> RejectionSampleOutput:
    """Verify every request's drafts; see the module docstring for the rule and the RNG contract.

    Row layout of ``target_probs`` for request i (k_i drafts, d_i = sum of k over requests < i)::

        row d_i + i + j   p at draft position j, j < k_i (scores draft_token_ids[d_i + j])
        row d_i + i + k_i p at the bonus position

    so draft t of request i is scored by row t + i. ``draft_probs`` row t is the q that draft
    t was sampled from; where it is None the proposer had no distribution (n-gram lookup) and
    q is the point mass q(x_t) = 1. A draft with q(x) = 0 (only possible with an inconsistent
    proposer) is accepted whenever p(x) > 0. Should the residual max(0, p - q) vanish
    numerically at a rejection, the recovered token is sampled from p instead.
    All arithmetic is fp32 on ``target_probs.device``; generators must live on that device.
    """
    num_reqs = len(num_draft_tokens)
    _check_inputs(draft_token_ids, num_draft_tokens, draft_probs, target_probs, generators, is_greedy)
    device = target_probs.device
    vocab_size = target_probs.shape[1]
    num_draft_total = draft_token_ids.numel()
    max_k = max(num_draft_tokens, default=0)
    greedy_list = is_greedy.tolist() if isinstance(is_greedy, torch.Tensor) else list(is_greedy)
    greedy = torch.tensor(greedy_list, dtype=torch.bool, device=device)  # [R]
    draft_token_ids = draft_token_ids.to(device)
    if draft_probs is not None:
        draft_probs = draft_probs.to(device)

    num_draft = torch.tensor(list(num_draft_tokens), dtype=torch.int64, device=device)  # [R]
    req_ids = torch.arange(num_reqs, device=device)  # [R]
    token_req = torch.repeat_interleave(req_ids, num_draft)  # [T] request owning draft t
    first_draft = torch.cumsum(num_draft, 0) - num_draft  # [R] d_i
    token_idx = torch.arange(num_draft_total, device=device)  # [T]
    token_pos = token_idx - first_draft[token_req]  # [T] j of draft t within its request
    token_row = token_idx + token_req  # [T] target row scoring draft t

    uniforms, exponentials = _draw(
        num_draft_tokens, vocab_size, generators, greedy_list, default_generator, device)

    # Acceptance test per draft: u < p/q  <=>  u * q < p  (q = 0 accepts iff p > 0).
    p_draft = target_probs[token_row, draft_token_ids]  # [T]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs[token_idx, draft_token_ids]
    is_accepted = uniforms * q_draft < p_draft  # [T]
    has_greedy = any(greedy_list)
    if has_greedy:
        target_argmax = target_probs.argmax(dim=-1)  # [T + R]
        is_accepted = torch.where(
            greedy[token_req], draft_token_ids == target_argmax[token_row], is_accepted)

    # Only the leading run of accepted drafts counts: cumprod over a padded [R, max_k] grid.
    accepted_grid = torch.zeros(num_reqs, max_k, dtype=torch.int64, device=device)
    accepted_grid[token_req, token_pos] = is_accepted.to(torch.int64)
    num_accepted = accepted_grid.cumprod(dim=1).sum(dim=1)  # [R]

    # The one token after the accepted run: bonus (all accepted) or recovered (first rejection).
    final_row = first_draft + req_ids + num_accepted  # [R]
    p_final = target_probs[final_row]  # [R, V]
    is_bonus = num_accepted == num_draft  # [R]
    weights = p_final
    if num_draft_total > 0:
        rejected = (first_draft + num_accepted).clamp(max=num_draft_total - 1)  # [R], valid if not bonus
        if draft_probs is None:
            q_final = torch.zeros_like(p_final)
            q_final.scatter_(1, draft_token_ids[rejected].unsqueeze(1), 1.0)
        else:
            q_final = draft_probs[rejected]
        residual = (p_final - q_final).clamp_min_(0.0)
        use_residual = ~is_bonus & (residual.sum(dim=-1) > 0)
        weights = torch.where(use_residual.unsqueeze(1), residual, p_final)
    final_token = (weights / exponentials).argmax(dim=-1)  # [R] exponential race, ∝ weights
    if has_greedy:
        final_token = torch.where(greedy, target_argmax[final_row], final_token)

    output_token_ids = torch.full(
        (num_reqs, max_k + 1), PLACEHOLDER, dtype=torch.int64, device=device)
    is_kept = token_pos < num_accepted[token_req]  # [T]
    output_token_ids[token_req, token_pos] = torch.where(is_kept, draft_token_ids, PLACEHOLDER)
    output_token_ids[req_ids, num_accepted] = final_token
    return RejectionSampleOutput(output_token_ids, num_accepted)


def _draw(
    num_draft_tokens: Sequence[int],
    vocab_size: int,
    generators: Sequence[torch.Generator | None],
    greedy: list[bool],
    default_generator: torch.Generator | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """uniforms [num_draft_total] in [0, 1) and exponentials [num_reqs, V] > 0, in the documented order."""
    num_reqs = len(num_draft_tokens)
    num_draft_total = sum(num_draft_tokens)
    is_shared = [gen is None and not is_g for gen, is_g in zip(generators, greedy)]
    uniforms = torch.zeros(num_draft_total, dtype=torch.float32, device=device)
    exponentials = torch.ones(num_reqs, vocab_size, dtype=torch.float32, device=device)
    if all(is_shared):  # common case: one batched draw
        uniforms.uniform_(generator=default_generator)
        exponentials.exponential_(generator=default_generator)
    elif any(is_shared):
        shared_reqs = torch.tensor(is_shared, dtype=torch.bool, device=device)
        shared_tokens = torch.repeat_interleave(
            shared_reqs, torch.tensor(list(num_draft_tokens), dtype=torch.int64, device=device))
        num_shared_tokens = sum(k for k, s in zip(num_draft_tokens, is_shared) if s)
        uniforms[shared_tokens] = torch.rand(
            num_shared_tokens, generator=default_generator, device=device)
        exponentials[shared_reqs] = torch.empty(
            sum(is_shared), vocab_size, device=device).exponential_(generator=default_generator)
    start = 0
    for i, (k, gen) in enumerate(zip(num_draft_tokens, generators)):
        if gen is not None and not greedy[i]:
            uniforms[start:start + k] = torch.rand(k, generator=gen, device=device)
            exponentials[i].exponential_(generator=gen)
        start += k
    # Exp(1) can round to 0 in fp32; keep the race's division finite.
    return uniforms, exponentials.clamp_min_(torch.finfo(torch.float32).tiny)


def _check_inputs(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    is_greedy: torch.Tensor | Sequence[bool],
) -> None:
    num_reqs = len(num_draft_tokens)
    num_draft_total = sum(num_draft_tokens)
    if any(k < 0 for k in num_draft_tokens):
        raise ValueError(f"num_draft_tokens must be >= 0, got {list(num_draft_tokens)}")
    if draft_token_ids.dim() != 1 or draft_token_ids.numel() != num_draft_total:
        raise ValueError(
            f"draft_token_ids must be 1-D with sum(num_draft_tokens) = {num_draft_total} entries, "
            f"got shape {tuple(draft_token_ids.shape)}")
    if draft_token_ids.dtype != torch.int64:
        raise ValueError(f"draft_token_ids must be int64, got {draft_token_ids.dtype}")
    if target_probs.dim() != 2 or target_probs.shape[0] != num_draft_total + num_reqs:
        raise ValueError(
            f"target_probs must be [num_draft_total + num_reqs, V] = [{num_draft_total + num_reqs}, V] "
            f"(k_i + 1 rows per request), got {tuple(target_probs.shape)}")
    if target_probs.dtype != torch.float32:
        raise ValueError(f"target_probs must be float32, got {target_probs.dtype}")
    if draft_probs is not None:
        if tuple(draft_probs.shape) != (num_draft_total, target_probs.shape[1]):
            raise ValueError(
                f"draft_probs must be [num_draft_total, V] = [{num_draft_total}, {target_probs.shape[1]}], "
                f"got {tuple(draft_probs.shape)}")
        if draft_probs.dtype != torch.float32:
            raise ValueError(f"draft_probs must be float32, got {draft_probs.dtype}")
    if len(generators) != num_reqs or len(is_greedy) != num_reqs:
        raise ValueError(
            f"generators ({len(generators)}) and is_greedy ({len(is_greedy)}) need one entry per "
            f"request ({num_reqs})")

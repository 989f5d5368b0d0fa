"""Logits processors: pure functions on fp32 logits [B, V], applied in place, in this order:

    1. penalties    repetition (prompt + output tokens: positive logits divided by the penalty,
                    negative ones multiplied, as in HF/vLLM), then frequency (minus penalty x
                    count) and presence (minus penalty if present) over output tokens (OpenAI)
    2. masks        logit_bias added; everything outside allowed_token_ids, bad words' final
                    tokens, (before min_tokens) the stop tokens and, on structured-output
                    rows, every token the grammar does not admit now set to -inf
       -- support check: a row with nothing left to sample raises ValueError --
    3. temperature  divide by T (greedy rows carry T = 1)
    4. truncation   top-k, then top-p on the renormalised top-k distribution, then min-p

Greedy rows skip 3-4 (their metadata has them off): argmax is unchanged by them, and their
'processed' logprobs are the temperature-1 distribution after penalties and masks.
"""

from __future__ import annotations

import torch

from engine.sampling.metadata import SamplingMetadata
from engine.structured.bitmask import apply_token_bitmask

NEG_INF = float("-inf")


def process_logits(logits: torch.Tensor, metadata: SamplingMetadata, check: bool = True) -> torch.Tensor:
    """Apply every processor to ``logits`` [B, V] fp32 in place; returns it. ``check=False``
    skips the support check (it reads the logits on the host): the caller checks the rows."""
    m = metadata
    if m.penalties is not None:
        pen = m.penalties
        apply_penalties(logits, pen.prompt_mask, pen.output_counts, pen.repetition, pen.presence,
                        pen.frequency)
    apply_masks(logits, m)
    if check:
        check_support(logits, m)
    if not m.all_greedy:
        apply_temperature(logits, m.temperature)
    if m.top_k is not None:
        apply_top_k(logits, m.top_k, m.max_top_k)
    if m.top_p is not None:
        apply_top_p(logits, m.top_p)
    if m.min_p is not None:
        apply_min_p(logits, m.min_p)
    return logits


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor) -> None:
    """logits, output_counts: [B, V] fp32; prompt_mask: [B, V] bool; penalties: [B] fp32."""
    seen = prompt_mask | (output_counts > 0)
    rep = repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalized, logits))
    logits.sub_(frequency.unsqueeze(1) * output_counts)
    logits.sub_(presence.unsqueeze(1) * (output_counts > 0))


def apply_masks(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    m = metadata
    if m.bias_index is not None and m.bias_values is not None:  # set together
        logits.index_put_(m.bias_index, m.bias_values, accumulate=True)
    if m.allowed_rows is not None and m.allowed_mask is not None:  # set together
        rows = logits[m.allowed_rows]
        logits[m.allowed_rows] = rows.masked_fill(~m.allowed_mask, NEG_INF)
    if m.ban_index is not None:
        logits[m.ban_index] = NEG_INF
    if m.grammar_mask is not None:
        apply_token_bitmask(logits, m.grammar_mask)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> None:
    logits.div_(temperature.unsqueeze(1))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    """Keep each row's k largest logits (and any tied with the k-th); top_k <= 0 is off."""
    top_values = logits.topk(max_top_k, dim=-1).values  # [B, max_top_k], descending
    kth = top_values.gather(1, (top_k.clamp(1, max_top_k) - 1).unsqueeze(1))  # [B, 1]
    kth.masked_fill_((top_k <= 0).unsqueeze(1), NEG_INF)
    logits.masked_fill_(logits < kth, NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """Keep the smallest set of most likely tokens whose probability reaches top_p.

    In ascending order a token is dropped when it and every less likely token together hold
    at most 1 - p of the mass; the most likely token is always kept. p = 1 rows are untouched.
    """
    sorted_logits, order = logits.sort(dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V] ascending
    drop = cumulative <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False
    drop &= (top_p < 1).unsqueeze(1)
    logits.masked_fill_(torch.empty_like(drop).scatter_(1, order, drop), NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens whose probability is below min_p x the top token's (log space: the same
    ratio, with no softmax). min_p = 0 gives a threshold of -inf."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    logits.masked_fill_(logits < threshold, NEG_INF)


def check_support(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Raise ValueError for a row with no finite maximum: everything masked, or NaN/inf."""
    bad = ~torch.isfinite(logits.amax(dim=-1))
    if not bool(bad.any()):
        return
    row = int(bad.nonzero()[0])
    request_id, p = metadata.request_ids[row], metadata.params[row]
    if bool(torch.isnan(logits[row]).any()) or bool(torch.isposinf(logits[row]).any()):
        raise ValueError(f"request {request_id}: the model's logits are not finite (NaN or +inf)")
    causes = []
    if p.allowed_token_ids is not None:
        causes.append(f"allowed_token_ids={p.allowed_token_ids}")
    if p.bad_words:
        causes.append(f"bad_words={p.bad_words}")
    if p.min_tokens:
        causes.append(f"min_tokens={p.min_tokens} (EOS and stop_token_ids="
                      f"{p.stop_token_ids} are banned until then)")
    if p.logit_bias:
        causes.append("logit_bias")
    if p.structured_outputs is not None:
        causes.append(f"{p.structured_outputs.field_name} (the constraint admits no token here)")
    raise ValueError(f"request {request_id}: no token can be sampled; every token is masked by "
                     f"{', '.join(causes) or 'the model logits (all -inf)'}")

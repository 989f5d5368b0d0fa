"""The sampler: processed logits -> one token per row, plus logprobs when asked.

Greedy rows take the argmax. Random rows use the exponential race: with q_i ~ Exp(1)
independent, argmax_i p_i / q_i is distributed exactly as Categorical(p) (q_i / p_i is
Exp(p_i), and the smallest of independent exponentials is i with probability p_i / sum p).
It needs no cumulative sum and no sync, and each seeded row draws its q from its own
generator, so its token does not depend on the other rows of the batch.

Structured outputs: a constrained row's grammar mask is part of the mask stage
(``processors.py``). Logprobs follow vLLM V1, whose model runner applies the grammar bitmask to
the logits before its sampler sees them: both 'processed' and 'raw' logprobs of a constrained
row are taken after the grammar mask (tokens the grammar forbids have logprob -inf, the rest
renormalised), and 'raw' is before every other processor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling.logprobs import LogprobsTensors, gather_logprobs
from engine.sampling.metadata import SamplingMetadata
from engine.sampling.processors import process_logits
from engine.structured.bitmask import apply_token_bitmask


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # rows of metadata.num_logprobs; None if no row asked


class Sampler:
    """``generator`` is shared by the unseeded rows (None: torch's default generator)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits: [B, V] from the model (any float dtype; never modified)."""
        processed = process_logits(_working_copy(logits, metadata), metadata)
        sampled = self._draw(processed, metadata)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            logprobs = _logprobs(logits, processed, sampled, metadata)
        return SamplerOutput(sampled, logprobs)

    def sample_blind(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The tokens ``__call__`` samples, without logprobs and without reading anything on the
        host: [B] int64 on the device, -1 for a row with no finite maximum (where ``__call__``
        raises). For rows of ``metadata.samples_blind`` (their masks are the model's alone)."""
        processed = process_logits(_working_copy(logits, metadata), metadata, check=False)
        sampled = self._draw(processed, metadata)
        # temperature and truncation keep a finite maximum finite, and an infinite one infinite
        return torch.where(torch.isfinite(processed.amax(dim=-1)), sampled, -1)

    def _draw(self, processed: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """One token per row of the processed logits: greedy rows' argmax, the others' race."""
        if metadata.all_greedy:
            return row_argmax(processed)
        sampled = sample_from_probs(processed.softmax(dim=-1), metadata, self.generator)
        if not metadata.all_random:
            sampled = torch.where(metadata.is_greedy, row_argmax(processed), sampled)
        return sampled

    def compute_probs(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        return compute_probs(logits, metadata)


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] int64: each row's first maximal index, as ``argmax(dim=-1)``. torch.max's
    indices are that too, and on CPU over a 49k vocabulary take 22 us to argmax's 65 (measured
    on this project's Xeon). The rows here are finite (``check_support`` ran)."""
    return logits.max(dim=-1).indices


def argmax_rows(logits: torch.Tensor) -> list[int] | None:
    """[B, V] -> each row's ``row_argmax``, or None when some row has no finite maximum (the
    full sampler then raises, naming the request). What ``Sampler`` returns for rows that
    ``metadata.takes_argmax``, without building their metadata. One device-to-host copy: a
    row without a finite maximum comes back as -1."""
    return tokens_or_none(greedy_tokens(logits))


def tokens_or_none(greedy: torch.Tensor) -> list[int] | None:
    """``greedy_tokens``' result as a list (one device-to-host copy), or None when some row had
    no finite maximum (-1)."""
    tokens: list[int] = greedy.tolist()
    return None if min(tokens, default=0) < 0 else tokens


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] int64 on the logits' device: each row's argmax, -1 where the row has no
    finite maximum (a decode graph computes it inside the replay). On CUDA one Triton launch
    (``kernels.greedy``), elsewhere torch's three."""
    from kernels.greedy import greedy_rows, greedy_rows_ref

    if logits.is_cuda and logits.stride(-1) == 1:
        return greedy_rows(logits)
    return greedy_rows_ref(logits)


def compute_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution each row samples from: [B, V] fp32, after every processor.

    Greedy rows are one-hot at their argmax, so a rejection sampler treats them exactly: a
    draft is accepted iff it is the argmax, and the recovered token is the argmax.
    """
    processed = process_logits(_working_copy(logits, metadata), metadata)
    probs = processed.softmax(dim=-1)
    if not metadata.all_random:
        one_hot = torch.zeros_like(probs).scatter_(1, processed.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(metadata.is_greedy.unsqueeze(1), one_hot, probs)
    return probs


def sample_from_probs(probs: torch.Tensor, metadata: SamplingMetadata,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """probs: [B, V] (rows sum to 1, zeros allowed) -> [B] int64 by the exponential race.
    Seeded rows draw from ``metadata.generators[row]``, the rest from ``generator``."""
    q = torch.empty_like(probs, dtype=torch.float32)
    seeded = [(row, g) for row, g in enumerate(metadata.generators) if g is not None]
    if len(seeded) < probs.shape[0]:
        q.exponential_(generator=generator)
    for row, g in seeded:
        q[row].exponential_(generator=g)
    # Exp(1) can return 0; a tiny floor keeps 0/0 (a masked token) from becoming NaN, which
    # argmax would pick.
    q.clamp_(min=torch.finfo(torch.float32).tiny)
    return probs.div(q).argmax(dim=-1)


def _working_copy(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    if logits.dtype != torch.float32:
        return logits.to(torch.float32)
    return logits.clone() if metadata.modifies_logits else logits


def _logprobs(raw_logits: torch.Tensor, processed: torch.Tensor, sampled: torch.Tensor,
              metadata: SamplingMetadata) -> LogprobsTensors:
    """Only called when some row asks for logprobs (``max_num_logprobs`` is set)."""
    assert metadata.max_num_logprobs is not None
    logprobs = None
    if metadata.needs_processed_logprobs:
        logprobs = processed.log_softmax(dim=-1)
    if metadata.raw_logprobs_rows is not None:
        raw = raw_logits.to(torch.float32)
        if metadata.grammar_mask is not None:
            raw = raw.clone() if raw is raw_logits else raw
            apply_token_bitmask(raw, metadata.grammar_mask)
        raw = raw.log_softmax(dim=-1)
        logprobs = raw if logprobs is None else torch.where(
            metadata.raw_logprobs_rows.unsqueeze(1), raw, logprobs)
    assert logprobs is not None  # each asking row is 'processed' or 'raw'
    return gather_logprobs(logprobs, sampled, metadata.max_num_logprobs)

"""SamplingMetadata: one step's sampling parameters for a batch, as tensors.

Built once per step by the engine from each row's SamplingParams and token history. Anything
no row uses is ``None`` and costs nothing: an all-greedy, penalty-free batch carries only
``temperature`` and the flags. One row is one sampled position; for speculative verification
give one row per position (the same params, output_token_ids extended by the draft prefix).

Seeded rows: the row's generator is re-seeded every step from (seed, number of output tokens),
so a seeded request's tokens depend only on its seed and history — not on the batch it is in,
on preemption, or on whether a prefill worker sampled its first token and a decode worker the
rest. Unseeded rows share the Sampler's generator.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams
from engine.structured.bitmask import GrammarMask

_MASK64 = (1 << 64) - 1
_NO_TRUNCATION = SamplingParams()  # stands in for greedy rows' top-k/top-p/min-p


@dataclass(slots=True)
class Penalties:
    """The penalty tensors of a batch with at least one penalised row (others stay neutral)."""

    repetition: torch.Tensor  # [B] fp32
    presence: torch.Tensor  # [B] fp32
    frequency: torch.Tensor  # [B] fp32
    prompt_mask: torch.Tensor  # [B, V] bool: token occurs in the prompt
    output_counts: torch.Tensor  # [B, V] fp32: occurrences in the output so far


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling state for a batch of B rows over a vocabulary of V tokens."""

    params: list[SamplingParams]
    request_ids: list[str]  # for error messages
    temperature: torch.Tensor  # [B] fp32; 1.0 on greedy rows
    is_greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    all_random: bool
    # Truncation (None when no random row uses it; greedy rows are always "off").
    top_k: torch.Tensor | None  # [B] int64; <= 0 is off
    max_top_k: int
    top_p: torch.Tensor | None  # [B] fp32; 1.0 is off
    min_p: torch.Tensor | None  # [B] fp32; 0.0 is off
    penalties: Penalties | None  # None when no row has a penalty
    # Masks: sparse bias, sparse bans, dense allow-list only for the rows that have one.
    bias_index: tuple[torch.Tensor, torch.Tensor] | None  # (rows [N], token ids [N]) int64
    bias_values: torch.Tensor | None  # [N] fp32
    ban_index: tuple[torch.Tensor, torch.Tensor] | None  # (rows [M], token ids [M]) int64
    allowed_rows: torch.Tensor | None  # [A] int64
    allowed_mask: torch.Tensor | None  # [A, V] bool: True = may be sampled
    grammar_mask: GrammarMask | None  # the structured-output rows' token bitmask (engine/structured/)
    # Randomness and logprobs.
    generators: list[torch.Generator | None]  # [B]; None = the Sampler's shared generator
    num_logprobs: list[int | None]  # [B]; requested top-N per row
    max_num_logprobs: int | None  # None when no row asks for logprobs
    raw_logprobs_rows: torch.Tensor | None  # [B] bool: logprobs_mode == 'raw'; None if no row
    needs_processed_logprobs: bool

    @property
    def batch_size(self) -> int:
        return len(self.params)

    @property
    def no_penalties(self) -> bool:
        return self.penalties is None

    @property
    def modifies_logits(self) -> bool:
        """Whether processing changes the logits at all (else the sampler skips copying them)."""
        return not (self.all_greedy and self.no_penalties and self.bias_index is None
                    and self.ban_index is None and self.allowed_rows is None
                    and self.grammar_mask is None)

    @classmethod
    def from_requests(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        prompt_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None] | None,
        vocab_size: int,
        device: torch.device | str = "cpu",
        *,
        eos_token_ids: Sequence[int] = (),
        request_ids: Sequence[str] | None = None,
        grammar_mask: GrammarMask | None = None,
    ) -> SamplingMetadata:
        """Build the batch's metadata. ``params`` must already be validated against
        ``vocab_size``; ``generators[i]`` (on ``device``) is reused for a seeded row, or one is
        created; it is re-seeded here either way. ``grammar_mask``: the constrained rows'
        bitmask (``engine.structured.bitmask.build_grammar_mask``), None when no row has one."""
        params = list(params)
        num_rows = len(params)
        ids = [str(i) for i in range(num_rows)] if request_ids is None else list(request_ids)
        tensor = _on(device)
        greedy = [p.is_greedy for p in params]
        random_params = [_NO_TRUNCATION if g else p for p, g in zip(params, greedy)]

        top_ks = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in random_params]
        top_ps = [p.top_p for p in random_params]
        min_ps = [p.min_p for p in random_params]

        penalties = (_penalty_tensors(params, output_token_ids, prompt_token_ids, vocab_size, device)
                     if any(p.has_penalties for p in params) else None)

        bias_rows: list[int] = []
        bias_tokens: list[int] = []
        bias_values: list[float] = []
        ban_rows: list[int] = []
        ban_tokens: list[int] = []
        for row, (p, output) in enumerate(zip(params, output_token_ids)):
            if p.logit_bias:
                bias_rows.extend([row] * len(p.logit_bias))
                bias_tokens.extend(p.logit_bias.keys())
                bias_values.extend(p.logit_bias.values())
            banned = _banned_token_ids(p, output, eos_token_ids)
            ban_rows.extend([row] * len(banned))
            ban_tokens.extend(banned)
        allowed_rows = [row for row, p in enumerate(params) if p.allowed_token_ids is not None]
        allowed_mask = None
        if allowed_rows:
            allowed_mask = torch.zeros(len(allowed_rows), vocab_size, dtype=torch.bool,
                                       device=device)
            allowed_mask[_flat_index([params[r].allowed_token_ids or () for r in allowed_rows],
                                     device)] = True

        seeded_generators = _seeded_generators(params, output_token_ids, generators, device)
        num_logprobs = [p.logprobs for p in params]
        wanted = [(n, p.logprobs_mode) for n, p in zip(num_logprobs, params) if n is not None]
        any_raw = any(mode == "raw" for _, mode in wanted)
        return cls(
            params=params,
            request_ids=ids,
            temperature=tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                               torch.float32),
            is_greedy=tensor(greedy, torch.bool),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=tensor(top_ks, torch.int64) if any(top_ks) else None,
            max_top_k=max(top_ks, default=0),
            top_p=tensor(top_ps, torch.float32) if any(p < 1.0 for p in top_ps) else None,
            min_p=tensor(min_ps, torch.float32) if any(p > 0.0 for p in min_ps) else None,
            penalties=penalties,
            bias_index=(tensor(bias_rows, torch.int64), tensor(bias_tokens, torch.int64))
            if bias_rows else None,
            bias_values=tensor(bias_values, torch.float32) if bias_rows else None,
            ban_index=(tensor(ban_rows, torch.int64), tensor(ban_tokens, torch.int64))
            if ban_rows else None,
            allowed_rows=tensor(allowed_rows, torch.int64) if allowed_rows else None,
            allowed_mask=allowed_mask,
            grammar_mask=grammar_mask,
            generators=seeded_generators,
            num_logprobs=num_logprobs,
            max_num_logprobs=max((n for n, _ in wanted), default=None),
            raw_logprobs_rows=tensor([p.logprobs_mode == "raw" for p in params], torch.bool)
            if any_raw else None,
            needs_processed_logprobs=any(mode == "processed" for _, mode in wanted),
        )


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request-local generator; ``SamplingMetadata.from_requests`` re-seeds it every step."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & _MASK64)
    return generator


def step_seed(seed: int, num_output_tokens: int) -> int:
    """The 64-bit seed for sampling output position ``num_output_tokens`` of a seeded request."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ num_output_tokens)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _on(device: torch.device | str) -> Callable[[Sequence[object], torch.dtype], torch.Tensor]:
    def tensor(values: Sequence[object], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
    return tensor


def takes_argmax(p: SamplingParams, output: Sequence[int], eos_token_ids: Sequence[int]) -> bool:
    """Whether a row's sample is the argmax of its raw logits and nothing else is asked of them:
    greedy, no logprobs, and no processor that would change them now (penalties, logit_bias,
    allowed_token_ids, a structured-output constraint, a banned token). A batch of such rows
    needs no metadata (the sampler's result would be ``row_argmax`` of the logits)."""
    return p.is_greedy and p.logits_unprocessed and not _banned_token_ids(p, output, eos_token_ids)


def samples_blind(p: SamplingParams, num_output: int, eos_token_ids: Sequence[int]) -> bool:
    """Whether a row with ``num_output`` output tokens is sampled from its logits alone, on the
    device, without reading those tokens (a chained decode step's row: the step before samples
    its last one) and without a check that needs the host: greedy or random (temperature,
    top-k/p, min-p, a seed: the seeded generator reads only their number), and no logprobs,
    penalties, logit bias, allowed tokens, bad words, grammar or banned stop token."""
    # without bad words, the bans read only the number of output tokens (none from min_tokens
    # on): a range stands for them
    return (p.logits_unprocessed and not p.bad_words_token_ids
            and (num_output >= p.min_tokens or not _banned_token_ids(p, range(num_output), eos_token_ids)))


def _banned_token_ids(p: SamplingParams, output: Sequence[int],
                      eos_token_ids: Sequence[int]) -> list[int]:
    """Tokens this row may not sample now: a bad word's last token when the output ends with
    the rest of it, and the stop tokens (EOS unless ignore_eos) before min_tokens."""
    banned: list[int] = []
    for word in p.bad_words_token_ids or ():
        prefix = word[:-1]
        if len(prefix) <= len(output) and list(output[len(output) - len(prefix):]) == prefix:
            banned.append(word[-1])
    if len(output) < p.min_tokens:
        banned.extend(p.stop_token_ids)
        if not p.ignore_eos:
            banned.extend(eos_token_ids)
    return banned


def _penalty_tensors(params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]],
                     prompt_token_ids: Sequence[Sequence[int]], vocab_size: int,
                     device: torch.device | str) -> Penalties:
    tensor = _on(device)
    # Rows without penalties contribute no tokens, so their rows of the dense tensors stay zero.
    outputs: list[Sequence[int]] = [o if p.has_penalties else ()
                                    for p, o in zip(params, output_token_ids)]
    prompts: list[Sequence[int]] = [t if p.repetition_penalty != 1.0 else ()
                                    for p, t in zip(params, prompt_token_ids)]
    output_counts = torch.zeros(len(params), vocab_size, dtype=torch.float32, device=device)
    output_counts.index_put_(_flat_index(outputs, device), torch.ones((), device=device),
                             accumulate=True)
    prompt_mask = torch.zeros(len(params), vocab_size, dtype=torch.bool, device=device)
    prompt_mask[_flat_index(prompts, device)] = True
    return Penalties(tensor([p.repetition_penalty for p in params], torch.float32),
                     tensor([p.presence_penalty for p in params], torch.float32),
                     tensor([p.frequency_penalty for p in params], torch.float32),
                     prompt_mask, output_counts)


def _flat_index(rows: Sequence[Sequence[int]], device: torch.device | str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row ids [N], token ids [N]) for every token of every row, built on the CPU in one go
    and moved once."""
    token_ids = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.int64)
    row_ids = torch.repeat_interleave(torch.tensor([len(r) for r in rows], dtype=torch.int64))
    return row_ids.to(device), token_ids.to(device)


def _seeded_generators(params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]],
                       generators: Sequence[torch.Generator | None] | None,
                       device: torch.device | str) -> list[torch.Generator | None]:
    """Per-row generators, re-seeded for this step; a generator object is never shared by two
    rows (speculative verification gives one request several rows)."""
    result: list[torch.Generator | None] = []
    used: set[int] = set()
    for row, p in enumerate(params):
        if p.seed is None or p.is_greedy:
            result.append(None)
            continue
        generator = generators[row] if generators is not None else None
        if generator is None or id(generator) in used:
            generator = torch.Generator(device=device)
        used.add(id(generator))
        generator.manual_seed(step_seed(p.seed, len(output_token_ids[row])))
        result.append(generator)
    return result

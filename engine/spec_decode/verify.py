"""Verification of a step's drafts against the target's logits (the runner calls this)."""

from __future__ import annotations

import torch

from engine.request import Request
from engine.sampling.metadata import SamplingMetadata, step_seed
from engine.sampling.sampler import compute_probs
from engine.spec_decode.proposer import Proposal, pack_proposals
from engine.spec_decode.rejection_sampler import rejection_sample
from engine.structured.bitmask import build_grammar_mask


def verify_drafts(logits: torch.Tensor, requests: list[Request],
                  draft_probs: dict[str, torch.Tensor | None], vocab_size: int,
                  device: torch.device, generator: torch.Generator | None = None) -> list[list[int]]:
    """logits: [sum(k_i + 1), V], request i's k_i draft positions then its bonus position.

    Returns, per request, the accepted drafts followed by one recovered or bonus token. The
    target distribution of each row is processed exactly as normal sampling would process it
    at that position (penalties see the drafts before it), so the output is distributed as
    sampling from the target one token at a time.

    Structured outputs: every row of a constrained request is masked by its grammar at that
    position (after the drafts before it), so an accepted draft, a recovered and a bonus token
    always obey, and greedy verification emits exactly what greedy decoding would. A draft the
    grammar refuses has target probability 0 and is rejected."""
    for r in requests:
        r.matcher.sync(r.output_token_ids)
    grammar_mask = build_grammar_mask([(r.matcher, r.spec_token_ids) for r in requests], vocab_size, device)
    params, outputs, prompts, ids = [], [], [], []
    for r in requests:
        for j in range(len(r.spec_token_ids) + 1):
            params.append(r.sampling_params)
            outputs.append(r.output_token_ids + r.spec_token_ids[:j])
            prompts.append(r.prompt_token_ids)
            ids.append(r.request_id)
    metadata = SamplingMetadata.from_requests(
        params, outputs, prompts, None, vocab_size, device,
        eos_token_ids=requests[0].eos_token_ids, request_ids=ids, grammar_mask=grammar_mask)
    target_probs = compute_probs(logits, metadata)  # [sum(k_i + 1), V]; greedy rows one-hot
    draft_ids, num_drafts, q = pack_proposals(
        [Proposal(r.spec_token_ids, draft_probs.get(r.request_id)) for r in requests],
        vocab_size, device)
    generators = []
    for r in requests:  # seeded requests: request-local, position-keyed randomness
        seed = r.sampling_params.seed
        generators.append(None if seed is None else
                          torch.Generator(device=device).manual_seed(step_seed(seed, r.num_output_tokens)))
    out = rejection_sample(draft_ids, num_drafts, q, target_probs, generators,
                           [r.sampling_params.is_greedy for r in requests],
                           default_generator=generator)
    token_ids = out.output_token_ids.tolist()
    return [row[:n + 1] for row, n in zip(token_ids, out.num_accepted.tolist())]

"""The engine side of speculative decoding: how many drafts, from where, and statistics.

Per step (EngineCore.step)::

    plan(running)            before schedule: each decoding request gets k drafts (n-gram:
                             the tokens themselves; model drafters: k placeholder slots), so
                             the scheduler counts them in the token budget and allocates slots
    fill(sched, block_ids)   after schedule: trim drafts to what the budget allowed and run
                             the model drafter into the reserved slots; returns their q
    ...runner verifies...    rejection sampling; update() rolls the block table back
    record(sched, sampled)   acceptance statistics, adaptive k

With speculation off the engine holds a ``NoSpecDecoder`` (``protocol.py``) instead:
``build_spec_decoder`` picks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from engine.config import CacheConfig, SpecConfig
from engine.request import Request
from engine.scheduler.output import SchedulerOutput
from engine.spec_decode.adaptive import AdaptiveK, AdaptiveKConfig
from engine.spec_decode.model_drafter import DraftModelDrafter, LayerSkipDrafter
from engine.spec_decode.ngram import propose_ngram
from engine.spec_decode.protocol import NoSpecDecoder, SpecDecoderProtocol

if TYPE_CHECKING:
    from engine.runner.model_runner import ModelRunner

PLACEHOLDER_TOKEN = 0  # a model drafter's slot before fill() writes the real draft
# The target's extra cost per verified draft position, as a fraction of a one-token decode step
# at batch 1: forward + logits at context 150 on the compiled CPU backend took 14.3 ms for one
# position, 15.7 / 17.3 / 17.7 / 19.6 ms for 2 / 3 / 5 / 8 (0.10 per draft for 1-2 drafts,
# 0.06 for 4-7; docs/benchmark-log.md). Past ~3 rows the matmuls turn compute-bound: one draft per
# request adds 24% to the matmul time at batch 8 (M 8 -> 16: 15.6 -> 19.3 ms) and 57% at batch 16
# (M 16 -> 32: 19.3 -> 30.4 ms, all layers + LM head), hence the knee.
VERIFY_COST_PER_DRAFT = 0.08
VERIFY_BATCH_KNEE = 3.0


def build_spec_decoder(config: SpecConfig, runner: ModelRunner, cache_config: CacheConfig) -> SpecDecoderProtocol:
    """A SpecDecoder for ``config.method``, or NoSpecDecoder when it is unset."""
    return SpecDecoder(config, runner, cache_config) if config.method else NoSpecDecoder()


class SpecDecoder:
    def __init__(self, config: SpecConfig, runner: ModelRunner, cache_config: CacheConfig) -> None:
        self.config = config
        model = runner.model
        self.drafter: LayerSkipDrafter | DraftModelDrafter | None = None
        draft_cost = 0.0  # n-gram lookup: free next to a forward
        if config.method == "layer-skip":
            num_layers = config.num_layers or max(1, model.config.num_layers // 4)
            self.drafter = LayerSkipDrafter(model, runner.kv_cache, num_layers, runner.block_size)
            # decode is bandwidth-bound: a draft costs the share of weight bytes it reads
            head = model.config.vocab_size * model.config.hidden_size * model.dtype.itemsize
            per_layer = (model.weight_bytes - head) / model.config.num_layers
            draft_cost = (num_layers * per_layer + head) / model.weight_bytes
        elif config.method == "draft":
            from engine.models.llama import LlamaForCausalLM
            from engine.models.loader import load_model
            loaded = load_model(config.draft_model)
            if loaded.config.vocab_size != model.config.vocab_size:
                raise ValueError(f"draft model vocab ({loaded.config.vocab_size}) differs from the "
                                 f"target's ({model.config.vocab_size}): it must share the tokenizer")
            draft = LlamaForCausalLM(loaded.config, loaded.weights, model.ops, model.device, model.dtype)
            self.drafter = DraftModelDrafter(draft, CacheConfig(
                block_size=runner.block_size, memory_budget_bytes=cache_config.memory_budget_bytes // 4,
                dtype=cache_config.dtype, enable_prefix_caching=False))
            draft_cost = draft.weight_bytes / model.weight_bytes
        if config.draft_cost is not None:
            draft_cost = config.draft_cost
        self.adaptive = AdaptiveK(AdaptiveKConfig(
            max_k=config.k, batch_size_threshold=config.max_batch, probe_k=1,
            draft_cost=draft_cost, verify_cost=VERIFY_COST_PER_DRAFT,
            verify_batch_knee=VERIFY_BATCH_KNEE))

    def plan(self, running: list[Request], max_model_len: int) -> None:
        batch_size = len(running)
        for request in running:
            request.spec_token_ids = []
            params = request.sampling_params
            if request.num_computed_tokens != request.num_tokens - 1 or params.logprobs is not None:
                continue  # still prefilling, or wants per-token logprobs (not with drafts)
            k = self.adaptive.next_k(request.request_id, batch_size)
            if params.max_tokens is not None:
                k = min(k, params.max_tokens - request.num_output_tokens - 1)
            k = min(k, max_model_len - request.num_tokens - 1)
            if k <= 0:
                continue
            if self.drafter is None:
                drafts = propose_ngram(request.all_token_ids, k, self.config.ngram_min, self.config.ngram_max)
                # structured outputs: drafts end before the first one the grammar refuses
                request.matcher.sync(request.output_token_ids)
                request.spec_token_ids = drafts[:request.matcher.num_valid(drafts)]
            else:
                request.spec_token_ids = [PLACEHOLDER_TOKEN] * k

    def fill(self, sched: SchedulerOutput, block_ids: Mapping[str, Sequence[int]]) -> dict[str, torch.Tensor | None]:
        """Trim drafts to what the budget allowed and run the model drafter into the reserved
        slots. Returns the drafted requests' q (n-gram drafts: none, a point mass)."""
        draft_probs: dict[str, torch.Tensor | None] = {}
        drafted, ks = [], []
        for request in sched.scheduled:
            if not request.spec_token_ids:
                continue
            allowed = sched.num_scheduled_tokens[request.request_id] - 1  # the budget may cut drafts
            del request.spec_token_ids[max(allowed, 0):]
            if self.drafter is not None and request.spec_token_ids:
                drafted.append(request)
                ks.append(len(request.spec_token_ids))
        if not drafted or self.drafter is None:
            return draft_probs
        for request, proposal in zip(drafted, self.drafter.draft(drafted, ks, block_ids)):
            # structured outputs: drafts end before the first one the grammar refuses
            request.matcher.sync(request.output_token_ids)
            num_valid = request.matcher.num_valid(proposal.draft_token_ids)
            request.spec_token_ids = proposal.draft_token_ids[:num_valid]
            sched.num_scheduled_tokens[request.request_id] = 1 + num_valid
            probs = proposal.draft_probs
            draft_probs[request.request_id] = None if probs is None else probs[:num_valid]
        return draft_probs

    def record(self, sched: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        for request in sched.scheduled:
            if request.spec_token_ids:
                num_accepted = len(sampled.get(request.request_id, ())) - 1
                self.adaptive.record(request.request_id, len(request.spec_token_ids), num_accepted)

    def remove(self, request_id: str) -> None:
        self.adaptive.remove(request_id)
        if self.drafter is not None:
            self.drafter.remove(request_id)

    def stats(self) -> dict[str, object]:
        """Proposed / accepted drafts per position and the mean accepted length per step."""
        a = self.adaptive
        return {"num_spec_steps": a.num_spec_steps,
                "num_proposed_per_position": list(a.num_proposed_per_position),
                "num_accepted_per_position": list(a.num_accepted_per_position),
                "mean_accepted_length": a.mean_accepted_length}

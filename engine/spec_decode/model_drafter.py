"""Model-based proposers: layer-skip self-speculation and a separate draft model.

Both draft autoregressively: k cheap forward passes, each over one new token per request,
batched across requests. Drafts are sampled from q, the drafter's *processed* distribution
(same temperature / top-k / top-p / penalties as the target), and q is returned with them so
the rejection sampler stays exact; greedy requests draft the argmax with a point-mass q.

- Layer-skip writes the KV of its first L layers into the target's own cache, at the slots
  the scheduler reserved for the draft positions; the verify pass overwrites them with the
  full model's KV, so there is nothing to roll back.
- The draft model has its own small paged cache under the same block-pool rules. It keeps,
  per request, the tokens whose KV it holds; before drafting it truncates to the prefix the
  request still agrees with (rejected drafts fall away) and catches up on the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from engine.config import CacheConfig
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.storage import allocate_kv_cache
from engine.models.llama import LlamaForCausalLM
from engine.request import Request
from engine.runner.inputs import ScheduledSeq, build_model_input
from engine.sampling.metadata import SamplingMetadata
from engine.sampling.sampler import compute_probs, sample_from_probs
from engine.spec_decode.proposer import Proposal

# (scheduled sequences) -> logits [num_seqs, V]
ForwardFn = Callable[[list[ScheduledSeq]], torch.Tensor]


def draft_autoregressive(requests: list[Request], ks: list[int], first_seqs: list[ScheduledSeq],
                         forward: ForwardFn, vocab_size: int, device: torch.device,
                         generator: torch.Generator) -> list[Proposal]:
    """Run up to max(ks) drafting steps. ``first_seqs[i]`` is request i's first step (ending at
    its last real token); each later step feeds the previous draft at the next position."""
    drafts: list[list[int]] = [[] for _ in requests]
    q_rows: list[list[torch.Tensor]] = [[] for _ in requests]
    seqs = list(first_seqs)
    active = [i for i, k in enumerate(ks) if k > 0]
    while active:
        logits = forward([seqs[i] for i in active])
        reqs = [requests[i] for i in active]
        metadata = SamplingMetadata.from_requests(
            [r.sampling_params for r in reqs], [r.output_token_ids + drafts[i] for i, r in zip(active, reqs)],
            [r.prompt_token_ids for r in reqs], None, vocab_size, device,
            eos_token_ids=reqs[0].eos_token_ids, request_ids=[r.request_id for r in reqs])
        probs = compute_probs(logits, metadata)  # greedy rows are one-hot
        tokens = sample_from_probs(probs, metadata, generator).tolist()
        still_active = []
        for row, i in enumerate(active):
            drafts[i].append(tokens[row])
            if not requests[i].sampling_params.is_greedy:
                q_rows[i].append(probs[row])
            if len(drafts[i]) < ks[i]:
                prev = seqs[i]
                seqs[i] = ScheduledSeq([tokens[row]], prev.start_pos + len(prev.token_ids),
                                       prev.block_ids, 1)
                still_active.append(i)
        active = still_active
    return [Proposal(d, torch.stack(q) if q else None) for d, q in zip(drafts, q_rows)]


class LayerSkipDrafter:
    """The target's first ``num_layers`` layers + final norm + LM head as the drafter."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, num_layers: int,
                 block_size: int, seed: int = 0) -> None:
        if not 1 <= num_layers < model.config.num_layers:
            raise ValueError(f"layer-skip needs 1 <= spec layers < {model.config.num_layers}, "
                             f"got {num_layers}")
        self.model, self.kv_cache, self.num_layers = model, kv_cache, num_layers
        self.block_size = block_size
        self.generator = torch.Generator(device=model.device).manual_seed(seed)

    def _forward(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        inp = build_model_input(seqs, self.block_size, self.model.device)
        hidden = self.model.forward(inp.input_ids, inp.positions, inp.attn, self.kv_cache,
                                    num_layers=self.num_layers)
        return self.model.compute_logits(hidden[inp.logits_indices])

    def draft(self, requests: list[Request], ks: list[int],
              block_ids: Mapping[str, Sequence[int]]) -> list[Proposal]:
        first = [ScheduledSeq([r.token_view[-1]], r.num_tokens - 1, block_ids[r.request_id], 1)
                 for r in requests]
        return draft_autoregressive(requests, ks, first, self._forward,
                                    self.model.config.vocab_size, self.model.device, self.generator)

    def remove(self, request_id: str) -> None:
        pass


class DraftModelDrafter:
    """A separate (smaller) model sharing the tokenizer, with its own paged KV cache."""

    def __init__(self, model: LlamaForCausalLM, cache_config: CacheConfig, seed: int = 0) -> None:
        self.model = model
        self.block_size = cache_config.block_size
        self.kv_cache = allocate_kv_cache(model.config, cache_config, model.device)
        self.kv_manager = KVCacheManager(BlockPool(self.kv_cache.shape[0], enable_caching=False,
                                                   enable_events=False), self.block_size)
        self.fed: dict[str, list[int]] = {}  # request id -> tokens whose KV the cache holds
        self.generator = torch.Generator(device=model.device).manual_seed(seed)

    def _forward(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        inp = build_model_input(seqs, self.block_size, self.model.device)
        hidden = self.model.forward(inp.input_ids, inp.positions, inp.attn, self.kv_cache)
        return self.model.compute_logits(hidden[inp.logits_indices])

    def draft(self, requests: list[Request], ks: list[int],
              block_ids: Mapping[str, Sequence[int]]) -> list[Proposal]:
        first, ks = [], list(ks)
        for i, r in enumerate(requests):
            tokens = r.all_token_ids
            fed = self.fed.setdefault(r.request_id, [])
            num_valid = _common_prefix(fed, tokens[:-1])  # the last token is fed this step
            del fed[num_valid:]
            if num_valid:
                self.kv_manager.truncate(r.request_id, num_valid)
            else:
                self.kv_manager.free(r.request_id)
            if self.kv_manager.allocate_slots(r.request_id, len(tokens) + ks[i] - 1,
                                              num_computed_tokens=num_valid) is None:
                ks[i] = 0  # no room in the draft cache: verify without drafts this step
            new = tokens[num_valid:]
            first.append(ScheduledSeq(new, num_valid, self.kv_manager.get_block_ids(r.request_id), 1))
        proposals = draft_autoregressive(requests, ks, first, self._forward,
                                         self.model.config.vocab_size, self.model.device, self.generator)
        for r, k, p in zip(requests, ks, proposals):
            if k:
                self.fed[r.request_id] = r.all_token_ids + p.draft_token_ids[:-1]
        return proposals

    def remove(self, request_id: str) -> None:
        self.fed.pop(request_id, None)
        self.kv_manager.free(request_id)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n

"""Runs one scheduled step on the model: build inputs, forward, logits, sample.

Owns the device-side state: the model, the KV cache tensor and the sampler. It does not
decide anything; the scheduler did.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from engine.config import EngineConfig, ModelConfig, Role
from engine.kv_cache.quant_format import is_quantized
from engine.kv_cache.storage import allocate_kv_cache
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import LoadedModel
from engine.models.quant_weights import plan_quantized
from engine.request import Request
from engine.runner.core_share import CoreShare
from engine.runner.cpu_threads import configure_cpu_threads, set_pool_threads
from engine.runner.cuda_graphs import CudaGraphCapture, DecodeGraphs, NoDecodeGraphs, StepLogits
from engine.runner.deferred import DeferredSteps, DeferredTokens
from engine.runner.inputs import ScheduledSeq, build_model_input
from engine.runner.logit_rows import LogitRows, plan_logit_rows
from engine.runner.memory import gpu_kv_blocks
from engine.runner.output import RunnerOutput
from engine.runner.warmup import choose_decode_matmuls, warm_up
from engine.sampling.logprobs import compute_prompt_logprobs
from engine.sampling.metadata import SamplingMetadata, samples_blind, takes_argmax
from engine.sampling.sampler import Sampler, argmax_rows, greedy_tokens, tokens_or_none
from engine.scheduler.output import SchedulerOutput
from engine.spec_decode.verify import verify_drafts
from engine.structured.bitmask import build_grammar_mask
from kernels.block_copy import copy_blocks, copy_blocks_ref
from kernels.calibration import ModelDims
from kernels.gemv import gemv_mode
from kernels.ops import Ops, compiled_ops, get_ops, select_backend

log = logging.getLogger(__name__)


def model_dims(config: ModelConfig) -> ModelDims:
    """The shapes the kernel calibration measures with (``kernels.calibration``)."""
    return ModelDims(config.hidden_size, config.intermediate_size, config.num_heads,
                     config.num_kv_heads, config.head_dim, config.num_layers)


def kv_quant_ops(ops: Ops, backend: str) -> Ops:
    """``ops`` for a quantized KV cache, or one stored in another dtype than the model's (bf16
    under fp32): on the 'cpu' backend the compiled store and attention serve every size (they
    read the 1-byte codes or bf16 rows in place; the calibration's torch choice was timed on an
    fp32 cache and would convert the whole context on every call). The 'torch' and 'triton' ops
    read such a cache as they are."""
    if backend != "cpu":
        return ops
    compiled = compiled_ops()
    return replace(ops, store_kv=compiled.store_kv, paged_attention=compiled.paged_attention)


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        self.config = config
        self.device = torch.device(config.device)
        dtype = getattr(torch, config.dtype)
        self.backend = select_backend(self.device, dtype)
        self.core_share: CoreShare | None = None
        self.gemv_choices: list[str] = []  # kernels.gemv's choice per decode matmul, on CUDA
        if self.device.type == "cpu" and dtype == torch.float32:
            num_threads = configure_cpu_threads(config.num_threads, self.backend)
            if config.core_share:
                self.core_share = CoreShare(config.core_share, num_threads,
                                            functools.partial(set_pool_threads, backend=self.backend))
        plan = plan_quantized(loaded.config, loaded.weights, loaded.blocks, config.weight_format,
                              config.dtype)
        # GGUF blocks: the compiled kernels serve every size. Their quantized matmul is the format's
        # arithmetic (int8 activations, kernels/quant_cpu.py); the calibration's torch candidate
        # (dequantize, fp32 matmul) computes other numbers, and choosing between the two by batch
        # size would make a request's greedy tokens depend on what it was batched with.
        ops = get_ops(self.backend, None if plan is not None else model_dims(loaded.config))
        if is_quantized(config.cache.dtype) or config.cache.dtype != config.dtype:
            ops = kv_quant_ops(ops, self.backend)
        self.model = LlamaForCausalLM(loaded.config, loaded.weights, ops, self.device, dtype,
                                      quant_plan=plan)
        # a prefill worker's steps are prompts: more rows than the fused GEMV takes
        if (self.backend == "triton" and self.device.type == "cuda" and gemv_mode() == "auto"
                and config.scheduler.role != Role.PREFILL):
            started = time.perf_counter()
            self.gemv_choices = choose_decode_matmuls(self.model)
            if self.gemv_choices:
                log.info("decode matmuls: fused Triton GEMV or not, timed in %.1f s:\n  %s",
                         time.perf_counter() - started, "\n  ".join(self.gemv_choices))
        cache = config.cache
        if self.device.type == "cuda" and cache.gpu_memory_utilization is not None and cache.num_blocks is None:
            scheduler = config.scheduler
            cache = replace(cache, num_blocks=gpu_kv_blocks(
                self.model, cache, scheduler.max_num_batched_tokens, scheduler.max_num_seqs))
        self.kv_cache = allocate_kv_cache(loaded.config, cache, self.device)
        self.block_size = config.cache.block_size
        self.vocab_size = loaded.config.vocab_size
        self.eos_token_ids = loaded.config.eos_token_ids
        self.sampler = Sampler()
        self._argmax_rows = ops.argmax_rows or argmax_rows  # plain greedy rows: the compiled pass where built
        self._copy_blocks = copy_blocks if self.backend == "triton" else copy_blocks_ref
        if self.backend == "triton" and self.device.type == "cuda":
            seconds = warm_up(self.model, self.kv_cache, config.scheduler.max_num_batched_tokens)
            log.info("compiled the kernels' variants in %.1f s", seconds)
        self.decode_graphs = self._decode_graphs(config)
        self.deferred = DeferredSteps(config.scheduler.max_num_seqs, self.device)

    def _decode_graphs(self, config: EngineConfig) -> DecodeGraphs | NoDecodeGraphs:
        """Decode steps as CUDA graphs, captured now (``engine/runner/cuda_graphs.py``), on CUDA
        unless ``enforce_eager``; a prefill worker's engine never decodes, so it captures none."""
        if self.device.type != "cuda" or config.enforce_eager or config.scheduler.role == Role.PREFILL:
            return NoDecodeGraphs()
        graphs = DecodeGraphs(self.model, self.kv_cache, config.scheduler.max_num_seqs,
                              config.model.max_model_len, self.block_size, CudaGraphCapture())
        seconds = graphs.capture_all()
        log.info("captured %d decode CUDA graphs (batch sizes 1..%d; %d more for short contexts, "
                 "batch size: blocks %s) in %.1f s", len(graphs.sizes), graphs.sizes[-1],
                 len(graphs.short_sizes), graphs.short_sizes, seconds)
        return graphs

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.shape[0]

    def execute(self, sched: SchedulerOutput, block_ids: Mapping[str, Sequence[int]],
                draft_probs: dict[str, torch.Tensor | None] | None = None) -> RunnerOutput:
        """Forward the scheduled tokens; sample for every request that reached its last token
        (and for the parallel samples forked from it this step); verify draft tokens of the
        requests that carry them (``draft_probs``: their q, None for a point mass). With a core
        share, on the thread count it gives for this step."""
        out = self.launch(sched, block_ids, draft_probs)
        return out.output() if isinstance(out, DeferredTokens) else out

    def launch(self, sched: SchedulerOutput, block_ids: Mapping[str, Sequence[int]],
               draft_probs: dict[str, torch.Tensor | None] | None = None, defer: bool = False,
               chain: DeferredTokens | None = None) -> RunnerOutput | DeferredTokens:
        """``execute``, but with ``defer`` a step whose rows are sampled blind (``samples_blind``)
        returns its tokens still on their way to the host (``deferred.py``) instead of waiting for
        them. ``chain``: the step before a chained one (``sched.num_fed``), whose tokens are the
        first ``num_fed`` input ids."""
        if self.core_share is None:
            return self._execute(sched, block_ids, draft_probs, defer, chain)
        self.core_share.step_started()
        try:
            return self._execute(sched, block_ids, draft_probs, defer, chain)
        finally:
            self.core_share.step_ended()

    def _execute(self, sched: SchedulerOutput, block_ids: Mapping[str, Sequence[int]],
                 draft_probs: dict[str, torch.Tensor | None] | None, defer: bool,
                 chain: DeferredTokens | None) -> RunnerOutput | DeferredTokens:
        if sched.copy_ops:
            src, dst = zip(*sched.copy_ops)
            self._copy_blocks(self.kv_cache, torch.tensor(src, device=self.device),
                              torch.tensor(dst, device=self.device))
        fed, known = sched.scheduled[:sched.num_fed], sched.scheduled[sched.num_fed:]
        rows = plan_logit_rows(known, sched.num_scheduled_tokens, sched.fork_children)
        seqs = []
        for request, num_logits in zip(known, rows.num_logits):
            start = request.num_computed_tokens
            end = start + sched.num_scheduled_tokens[request.request_id]
            seqs.append(ScheduledSeq(request.tokens_with_spec(start, end), start,
                                     block_ids[request.request_id], num_logits))
        fed_ids = None
        if fed:  # a chained step: first each fed request's token in flight, after its known ones
            assert chain is not None, "a chained step needs the step it follows"
            fed_ids = chain.chain_input(fed)
            rows = LogitRows([1] * len(fed) + rows.num_logits, [(r, i) for i, r in enumerate(fed)] + [
                (r, row + len(fed)) for r, row in rows.sample_rows], prompt_rows=rows.prompt_rows,
                verify_requests=rows.verify_requests)  # the scheduler admits neither to a chained step
            seqs = [ScheduledSeq([0], r.num_tokens, block_ids[r.request_id]) for r in fed] + seqs
        step = self._forward(seqs, fed_ids)

        out = RunnerOutput()
        if step is None:
            return out
        if defer and self._samples_blind(rows, step.logits.shape[0], sched.num_fed):
            requests = [r for r, _ in rows.sample_rows]
            return self.deferred.start(requests, self._blind_tokens(step, requests, sched.num_fed))
        assert not sched.num_fed, "a chained step's rows are sampled blind, deferred"
        logits = step.logits
        for request, first, count, start in rows.prompt_rows:
            next_ids = torch.tensor(request.prompt_token_ids[start + 1:start + 1 + count])
            num_top = request.sampling_params.prompt_logprobs
            assert num_top is not None  # plan_logit_rows plans prompt rows only for these
            out.prompt_logprobs[request.request_id] = compute_prompt_logprobs(
                logits[first:first + count], next_ids, num_top, include_first=start == 0)
        if rows.sample_rows:
            self._sample(logits, rows.sample_rows, out, step.greedy)
        if rows.verify_requests:
            accepted = verify_drafts(logits[rows.verify_rows], rows.verify_requests, draft_probs or {},
                                     self.vocab_size, self.device, self.sampler.generator)
            for request, token_ids in zip(rows.verify_requests, accepted):
                out.sampled[request.request_id] = token_ids
        return out

    def _samples_blind(self, rows: LogitRows, num_rows: int, num_fed: int) -> bool:
        """Whether each of a step's logits rows is one request's sample, in order, drawn on the
        device from the logits alone (``samples_blind``): a step whose tokens may stay on the
        device for a while. The first ``num_fed`` requests have one output token the host does
        not know yet (a chained step's)."""
        if rows.prompt_rows or rows.verify_requests or len(rows.sample_rows) != num_rows:
            return False
        eos = self.eos_token_ids
        return all(row == i and samples_blind(r.sampling_params, r.num_output_tokens + (i < num_fed), eos)
                   for i, (r, row) in enumerate(rows.sample_rows))

    def _blind_tokens(self, step: StepLogits, requests: list[Request], num_fed: int) -> torch.Tensor:
        """The tokens of ``_samples_blind`` rows on the device (-1: no finite maximum): a greedy
        batch's argmax (the decode graph's own), else the sampler's draw, with each seeded row's
        generator keyed by its output position as ``_sample`` keys it."""
        if all(r.sampling_params.is_greedy for r in requests):
            return step.greedy if step.greedy is not None else greedy_tokens(step.logits)
        metadata = SamplingMetadata.from_requests(
            [r.sampling_params for r in requests],
            [range(r.num_output_tokens + (i < num_fed)) for i, r in enumerate(requests)],  # only their number
            [r.prompt_token_ids for r in requests], [r.generator for r in requests],
            self.vocab_size, self.device, eos_token_ids=self.eos_token_ids,
            request_ids=[r.request_id for r in requests])
        return self.sampler.sample_blind(step.logits, metadata)

    def _forward(self, seqs: list[ScheduledSeq], input_ids: torch.Tensor | None = None) -> StepLogits | None:
        """The step's logits rows (None when it has none): a replayed graph for a decode step
        that fits one (with its greedy tokens), else the eager forward. ``input_ids`` (on the
        device) replace the first sequences' tokens (a chained step's fed rows)."""
        if self.decode_graphs.can_run(seqs):
            return self.decode_graphs.run(seqs, input_ids)
        model_input = build_model_input(seqs, self.block_size, self.device)
        if input_ids is not None:
            model_input.input_ids[:len(input_ids)] = input_ids
        hidden = self.model.forward(model_input.input_ids, model_input.positions,
                                    model_input.attn, self.kv_cache)
        wanted = model_input.logits_indices
        if wanted.shape[0] == 0:
            return None
        # as many logits rows as tokens: they are all the rows, in order (no gather)
        return StepLogits(self.model.compute_logits(hidden if wanted.shape[0] == hidden.shape[0]
                                                    else hidden[wanted]))

    def _sample(self, logits: torch.Tensor, rows: list[tuple[Request, int]],
                out: RunnerOutput, greedy: torch.Tensor | None = None) -> None:
        requests = [r for r, _ in rows]
        row_ids = [row for _, row in rows]
        # every row in order (a decode batch): the logits as they are, no gather
        in_order = row_ids == list(range(logits.shape[0]))
        row_logits = logits if in_order else logits[row_ids]
        if all(takes_argmax(r.sampling_params, r.output_token_ids, self.eos_token_ids) for r in requests):
            # plain greedy rows: the argmax, without building metadata (a batch-1 decode step's
            # sampling was ~0.1 ms of it), from the decode graph where it ran (one copy, no
            # launch); a non-finite row takes the full path, which names it
            if greedy is not None and in_order:
                token_ids = tokens_or_none(greedy)
            else:
                token_ids = self._argmax_rows(row_logits)
            if token_ids is not None:
                for request, token_id in zip(requests, token_ids):
                    out.sampled[request.request_id] = [token_id]
                return
        # structured outputs: each matcher catches up on the request's tokens, then fills its
        # row of the grammar mask on the CPU (on CUDA the forward is still running)
        for request in requests:
            request.matcher.sync(request.output_token_ids)
        grammar_mask = build_grammar_mask([(r.matcher, ()) for r in requests], self.vocab_size, self.device)
        metadata = SamplingMetadata.from_requests(
            [r.sampling_params for r in requests],
            [r.output_token_ids for r in requests],
            [r.prompt_token_ids for r in requests],
            [r.generator for r in requests],
            self.vocab_size, self.device,
            eos_token_ids=self.eos_token_ids,
            request_ids=[r.request_id for r in requests],
            grammar_mask=grammar_mask)
        sampler_out = self.sampler(row_logits, metadata)
        token_ids = sampler_out.sampled_token_ids.tolist()
        logprobs = (sampler_out.logprobs.tolists(metadata.num_logprobs)
                    if sampler_out.logprobs is not None else [None] * len(rows))
        for request, token_id, entry in zip(requests, token_ids, logprobs):
            out.sampled[request.request_id] = [token_id]
            if entry is not None:
                out.logprobs[request.request_id] = [entry]

"""EngineCore: add / abort requests and advance them one step at a time. No I/O."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import torch

from engine.config import ConfigError, EngineConfig, Role
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.events import KVCacheEvent, Tier
from engine.kv_cache.hashing import BlockHash, hash_request_blocks
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.tiers.build import build_host_tier
from engine.kv_cache.tiers.lower_tier import LowerTier
from engine.kv_cache.tiers.protocol import NoHostTier
from engine.models.loader import LoadedModel
from engine.request import Request, RequestStatus
from engine.runner.deferred import DeferredTokens
from engine.runner.model_runner import ModelRunner
from engine.runner.output import RunnerOutput
from engine.sampling.metadata import samples_blind
from engine.sampling_params import SamplingParams
from engine.scheduler.output import RequestOutput, SchedulerOutput
from engine.scheduler.scheduler import Scheduler
from engine.spec_decode.decoder import build_spec_decoder
from engine.stats import EngineStats, RemoteReservation, Sendable, TierStats
from engine.step_timer import EventPair, StepTimer
from engine.structured.compiler import ConstraintCompiler

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, lower_tier: LowerTier | None = None) -> None:
        """An engine for ``loaded`` that serves ``config.model``: the loaded model's config,
        where only ``max_model_len`` may differ (``EngineArgs.max_model_len``).
        Raises ConfigError when any other field differs. ``lower_tier`` (a kvstore client) is
        offered the blocks the host tier evicts and asked, at admission, for the chain after a
        host hit (``engine/kv_cache/tiers/lower_stage.py``); it needs the host tier (else unused)."""
        if dataclasses.replace(config.model, max_model_len=loaded.config.max_model_len) != loaded.config:
            raise ConfigError(f"EngineConfig.model is not the loaded model's config (only "
                              f"max_model_len may differ): {config.model} vs {loaded.config}")
        loaded = dataclasses.replace(loaded, config=config.model)
        self.config = config
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.runner = ModelRunner(config, loaded)
        self.block_pool = BlockPool(self.runner.num_blocks, config.cache.enable_prefix_caching,
                                    enable_events=config.cache.enable_kv_events)
        self.kv_manager = KVCacheManager(self.block_pool, config.cache.block_size)
        self.host_tier = build_host_tier(config.cache, self.runner.kv_cache, self.block_pool,
                                         config.scheduler.max_num_batched_tokens, lower_tier)
        self._lower_tier = None if isinstance(self.host_tier, NoHostTier) else lower_tier
        self.spec = build_spec_decoder(config.spec, self.runner, config.cache)
        self._samples: dict[str, list[str]] = {}  # request id -> its unfinished sample ids
        # structured outputs: thread-safe, so services may compile on their own threads first
        self.constraints = ConstraintCompiler(self.tokenizer, loaded.config.vocab_size,
                                              loaded.config.eos_token_ids)
        self.scheduler = Scheduler(config.scheduler, loaded.config, self.kv_manager,
                                   config.cache.block_size, config.cache.enable_prefix_caching,
                                   self.host_tier)
        self.async_scheduling = uses_async_scheduling(config)
        log.info("async scheduling %s (--async-scheduling %s)", "on" if self.async_scheduling else "off",
                 config.async_scheduling)
        self._in_flight: _Launched | None = None  # a chained step launched and not booked
        self.num_chained_steps = 0
        self.num_chained_admissions = 0  # queued requests that joined a chained step
        self.num_steps = 0  # forwards launched (chained ones included)
        self.num_step_rows = 0  # requests in them, summed
        self.step_timer = StepTimer(self.runner.device)  # the device's time per step, when enabled

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, resumed_output_token_ids: Sequence[int] = ()) -> list[str]:
        """Validate and queue a request. Raises ValueError naming what is wrong.

        Returns the ids of its samples: ``[request_id]``, or ``"<request_id>/<i>"`` for
        i < n when n > 1 (sample i is seeded with seed + i; samples 1.. share sample 0's
        prompt blocks).

        ``resumed_output_token_ids`` (n=1 only): output tokens another engine already produced
        for this request (a migration after a worker died). The request starts as if preempted
        after them: their KV is computed with the prompt's, and the next token is output
        position ``len(resumed_output_token_ids)``, so max_tokens, min_tokens, penalties and a
        seeded generator (keyed by output position) continue exactly where they stopped."""
        params = self._validate(prompt_token_ids, params)
        if resumed_output_token_ids:
            self._validate_resumed(list(resumed_output_token_ids), params)
        if request_id in self._samples:
            raise ValueError(f"request id {request_id!r} is already in use")
        constraint = self.constraints.compile(params.structured_outputs)  # StructuredOutputError
        sample_ids = [request_id] if params.n == 1 else [f"{request_id}/{i}" for i in range(params.n)]
        requests = []
        for index, sample_id in enumerate(sample_ids):
            sample_params = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + index)
            generator = None
            if sample_params.seed is not None:
                generator = torch.Generator(device=self.runner.device)
            requests.append(Request(
                sample_id, prompt_token_ids, sample_params, self.model_config.eos_token_ids,
                generator, parent_id=request_id if params.n > 1 else None, index=index,
                matcher=constraint.matcher(sample_params, self.model_config.eos_token_ids, sample_id)))
        requests[0].output_token_ids.extend(resumed_output_token_ids)
        self.scheduler.add_request(requests[0])
        for request in requests[1:]:
            self.scheduler.add_request(request, fork_from=requests[0].request_id)
        self._samples[request_id] = list(sample_ids)  # the caller keeps its own list
        return sample_ids

    def prefetch_prefix(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Start the lower tier's lookup of the prompt's blocks ahead of its admission
        (``LowerTier.prefetch``), so that admitting it (or reserving for it) on the engine thread
        finds the answer instead of waiting a round trip for it. Any thread: it reads nothing
        the engine thread writes. Bad input is left for ``add_request`` to name."""
        tier = self._lower_tier
        if tier is None:
            return
        try:
            hashes = hash_request_blocks(prompt_token_ids, self.config.cache.block_size,
                                         params.block_hash_extra_keys)
        except (TypeError, ValueError):
            return
        tier.prefetch(hashes)

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        if not prompt_token_ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab_size = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
        if bad:
            raise ValueError(f"prompt token ids out of vocabulary [0, {vocab_size}): {bad[:8]}")
        params.validate(vocab_size, self.model_config.max_model_len, len(prompt_token_ids))
        if params.bad_words and params.bad_words_token_ids is None:
            params = params.with_bad_words_tokenized(self.tokenizer.encode)
        return params

    def _validate_resumed(self, token_ids: list[int], params: SamplingParams) -> None:
        vocab_size = self.model_config.vocab_size
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
        if bad:
            raise ValueError(f"resumed output token ids out of vocabulary [0, {vocab_size}): {bad[:8]}")
        if params.n != 1 or params.prompt_logprobs is not None:
            raise ValueError("a resumed request takes n=1 and no prompt_logprobs (they were "
                             f"sent before it moved); got n={params.n}, "
                             f"prompt_logprobs={params.prompt_logprobs}")
        if params.max_tokens is not None and len(token_ids) >= params.max_tokens:
            raise ValueError(f"{len(token_ids)} resumed output tokens leave nothing to generate "
                             f"under max_tokens {params.max_tokens}")

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Abort a request (all its samples). Unknown or finished ids are ignored."""
        sample_ids = self._samples.pop(request_id, [])
        for sample_id in sample_ids:
            self.spec.remove(sample_id)
        outputs = [self.scheduler.abort_request(i) for i in sample_ids]
        return [o for o in outputs if o is not None]

    def finish_request(self, sample_id: str) -> RequestOutput | None:
        """Stop a sample that its caller decided is done (a stop string matched)."""
        output = self.scheduler.finish_request(sample_id, RequestStatus.FINISHED_STOPPED)
        if output is not None:
            self._forget_sample(output)
        return output

    def step(self) -> list[RequestOutput]:
        """Schedule -> execute -> update. Returns each touched request's new tokens.

        With async scheduling, a decode step whose rows are sampled on the device from the logits
        alone (greedy or random, no logprobs, penalties or grammar) is followed on the device by
        the next decode step, chained before this one is booked (``engine/scheduler/chained.py``):
        ``step`` then returns this step's tokens while the next one runs, and the next call books
        that one (and chains another) instead of scheduling afresh."""
        if not self.async_scheduling:
            sched = self._schedule()
            if sched.is_empty:
                return []
            done = self._launch(sched, defer=False)
            assert isinstance(done.result, RunnerOutput)
            self.step_timer.book(done.timing)
            return self._update(sched, done.result)
        launched, self._in_flight = self._in_flight, None
        if launched is None:
            sched = self._schedule()
            if sched.is_empty:
                return []
            self.scheduler.unbooked.launched(sched)
            launched = self._launch(sched, defer=True)
        if isinstance(launched.result, DeferredTokens):
            chained = self.scheduler.schedule_chained(launched.sched, self._samples_blind)
            if chained is not None:
                self.host_tier.flush()
                self.scheduler.unbooked.launched(chained)
                self._in_flight = self._launch(chained, defer=True, chain=launched.result)
                self.num_chained_steps += 1
                self.num_chained_admissions += len(chained.scheduled) - chained.num_fed
        result = launched.result
        if isinstance(result, DeferredTokens):
            result = result.output()
            self._observe_prefill(launched.sched, launched.started)  # launch to tokens on the host
        self.step_timer.book(launched.timing)
        self.scheduler.unbooked.booking()
        return self._update(launched.sched, result)

    def _launch(self, sched: SchedulerOutput, defer: bool, chain: DeferredTokens | None = None) -> _Launched:
        """The forward (with the drafts' verification) over the scheduled requests' blocks;
        with ``defer``, the tokens of a step sampled on the device may still be on their way
        (``ModelRunner.launch``). A step of at least a block's worth of tokens is
        prefill-dominated: its rate feeds the recompute estimate of the host tier's load
        decisions."""
        block_ids = {r.request_id: self.kv_manager.block_table(r.request_id) for r in sched.scheduled}
        draft_probs = self.spec.fill(sched, block_ids)
        started = time.perf_counter()
        timing = self.step_timer.start()
        result = self.runner.launch(sched, block_ids, draft_probs, defer, chain)
        self.step_timer.stop(timing)
        self.num_steps += 1
        self.num_step_rows += len(sched.scheduled)
        if isinstance(result, RunnerOutput):
            self._observe_prefill(sched, started)
        return _Launched(sched, result, started, timing)

    def _observe_prefill(self, sched: SchedulerOutput, started: float) -> None:
        num_tokens = sched.total_num_scheduled_tokens
        if num_tokens >= self.config.cache.block_size and not sched.num_fed:
            self.host_tier.observe_prefill(num_tokens, time.perf_counter() - started)

    def _samples_blind(self, request: Request, num_unseen: int) -> bool:
        return samples_blind(request.sampling_params, request.num_output_tokens + num_unseen,
                             self.model_config.eos_token_ids)

    def _schedule(self) -> SchedulerOutput:
        """Drafts are proposed first (the schedule counts them in the token budget); the host
        tier then copies down, during the forward, what the next step will evict."""
        self.spec.plan(self.scheduler.running, self.model_config.max_model_len)
        sched = self.scheduler.schedule()
        self.host_tier.flush()
        return sched

    def _update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        """Token accounting, then the finished samples are forgotten."""
        self.spec.record(sched, result.sampled)
        outputs = self.scheduler.update(sched, result.sampled, result.logprobs, result.prompt_logprobs)
        for output in outputs:
            if output.finished:
                self._forget_sample(output)
        return outputs

    def _forget_sample(self, output: RequestOutput) -> None:
        self.spec.remove(output.request_id)
        request_id = output.parent_id or output.request_id
        sample_ids = self._samples.get(request_id)
        if sample_ids is not None and output.request_id in sample_ids:
            sample_ids.remove(output.request_id)
            if not sample_ids:
                del self._samples[request_id]

    def has_unfinished_requests(self) -> bool:
        """Requests to serve, or a chained step to book (its requests may all have finished)."""
        return self._in_flight is not None or self.scheduler.has_unfinished_requests()

    # ---- disaggregation hooks (services/prefill, services/decode) -------------------

    def reserve_remote(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> RemoteReservation | None:
        """DECODE role: validate the request and reserve blocks for its prompt's KV, which a
        prefill worker will write (all but the leading blocks this worker already has cached).
        Returns the reservation, or None when the pool is full."""
        params = self._validate(prompt_token_ids, params)
        if params.n != 1:
            raise ValueError("a disaggregated request carries one sample (n=1) per decode request")
        generator = torch.Generator(device=self.runner.device) if params.seed is not None else None
        constraint = self.constraints.compile(params.structured_outputs)  # StructuredOutputError
        request = Request(request_id, prompt_token_ids, params, self.model_config.eos_token_ids,
                          generator, matcher=constraint.matcher(params, self.model_config.eos_token_ids, request_id))
        block_ids = self.scheduler.reserve_remote(request)
        self.host_tier.flush()  # copy down early what the next allocations will evict
        if block_ids is None:
            return None
        self._samples[request_id] = [request_id]
        return RemoteReservation(block_ids, request.num_cached_tokens // self.config.cache.block_size)

    def finish_remote_kv(self, request_id: str, first_token_id: int) -> RequestOutput | None:
        """DECODE role: the reserved blocks hold the prompt's KV; decode from ``first_token_id``.
        Returns the finished output when that token already ends the request (else None)."""
        output = self.scheduler.finish_remote_kv(request_id, first_token_id)
        if output is not None:
            self._forget_sample(output)
        return output

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.kv_manager.get_block_ids(request_id)

    def sendable(self, request_id: str) -> Sendable | None:
        """PREFILL role: the KV of ``request_id`` that exists now (running, or finished and
        held for sending); None once it is gone. Reads without pausing the engine (one dict
        lookup, ints and a list copy), so another thread gets a consistent-enough view."""
        request = self.scheduler.requests.get(request_id) or self.scheduler.held.get(request_id)
        if request is None:
            return None
        return Sendable(self.kv_manager.get_block_ids(request_id), request.num_computed_tokens,
                        request.num_preemptions > 0)

    def release_held(self, request_id: str) -> None:
        """PREFILL role: the finished request's blocks were sent; free (and keep cached) them."""
        self.scheduler.release_held(request_id)

    def drop(self, request_id: str) -> None:
        """Free what ``request_id`` holds: its held blocks when it finished (PREFILL role),
        else abort it. Unknown ids are ignored."""
        if request_id in self.scheduler.held:
            self.release_held(request_id)
        else:
            self.abort_request(request_id)

    @property
    def kv_cache(self) -> torch.Tensor:
        """The KV cache tensor (``engine.kv_cache.storage`` layout), for KV connectors to register."""
        return self.runner.kv_cache

    def stats(self) -> EngineStats:
        """Load and pool sizes. Reads without pausing the engine: each number is one atomic read
        or a list copy under the GIL, so a snapshot taken from another thread may mix two steps
        but never raises."""
        requests = list(self.scheduler.requests.values())
        outstanding = sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in requests
                          if r.status != RequestStatus.WAITING_FOR_REMOTE_KV)
        return EngineStats(self.block_pool.num_free_blocks, self.runner.num_blocks,
                           self.config.cache.block_size, len(self.scheduler.running),
                           len(self.scheduler.waiting), outstanding, self._tier_stats(),
                           self.scheduler.num_preemptions, self.num_chained_steps)

    def _tier_stats(self) -> tuple[TierStats, ...]:
        pool = self.block_pool
        device = TierStats.of(Tier.DEVICE, pool.num_blocks, pool.num_cached_blocks,
                              pool.num_stored_blocks, pool.num_evicted_blocks, self.scheduler.device_counters)
        return (device, *self.host_tier.tier_stats())

    def cached_block_hashes(self) -> list[tuple[BlockHash, Tier]]:
        """What this worker holds now, for a prefix-index snapshot: one (hash, tier) per block
        and tier holding it (a block on device and host appears twice). Call it on the engine
        thread between steps, right after draining ``take_kv_events``: the snapshot then equals
        the state those events led to, and the next drained events continue from it."""
        holdings = [(h, Tier.DEVICE) for h in self.block_pool.cached_block_hashes()]
        holdings += [(h, Tier.HOST) for h in self.host_tier.cached_block_hashes()]
        return holdings

    def reset_prefix_cache(self) -> None:
        """Forget every cached block on every tier (running requests keep their blocks);
        queues one AllBlocksCleared(None): every tier."""
        self.host_tier.clear(emit=False)
        self.kv_manager.reset_prefix_cache()

    def spec_stats(self) -> dict[str, object] | None:
        """Speculation statistics (proposed / accepted per position), None when it is off."""
        return self.spec.stats()

    def take_kv_events(self) -> list[KVCacheEvent]:
        """Drain BlockStored/BlockRemoved events (only queued with cache.enable_kv_events)."""
        return self.kv_manager.take_events()

    def kv_holdings(self) -> dict[BlockHash, Tier]:
        """Every block hash this engine's prefix cache holds now, with the tiers holding it: the
        state that ``take_kv_events`` reports as changes (a prefix-index snapshot). Call on the
        engine thread."""
        holdings: dict[BlockHash, Tier] = {}
        for block_hash, tier in self.cached_block_hashes():
            holdings[block_hash] = holdings.get(block_hash, Tier(0)) | tier
        return holdings

    def close(self) -> None:
        """Finish the block copies in flight and stop the copier thread (idempotent); the engine
        is not stepped afterwards."""
        self.host_tier.close()
        self.constraints.close()

    def check_integrity(self) -> None:
        """Raise RuntimeError if the block pool, the block tables or the host tier are inconsistent."""
        self.kv_manager.check_integrity()
        self.host_tier.check_integrity()


@dataclasses.dataclass(slots=True)
class _Launched:
    sched: SchedulerOutput
    result: RunnerOutput | DeferredTokens
    started: float  # perf_counter at launch
    timing: EventPair | None = None  # StepTimer's events around the launch


def uses_async_scheduling(config: EngineConfig) -> bool:
    """``config.async_scheduling`` resolved: 'auto' is on for a CUDA engine. Never for a
    prefill engine (its requests end at their first token) or with speculation (a step with
    drafts needs the host to have the tokens before it)."""
    if config.scheduler.role == Role.PREFILL or config.spec.method is not None:
        return False
    if config.async_scheduling == "auto":
        return torch.device(config.device).type == "cuda"
    return config.async_scheduling == "on"

"""One token-accounting scheduler (vLLM v1 style), for every role.

Each step, running requests go first (decode tokens with their draft tokens, then the next
prefill chunks), then waiting requests fill what is left of the token budget. There is no
prefill or decode phase: a request is scheduled ``num_tokens_with_spec - num_computed_tokens``
tokens, capped by the budget. When the KV pool runs out, the newest running request is
preempted by recompute: its blocks are freed and it goes back to the front of the waiting
queue with all its tokens, to be recomputed later (its request-local RNG state is kept, so a
seeded request gives the same tokens). A request queued with KV that landed from a prefill
worker gives its blocks up before the last running request would preempt itself.

The role changes only admission and stopping: PREFILL stops after the first token and keeps
its blocks until the caller releases them (they are being sent); DECODE admits requests
whose KV arrives from elsewhere (WAITING_FOR_REMOTE_KV) once it has landed.

Admission reuses the longest cached prefix: device blocks first, then the lower tiers'
continuation of the hash chain, loaded off the step loop while the request waits
(WAITING_FOR_HOST_KV): ``prefix_loads.py``. Parallel samples fork from their first sample once
its prompt is computed (``forks.py``); the stop rules are ``stop.py``'s.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.config import ModelConfig, Role, SchedulerConfig
from engine.kv_cache.block_pool import KVBlock
from engine.kv_cache.hashing import extend_block_hashes
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.tiers.protocol import HostTierProtocol, NoHostTier
from engine.request import Request, RequestStatus
from engine.scheduler.chained import UnbookedSteps, schedule_chained
from engine.scheduler.forks import PendingForks
from engine.scheduler.output import RequestOutput, SchedulerOutput
from engine.scheduler.prefix_loads import PrefixLoads
from engine.scheduler.stop import StopRules
from engine.stats import TierCounters

if TYPE_CHECKING:
    from engine.sampling.logprobs import PositionLogprobs

WAITING_FOR_KV = (RequestStatus.WAITING_FOR_REMOTE_KV, RequestStatus.WAITING_FOR_HOST_KV)


class Scheduler:
    def __init__(self, config: SchedulerConfig, model_config: ModelConfig,
                 kv_manager: KVCacheManager, block_size: int,
                 enable_prefix_caching: bool = True,
                 host_tier: HostTierProtocol | None = None) -> None:
        self.config = config
        self.max_model_len = model_config.max_model_len
        self.kv_manager = kv_manager
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.held: dict[str, Request] = {}  # PREFILL: finished, blocks kept until released
        self.forks = PendingForks()  # n > 1: samples waiting to share sample 0's prompt blocks
        self.num_preemptions = 0
        self.prefix = PrefixLoads(kv_manager, host_tier if host_tier is not None else NoHostTier(),
                                  block_size, enable_prefix_caching)
        self.stop = StopRules(self.max_model_len, config.role)
        self.unbooked = UnbookedSteps(kv_manager)  # async scheduling: launched, not booked yet

    @property
    def device_counters(self) -> TierCounters:
        """The device tier's hits and misses at admission."""
        return self.prefix.device_counters

    def has_unfinished_requests(self) -> bool:
        """Requests to serve, or loads in flight whose blocks come back once booked."""
        return bool(self.requests) or self.prefix.has_loads_in_flight

    # ---- admission -------------------------------------------------------------------

    def add_request(self, request: Request, fork_from: str | None = None) -> None:
        """Queue ``request``; with ``fork_from``, it is a parallel sample of that (queued)
        request and starts from its prompt's blocks."""
        if request.request_id in self.requests or request.request_id in self.held:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if fork_from is not None and fork_from not in self.requests:
            raise ValueError(
                f"cannot fork {request.request_id!r} from unknown request {fork_from!r}")
        self._check_fits(request)
        self._update_block_hashes(request)
        self.requests[request.request_id] = request
        if fork_from is not None:
            self.forks.add(fork_from, request)
        else:
            self.waiting.append(request)

    def _check_fits(self, request: Request) -> None:
        """Raise ValueError if the request could not finish even with the whole cache to itself
        (it would preempt itself forever)."""
        num_prompt, params = request.num_prompt_tokens, request.sampling_params
        max_len = num_prompt + params.resolve_max_tokens(num_prompt, self.max_model_len)
        if not self.kv_manager.can_fit(max(max_len, request.num_tokens)):
            limit = (f"max_tokens {params.max_tokens}" if params.max_tokens is not None
                     else f"max_tokens None: up to the context length {self.max_model_len}")
            raise ValueError(
                f"request {request.request_id!r} needs KV for up to {max_len} tokens (prompt "
                f"{num_prompt} + {limit}), more than the whole cache holds "
                f"({self.kv_manager.block_pool.num_blocks} blocks of {self.block_size} tokens); "
                f"lower max_tokens or the prompt length, or give the cache more memory")

    def _update_block_hashes(self, request: Request) -> None:
        """Extend the request's chained block hashes to cover its full blocks."""
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            extend_block_hashes(request.block_hashes, request.token_view, self.block_size,
                                request.sampling_params.block_hash_extra_keys)

    def reserve_remote(self, request: Request) -> list[int] | None:
        """DECODE: hold blocks for a prompt whose KV another worker computes and sends.
        Returns the prompt's block table, or None (nothing changed) when it does not fit.

        The table's leading blocks may come from this worker's prefix cache (a hit, as for a
        local prompt): ``request.num_cached_tokens`` says how many prompt tokens they cover
        (a whole number of blocks), and the sender writes only the blocks after them."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._check_fits(request)
        self._update_block_hashes(request)
        hit = self.prefix.find_for_reservation(request)
        if self.kv_manager.allocate_slots(request.request_id, request.num_prompt_tokens,
                                          hit.device_blocks, hit.num_tokens) is None:
            self.prefix.release(hit)
            return None
        request.num_cached_tokens = self.prefix.load_now(request, hit)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        self.waiting.append(request)
        return self.kv_manager.get_block_ids(request.request_id)

    def finish_remote_kv(self, request_id: str, first_token_id: int) -> RequestOutput | None:
        """DECODE: the prompt's KV has landed; ``first_token_id`` was sampled by the prefill
        worker. The request joins the batch at the next step, or, when that token already
        ends it (EOS, a stop token, max_tokens=1), finishes now: the finished output is
        returned and its blocks are freed."""
        request = self.requests.get(request_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            raise ValueError(f"request {request_id!r} is not waiting for remote KV")
        request.num_computed_tokens = request.num_prompt_tokens
        request.output_token_ids.append(first_token_id)
        request.status = RequestStatus.WAITING
        self._update_block_hashes(request)
        status = self.stop.status(request, first_token_id)
        return None if status is None else self._finish(request, status)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        if request_id in self.held:
            self.release_held(request_id)
            return None
        request = self.requests.get(request_id)
        if request is None:
            return None
        return self._finish(request, RequestStatus.FINISHED_ABORTED)

    def release_held(self, request_id: str) -> None:
        """PREFILL: the blocks of a finished request have been sent; free (or cache) them."""
        request = self.held.pop(request_id)
        self.kv_manager.free(request.request_id)

    # ---- schedule --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """This step's requests and tokens. Books the prefix loads that landed first; when
        nothing could be scheduled but a load is in flight, waits for it (rather than have the
        caller spin through empty steps) and tries again."""
        self.prefix.settle()
        out = self._schedule_pass()
        if out.is_empty and not out.preempted_ids and self.prefix.wait_for_oldest():
            out = self._schedule_pass()
        return out

    def schedule_chained(self, prev: SchedulerOutput,
                         samples_blind: Callable[[Request, int], bool]) -> SchedulerOutput | None:
        """The decode step after ``prev``, before ``prev`` is booked, or None (``chained.py``)."""
        return schedule_chained(self, prev, samples_blind, self._admit_waiting)

    def _schedule_pass(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out)
        self._admit_waiting(out, budget)
        self.waiting.extendleft(reversed(self.forks.plan(out, self._num_free_seats)))
        out.copy_ops = self.kv_manager.take_copy_ops()
        return out

    def _schedule_running(self, out: SchedulerOutput) -> int:
        """Decodes (with their drafts) first, then prefill chunks, each in arrival order: a long
        prompt gets only what the token streams leave of the budget. Returns what is left."""
        budget = self.config.max_num_batched_tokens
        for request in sorted(self.running, key=self._is_prefilling):
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                continue
            scheduled = self._allocate_or_preempt(request, num_new, out)
            if out.preempted_ids:  # the preempted gave back what they had been scheduled
                budget = self.config.max_num_batched_tokens - sum(out.num_scheduled_tokens.values())
            if scheduled:
                out.scheduled.append(request)
                out.num_scheduled_tokens[request.request_id] = num_new
                budget -= num_new
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Queued requests, in order, while the budget and the seats last and they fit."""
        for request in list(self.waiting):
            if budget <= 0 or out.preempted_ids or self._num_seats_taken() >= self.config.max_num_seqs:
                break
            if request.status in WAITING_FOR_KV:
                continue
            admitted = self._admit_queued(request, budget)
            if request.status == RequestStatus.WAITING_FOR_HOST_KV:
                continue  # its prefix is loading; the next ones may go on
            if admitted is None:
                break
            num_computed, num_new = admitted
            self.waiting.remove(request)
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_computed
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(request)
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Blocks for ``num_new`` more tokens of running ``request``. While there are none,
        the newest running request is preempted (when that is ``request`` itself, a queued
        request's landed KV is evicted first if there is one). False if ``request`` was
        preempted; the preempted are in ``out.preempted_ids``."""
        while self.kv_manager.allocate_slots(
                request.request_id, request.num_computed_tokens + num_new,
                num_computed_tokens=request.num_computed_tokens) is None:
            if self.running[-1] is request and self._evict_queued_kv(request):
                continue  # rather than preempting itself
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _admit_queued(self, request: Request, budget: int) -> tuple[int, int] | None:
        """Blocks for a queued request: its cached prefix and this step's tokens. Returns
        (computed tokens, tokens to schedule), or None when they do not fit (nothing changed)
        or its prefix is loading (it is left WAITING_FOR_HOST_KV, holding its blocks)."""
        hit = self.prefix.find(request)
        num_new = min(request.num_tokens - hit.num_tokens, budget, self._chunk_cap())
        num_allocated = hit.num_tokens + num_new
        if not self._allocate_queued(request, num_allocated, hit.device_blocks, hit.num_tokens):
            self.prefix.release(hit)
            return None
        num_computed = self.prefix.admit(request, hit)
        if num_computed is None:
            return None
        # A short load recomputes what it missed, within this step's budget and blocks.
        return num_computed, min(request.num_tokens - num_computed, budget, self._chunk_cap(),
                                 num_allocated - num_computed)

    def _allocate_queued(self, request: Request, num_total_tokens: int,
                         computed_blocks: list[KVBlock], num_computed: int) -> bool:
        """Blocks for a queued request to be admitted. When there are none and nothing runs
        that would free some, requests queued behind it with landed KV give theirs up."""
        while self.kv_manager.allocate_slots(request.request_id, num_total_tokens,
                                              computed_blocks, num_computed) is None:
            if self.running or not self._evict_queued_kv(request):
                return False
        return True

    def _evict_queued_kv(self, keep: Request) -> bool:
        """Free the blocks of the newest queued request whose KV landed from a prefill worker
        (it waits for a seat), to be recomputed, so that ``keep`` can go on: otherwise such
        requests could hold, for ever, the blocks the only runnable request needs. Returns
        False when there is none."""
        for request in reversed(self.waiting):
            if (request is not keep and request.status == RequestStatus.WAITING
                    and request.num_computed_tokens > 0):
                self.kv_manager.free(request.request_id)
                request.reset_for_recompute()
                self.num_preemptions += 1
                return True
        return False

    def _num_seats_taken(self) -> int:
        """Running requests, those whose prefix loads, and the samples that will fork from
        running ones."""
        return len(self.running) + self.prefix.num_loading + self.forks.num_waiting_on(
            lambda parent_id: self.requests[parent_id].status == RequestStatus.RUNNING)

    def _num_free_seats(self) -> int:
        return self.config.max_num_seqs - self._num_seats_taken()

    def _chunk_cap(self) -> int:
        return self.config.long_prefill_token_threshold or self.config.max_num_batched_tokens

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        num_new = request.num_tokens_with_spec - request.num_computed_tokens
        num_new = min(num_new, budget, self.max_model_len - request.num_computed_tokens)
        if self._is_prefilling(request):
            num_new = min(num_new, self._chunk_cap())
        return max(num_new, 0)

    @staticmethod
    def _is_prefilling(request: Request) -> bool:
        return request.num_tokens - request.num_computed_tokens > 1

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Free the request's blocks and queue it first for recompute; it leaves this step's
        schedule if it was in it."""
        self.kv_manager.free(request.request_id)
        request.reset_for_recompute()
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted_ids.append(request.request_id)
        if request in out.scheduled:
            out.scheduled.remove(request)
        out.num_scheduled_tokens.pop(request.request_id, None)

    # ---- update ----------------------------------------------------------------------

    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]],
               logprobs: dict[str, list[PositionLogprobs]] | None = None,
               prompt_logprobs: dict[str, list[PositionLogprobs | None]] | None = None
               ) -> list[RequestOutput]:
        """Advance token accounting after a step. ``sampled[request_id]`` holds the tokens
        accepted this step (one, or accepted drafts + recovered/bonus); requests still
        prefilling have none."""
        outputs = []
        logprobs, prompt_logprobs = logprobs or {}, prompt_logprobs or {}
        for request in self.forks.with_forks(out, self.kv_manager, self.running):
            if request.is_finished:  # aborted while the step ran
                continue
            num_scheduled = out.num_scheduled_tokens[request.request_id]
            num_drafts = len(request.spec_token_ids)
            new_token_ids = sampled.get(request.request_id, [])
            if num_drafts:
                # Drafts that were rejected have no valid KV: roll the table back.
                num_rejected = num_drafts + 1 - len(new_token_ids)
                request.num_computed_tokens += num_scheduled - num_rejected
                request.spec_token_ids = []
                self.kv_manager.truncate(request.request_id, request.num_computed_tokens)
            else:
                request.num_computed_tokens += num_scheduled
            if request.num_output_tokens == 0 and request.request_id in prompt_logprobs:
                request.prompt_logprobs = ((request.prompt_logprobs or [])
                                           + prompt_logprobs[request.request_id])
            new_token_ids = self.stop.append_until_stop(request, new_token_ids)
            if self.enable_prefix_caching:
                self._update_block_hashes(request)
                self.kv_manager.cache_blocks(request.request_id, request.block_hashes,
                                             request.num_computed_tokens, request.token_view)
            if not new_token_ids and not request.is_finished and self.config.role != Role.PREFILL:
                continue
            output = RequestOutput.of(request, new_token_ids)
            output.new_logprobs = logprobs.get(request.request_id)
            if request.num_output_tokens == len(new_token_ids):  # first tokens of this request
                output.prompt_logprobs = request.prompt_logprobs
            if request.is_finished:
                self._finish(request, request.status, output)
            outputs.append(output)
        return outputs

    def finish_request(self, request_id: str, status: RequestStatus) -> RequestOutput | None:
        """Stop a request from outside the step (a stop string matched, a transfer failed)."""
        request = self.requests.get(request_id)
        return None if request is None else self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus,
                output: RequestOutput | None = None) -> RequestOutput:
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            self.forks.drop(request)
        del self.requests[request.request_id]
        self.prefix.forget(request.request_id)
        # Samples still waiting to fork from it compute their prompt themselves.
        self.waiting.extendleft(reversed(self.forks.take(request.request_id)))
        if status == RequestStatus.FINISHED_PREFILLED:
            self.held[request.request_id] = request
        else:
            self.unbooked.hold_if_written(request.request_id)
            self.kv_manager.free(request.request_id)
        output = output or RequestOutput.of(request, [])
        output.finished = True
        output.finish_reason = status.value
        output.stop_reason = request.stop_reason
        output.error = request.error
        return output

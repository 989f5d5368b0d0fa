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

Admission reuses the longest cached prefix: device blocks first, then the host tier's
continuation of the hash chain, then the lower tier's (the node's kvstore, staged through host
slots), loaded into fresh blocks when that is estimated faster than recomputing
(``engine/kv_cache/tiers/host_tier.py``, ``engine/kv_cache/tiers/lower_stage.py``). The load runs off the
step loop: the request waits (WAITING_FOR_HOST_KV, holding its blocks, the load's targets held
against reuse) while the others step, and is admitted with the loaded blocks as computed once
the load has landed (each schedule first books finished loads); a short load recomputes from
the first block that did not load. A request aborted meanwhile gives its blocks back, the
targets only once the load has landed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import ModelConfig, Role, SchedulerConfig
from engine.kv_cache.block_pool import KVBlock
from engine.kv_cache.hashing import extend_block_hashes
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.tiers.host_pool import HostEntry
from engine.kv_cache.tiers.protocol import HostLoad, HostTierProtocol, NoHostTier
from engine.request import Request, RequestStatus
from engine.scheduler.forks import PendingForks
from engine.scheduler.output import RequestOutput, SchedulerOutput
from engine.stats import TierCounters

if TYPE_CHECKING:
    from engine.sampling.logprobs import PositionLogprobs

WAITING_FOR_KV = (RequestStatus.WAITING_FOR_REMOTE_KV, RequestStatus.WAITING_FOR_HOST_KV)


@dataclass(slots=True, eq=False)
class _PrefixLoad:
    """A queued request's host hit being loaded into its blocks (``HostTier.start_load``)."""

    request: Request
    load: HostLoad
    num_device_blocks: int  # the device hit before the loaded blocks
    num_lookup: int  # blocks the admission looked up (for the tier counters)


def _is_short(prefix_load: _PrefixLoad) -> bool:
    return prefix_load.load.num_loaded < len(prefix_load.load.entries)


class Scheduler:
    def __init__(self, config: SchedulerConfig, model_config: ModelConfig,
                 kv_manager: KVCacheManager, block_size: int,
                 enable_prefix_caching: bool = True,
                 host_tier: HostTierProtocol | None = None) -> None:
        self.config = config
        self.host_tier = host_tier if host_tier is not None else NoHostTier()
        self.device_counters = TierCounters()  # the device tier's hits and misses at admission
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
        self._loads: list[_PrefixLoad] = []  # in flight, oldest first (aborted requests' included)
        self._short_loaded: set[str] = set()  # their load came up short: recompute, no new lookup

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
        cached_blocks: list[KVBlock] = []
        host_hits: list[HostEntry] = []
        num_cached = num_lookup = 0
        if self.enable_prefix_caching:
            cached_blocks, host_hits, num_cached, num_lookup = self._lookup_prefix(request)
        if self.kv_manager.allocate_slots(request.request_id, request.num_prompt_tokens,
                                          cached_blocks, num_cached) is None:
            self.host_tier.release(host_hits)
            return None
        if host_hits:
            num_cached = self._load_host_hits(request, len(cached_blocks), host_hits)
        if self.enable_prefix_caching:
            self._record_lookup(num_lookup, len(cached_blocks), num_cached)
        request.num_cached_tokens = num_cached
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
        status = self._stop_status(request, first_token_id)
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
        self._settle_loads()
        out = self._schedule_pass()
        if out.is_empty and not out.preempted_ids and self._loads:
            self.host_tier.wait_for_load(self._loads[0].load)
            self._settle_loads()
            out = self._schedule_pass()
        return out

    def _schedule_pass(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Decodes (with their drafts) first, then prefill chunks, each in arrival order: a long
        # prompt gets only what the token streams leave of the budget.
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
            self._short_loaded.discard(request.request_id)
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_computed
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(request)
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new
        self._plan_forks(out)
        out.copy_ops = self.kv_manager.take_copy_ops()
        return out

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
        """Blocks for a queued request: its cached prefix (device blocks, then the host tier's)
        and this step's tokens. Returns (computed tokens, tokens to schedule), or None, changing
        nothing, when they do not fit. A host hit starts loading: unless the load is already
        over (a synchronous copier), the request is left WAITING_FOR_HOST_KV, holding its
        blocks, and (0, 0) is returned."""
        computed_blocks: list[KVBlock] = []
        host_hits: list[HostEntry] = []
        num_computed, num_lookup = request.num_computed_tokens, 0
        # Prompt logprobs need the logits of every prompt position: no prefix hit for them.
        is_lookup = (num_computed == 0 and self.enable_prefix_caching
                     and request.sampling_params.prompt_logprobs is None
                     and request.request_id not in self._short_loaded)
        if is_lookup:
            computed_blocks, host_hits, num_computed, num_lookup = self._lookup_prefix(request)
        num_new = min(request.num_tokens - num_computed, budget, self._chunk_cap())
        if not self._allocate_queued(request, num_computed + num_new, computed_blocks, num_computed):
            self.host_tier.release(host_hits)
            return None
        if host_hits:
            num_allocated = num_computed + num_new
            if not self._start_prefix_load(request, len(computed_blocks), host_hits, num_lookup):
                return 0, 0
            num_computed = request.num_computed_tokens
            # A short load recomputes what it missed, within this step's budget and blocks.
            num_new = min(request.num_tokens - num_computed, budget, self._chunk_cap(),
                          num_allocated - num_computed)
        elif is_lookup:
            self._record_lookup(num_lookup, len(computed_blocks), num_computed)
        return num_computed, num_new

    def _start_prefix_load(self, request: Request, num_device_blocks: int, host_hits: list[HostEntry],
                           num_lookup: int) -> bool:
        """Load the host hits into the fresh blocks after the device hit in the request's table,
        holding those blocks until the load lands. Returns True when it already has (the
        request's computed tokens are set); else the request now waits for it."""
        block_ids = self.kv_manager.get_block_ids(request.request_id)
        targets = block_ids[num_device_blocks:num_device_blocks + len(host_hits)]
        self.kv_manager.hold_blocks(targets)
        prefix_load = _PrefixLoad(request, self.host_tier.start_load(host_hits, targets),
                                  num_device_blocks, num_lookup)
        request.status = RequestStatus.WAITING_FOR_HOST_KV
        self.host_tier.poll()
        if prefix_load.load.is_settled:
            self._finish_prefix_load(prefix_load)
            return True
        self._loads.append(prefix_load)
        return False

    def _settle_loads(self) -> None:
        """Book the prefix loads that have landed."""
        if not self._loads:
            return
        self.host_tier.poll()
        landed = [p for p in self._loads if p.load.is_settled]
        self._loads = [p for p in self._loads if not p.load.is_settled]
        for prefix_load in landed:
            self._finish_prefix_load(prefix_load)
            request = prefix_load.request
            if request.status == RequestStatus.WAITING and _is_short(prefix_load):
                self._short_loaded.add(request.request_id)  # else a lookup would load it again
                if request.num_computed_tokens == 0:
                    self.kv_manager.free(request.request_id)  # nothing loaded: admitted afresh

    def _finish_prefix_load(self, prefix_load: _PrefixLoad) -> None:
        """A landed load: its targets are released, and (unless the request went meanwhile)
        the request's computed tokens run through the last block that loaded, cached there
        (Stored(DEVICE)); it is queued for admission again."""
        request, load = prefix_load.request, prefix_load.load
        self.kv_manager.release_blocks(load.block_ids)
        if request.status != RequestStatus.WAITING_FOR_HOST_KV:  # aborted or finished meanwhile
            return
        num_computed = (prefix_load.num_device_blocks + load.num_loaded) * self.block_size
        request.num_computed_tokens = num_computed
        self.kv_manager.cache_blocks(request.request_id, request.block_hashes, num_computed,
                                     request.token_view)
        self._record_lookup(prefix_load.num_lookup, prefix_load.num_device_blocks, num_computed,
                            load.num_host_run)
        request.status = RequestStatus.WAITING

    def _allocate_queued(self, request: Request, num_total_tokens: int,
                         computed_blocks: list[KVBlock], num_computed: int) -> bool:
        """Blocks for a queued request to be admitted. When there are none and nothing runs
        that would free some, requests queued behind it with landed KV give theirs up."""
        while self.kv_manager.allocate_slots(request.request_id, num_total_tokens,
                                              computed_blocks, num_computed) is None:
            if self.running or not self._evict_queued_kv(request):
                return False
        return True

    def _lookup_prefix(self, request: Request) -> tuple[list[KVBlock], list[HostEntry], int, int]:
        """The request's cached prefix: device blocks (no reference taken), then the host tier's
        continuation of the chain (pinned: load or release them), the tokens both cover, and
        how many blocks were looked up (the last token is always left to compute)."""
        computed_blocks, num_computed = self.kv_manager.get_computed_blocks(request.block_hashes,
                                                                           request.num_tokens)
        num_lookup = min(max(request.num_tokens - 1, 0) // self.block_size, len(request.block_hashes))
        start = len(computed_blocks)
        host_hits = self.host_tier.match(
            request.block_hashes[start:num_lookup], request.block_hashes[start - 1] if start else None,
            request.token_view[start * self.block_size:max(num_lookup, start) * self.block_size])
        return computed_blocks, host_hits, num_computed + len(host_hits) * self.block_size, num_lookup

    def _load_host_hits(self, request: Request, num_device_blocks: int, host_hits: list[HostEntry]) -> int:
        """A reservation's host hit, loaded before it returns (its reply states what is cached):
        copy the host tier's blocks into the fresh device blocks that follow the device hit in
        the request's table and cache them there (Stored(DEVICE)). Returns the request's computed
        tokens: through the last block that loaded (the rest is recomputed, as if never hit)."""
        block_ids = self.kv_manager.get_block_ids(request.request_id)
        targets = block_ids[num_device_blocks:num_device_blocks + len(host_hits)]
        num_loaded = self.host_tier.load(host_hits, targets)
        num_computed = (num_device_blocks + num_loaded) * self.block_size
        self.kv_manager.cache_blocks(request.request_id, request.block_hashes, num_computed,
                                     request.token_view)
        return num_computed

    def _record_lookup(self, num_lookup: int, num_device_blocks: int, num_computed: int,
                       num_host_run: int | None = None) -> None:
        """Count one admission's prefix lookup: ``num_lookup`` blocks asked of the device tier,
        what it missed asked of the host tier (``num_host_run``: see ``HostTier.record_query``)."""
        num_host_blocks = num_computed // self.block_size - num_device_blocks
        self.device_counters.num_queried_blocks += num_lookup
        self.device_counters.num_hit_blocks += num_device_blocks
        self.device_counters.num_hit_tokens += num_device_blocks * self.block_size
        self.host_tier.record_query(num_lookup - num_device_blocks, num_host_blocks, self.block_size,
                                    num_host_run)

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

    def _plan_forks(self, out: SchedulerOutput) -> None:
        """n > 1: the samples of a request whose prompt completes this step fork from it (the
        runner samples their first tokens from its last logits row), as many as there are
        seats under max_num_seqs; the others go to the front of the queue and compute the
        prompt themselves (a prefix hit on its blocks once they are cached)."""
        for request in out.scheduled:
            children = self.forks.of(request.request_id)
            num_scheduled = out.num_scheduled_tokens[request.request_id]
            if not children or request.num_computed_tokens + num_scheduled < request.num_tokens:
                continue
            num_seats = self.config.max_num_seqs - (self._num_seats_taken() - len(children))
            self.waiting.extendleft(reversed(self.forks.keep_first(request.request_id, max(num_seats, 0))))
            if children:
                out.fork_children[request.request_id] = list(children)

    def _num_seats_taken(self) -> int:
        """Running requests, those whose prefix loads, and the samples that will fork from
        running ones."""
        num_loading = sum(1 for p in self._loads if p.request.status == RequestStatus.WAITING_FOR_HOST_KV)
        return len(self.running) + num_loading + self.forks.num_waiting_on(
            lambda parent_id: self.requests[parent_id].status == RequestStatus.RUNNING)

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
        for request in self._with_forks(out):
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
            new_token_ids = self._append_until_stop(request, new_token_ids)
            if self.enable_prefix_caching:
                self._update_block_hashes(request)
                self.kv_manager.cache_blocks(request.request_id, request.block_hashes,
                                             request.num_computed_tokens, request.token_view)
            if not new_token_ids and not request.is_finished and self.config.role != Role.PREFILL:
                continue
            output = self._output(request, new_token_ids)
            output.new_logprobs = logprobs.get(request.request_id)
            if request.num_output_tokens == len(new_token_ids):  # first tokens of this request
                output.prompt_logprobs = request.prompt_logprobs
            if request.is_finished:
                self._finish(request, request.status, output)
            outputs.append(output)
        return outputs

    def _with_forks(self, out: SchedulerOutput) -> Iterator[Request]:
        """The step's requests, each followed by the samples forked from it this step. They
        fork before the parent's own update, which may finish it and free its blocks."""
        for request in out.scheduled:
            children = [] if request.is_finished else [  # aborted while the step ran
                c for c in out.fork_children.get(request.request_id, ()) if not c.is_finished]
            if children:
                self.forks.take(request.request_id)
                for child in children:
                    self.kv_manager.fork(request.request_id, child.request_id)
            yield request
            for child in children:
                child.status = RequestStatus.RUNNING
                child.num_computed_tokens = request.num_prompt_tokens
                child.num_cached_tokens = request.num_cached_tokens
                child.prompt_logprobs = request.prompt_logprobs
                out.num_scheduled_tokens[child.request_id] = 0
                self.running.append(child)
                yield child

    def _output(self, request: Request, new_token_ids: list[int]) -> RequestOutput:
        return RequestOutput(request.request_id, new_token_ids,
                             num_prompt_tokens=request.num_prompt_tokens,
                             num_cached_tokens=request.num_cached_tokens,
                             num_computed_tokens=request.num_computed_tokens,
                             parent_id=request.parent_id, index=request.index)

    def _append_until_stop(self, request: Request, token_ids: list[int]) -> list[int]:
        appended = []
        for token_id in token_ids:
            request.output_token_ids.append(token_id)
            appended.append(token_id)
            status = self._stop_status(request, token_id)
            if status is not None:
                request.status = status
                break
        return appended

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        num_output = request.num_output_tokens
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if self.config.role == Role.PREFILL:
            return RequestStatus.FINISHED_PREFILLED
        return None

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
        self._short_loaded.discard(request.request_id)
        # Samples still waiting to fork from it compute their prompt themselves.
        self.waiting.extendleft(reversed(self.forks.take(request.request_id)))
        if status == RequestStatus.FINISHED_PREFILLED:
            self.held[request.request_id] = request
        else:
            self.kv_manager.free(request.request_id)
        output = output or self._output(request, [])
        output.finished = True
        output.finish_reason = status.value
        output.stop_reason = request.stop_reason
        output.error = request.error
        return output

    # ---- helpers ---------------------------------------------------------------------

    def _update_block_hashes(self, request: Request) -> None:
        """Extend the request's chained block hashes to cover its full blocks."""
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            extend_block_hashes(request.block_hashes, request.token_view, self.block_size,
                                request.sampling_params.block_hash_extra_keys)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        """Requests to serve, or loads in flight whose blocks come back once booked."""
        return bool(self.requests or self._loads)

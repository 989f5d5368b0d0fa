"""Where one request runs, as a pure function of the index's answer and the router's load view.

``plan_route`` picks a decode worker, then decides the path (conditional disaggregation):

* decode worker: the cheapest by ``prefix_scoring.worker_cost`` where the "prefill work" is the
  prompt tokens it lacks (they must be sent or computed, weighted ``transfer_alpha``) and the
  load is its KV in use in tokens plus its queued requests; workers without room for the
  prompt's blocks are skipped unless none has room.
* ``local`` (prefill on that decode worker, ``DecodeService.Generate``) when the part of the
  prompt it has not cached is at most ``local_prefill_max_tokens`` (reason ``short_uncached``),
  or it holds at least ``local_hold_fraction`` of the prompt and has headroom: free blocks for
  the rest plus ``local_headroom_fraction`` of its pool, and at most
  ``local_max_queued_prefill_tokens`` of prefill already queued (reason ``decode_holds_prefix``);
  and in both cases only if the local prefill is not slower than the remote one: the decode
  worker's queued prefill tokens plus the uncached part must not exceed the best prefill
  worker's cost (its queued prefill plus what it would compute, ``choose_worker``'s cost) by more
  than ``local_prefill_max_tokens``. A decode worker's engine runs its queued prefills and its
  decode batch on one step loop, so a local request waits for all of them; a remote one waits
  only for the prefill worker's queue.
  "Cached" here is what the index confirms the decode worker holds, never this router's
  prediction (``RecentDecisions``): a predicted prefix may still be computing or in transfer
  to it, and a local prefill would then compute it again on the decode worker's step loop.
* ``remote`` otherwise: the prefill worker by ``prefix_scoring.choose_worker`` (reason
  ``prefix`` / ``load`` / ``imbalance``), or by load alone when the index gave no answer
  (reason ``index_unavailable``). The decode worker's cached blocks are not sent (delta).
  Prefill workers without free blocks for what they would allocate (the prompt's blocks less
  those they hold on device) are skipped unless none has room: a prefill worker holds a
  prompt's blocks until its KV is pushed, so a second prompt that does not fit preempts the
  first (both start over), which costs more than any cache credit saves.

Matches are per index worker id; a worker the index does not list counts as holding nothing.
``local_prefill_max_tokens = 0`` turns local prefill off.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from engine.mathutils import cdiv
from services.index.scripts import WorkerMatch
from services.router.routing.prefix_scoring import Candidate, PrefixScoringConfig, choose_worker
from services.router.routing.worker_load import WorkerLoad


@dataclass(frozen=True)
class RouteConfig:
    """Conditional disaggregation and scoring settings; tokens unless named otherwise."""

    local_prefill_max_tokens: int = 64
    local_hold_fraction: float = 0.75
    local_headroom_fraction: float = 0.1
    local_max_queued_prefill_tokens: int = 1024
    transfer_alpha: float = 0.25  # a transferred token costs this share of a computed one
    # The guard trips at 8 long (1,000-token) prompts of imbalance, not at one: with
    # prefix_scoring's default (1,024 tokens) a single queued system prompt would disable the
    # credits and scatter a tenant's requests (measured in loadtests/bench_routing.py).
    scoring: PrefixScoringConfig = field(
        default_factory=lambda: PrefixScoringConfig(imbalance_abs_tokens=8192))

    def __post_init__(self) -> None:
        if self.local_prefill_max_tokens < 0 or self.local_max_queued_prefill_tokens < 0:
            raise ValueError(f"local prefill limits must be >= 0: {self}")
        if not (0.0 < self.local_hold_fraction <= 1.0 and 0.0 <= self.local_headroom_fraction < 1.0):
            raise ValueError(f"need 0 < local_hold_fraction <= 1 and 0 <= "
                             f"local_headroom_fraction < 1: {self}")
        if self.transfer_alpha <= 0:
            raise ValueError(f"transfer_alpha must be positive, got {self.transfer_alpha}")


@dataclass(frozen=True, slots=True)
class RoutePlan:
    path: str  # "local" | "remote"
    reason: str
    decode_address: str
    prefill_address: str | None  # None on the local path
    num_decode_cached_tokens: int  # prompt tokens the decode worker holds (index or memory)
    num_prefill_credit_tokens: float  # tier-weighted tokens the prefill pick reuses

    @property
    def key(self) -> str:
        """``path/reason``, the key of the router's decision counters."""
        return f"{self.path}/{self.reason}"


def _match_blocks(match: WorkerMatch | Candidate | None) -> tuple[int, int, int]:
    if match is None:
        return 0, 0, 0
    return match.num_device_blocks, match.num_host_blocks, match.num_kvstore_blocks


def _held_tokens(device: int, host: int, kvstore: int, block_size: int, num_prompt_tokens: int) -> int:
    return min(block_size * (device + host + kvstore), num_prompt_tokens)


def _local_reason(num_prompt_tokens: int, num_held_tokens: int, block_size: int, target: WorkerLoad,
                  config: RouteConfig) -> str | None:
    """Why ``target`` may prefill the request itself (module docstring), or None."""
    uncached = num_prompt_tokens - num_held_tokens
    if uncached <= config.local_prefill_max_tokens:
        return "short_uncached"
    headroom = target.num_free_blocks - cdiv(uncached, block_size)
    if (num_held_tokens >= config.local_hold_fraction * num_prompt_tokens
            and headroom >= config.local_headroom_fraction * target.num_total_blocks
            and target.num_outstanding_prefill_tokens <= config.local_max_queued_prefill_tokens):
        return "decode_holds_prefix"
    return None


def decode_candidate(load: WorkerLoad, match: WorkerMatch | None, extra_requests: int = 0) -> Candidate:
    d, h, k = _match_blocks(match)
    used_tokens = max(load.num_total_blocks - load.num_free_blocks, 0) * load.block_size
    return Candidate(load.worker_id or load.address, d, h, k, load.num_outstanding_prefill_tokens,
                     used_tokens, load.num_running + load.num_waiting + extra_requests)


def prefill_candidate(load: WorkerLoad, match: WorkerMatch | None, extra_requests: int = 0) -> Candidate:
    d, h, k = _match_blocks(match)
    return Candidate(load.worker_id or load.address, d, h, k, load.num_outstanding_prefill_tokens,
                     0, load.num_running + load.num_waiting + extra_requests)


def plan_route(num_prompt_tokens: int, block_size: int, prefill: Sequence[WorkerLoad],
               decode: Sequence[WorkerLoad], matches: Mapping[str, WorkerMatch] | None,
               config: RouteConfig = RouteConfig(),
               decode_candidates: Sequence[Candidate] | None = None,
               prefill_candidates: Sequence[Candidate] | None = None) -> RoutePlan | None:
    """The plan (module docstring), or None when there is no decode worker, or the path is
    remote and there is no prefill worker. ``*_candidates`` override the ones built from the
    loads and ``matches`` (the policy passes them with its recent decisions folded in); they
    must be listed in the same order as the loads."""
    if not decode:
        return None
    if decode_candidates is None:
        decode_candidates = [decode_candidate(w, (matches or {}).get(w.worker_id)) for w in decode]
    needed = cdiv(num_prompt_tokens, block_size)
    fitting = [i for i, w in enumerate(decode) if w.num_free_blocks >= needed] or list(range(len(decode)))
    decode_config = PrefixScoringConfig(
        host_credit=config.scoring.host_credit, kvstore_credit=config.scoring.kvstore_credit,
        alpha=config.transfer_alpha, beta_tokens=config.scoring.beta_tokens,
        imbalance_abs_tokens=config.scoring.imbalance_abs_tokens,
        imbalance_ratio=config.scoring.imbalance_ratio)
    choice = choose_worker([decode_candidates[i] for i in fitting], block_size, num_prompt_tokens,
                           decode_config)
    assert choice is not None
    index = next(i for i in fitting if decode_candidates[i].worker_id == choice.worker_id)
    target, held = decode[index], decode_candidates[index]
    num_held_tokens = _held_tokens(*_match_blocks(held), block_size, num_prompt_tokens)
    pick = None
    if prefill:
        if prefill_candidates is None:
            prefill_candidates = [prefill_candidate(w, (matches or {}).get(w.worker_id)) for w in prefill]
        room = [c for w, c in zip(prefill, prefill_candidates)
                if w.num_free_blocks >= needed - c.num_device_blocks]
        pick = choose_worker(room or prefill_candidates, block_size, num_prompt_tokens, config.scoring)
    if config.local_prefill_max_tokens > 0:
        confirmed = (matches or {}).get(target.worker_id)
        num_confirmed = _held_tokens(*_match_blocks(confirmed), block_size, num_prompt_tokens)
        reason = _local_reason(num_prompt_tokens, num_confirmed, block_size, target, config)
        local_cost = target.num_outstanding_prefill_tokens + num_prompt_tokens - num_confirmed
        if reason is not None and (pick is None
                                   or local_cost <= pick.cost + config.local_prefill_max_tokens):
            return RoutePlan("local", reason, target.address, None, num_confirmed, 0.0)
    if pick is None:
        return None
    assert prefill_candidates is not None
    chosen = next(w for w, c in zip(prefill, prefill_candidates) if c.worker_id == pick.worker_id)
    reason = pick.reason if matches is not None else "index_unavailable"
    return RoutePlan("remote", reason, target.address, chosen.address, num_held_tokens,
                     pick.num_credited_tokens)

"""KV-aware worker choice as pure functions: a cost in tokens per worker, an imbalance guard, and
a short router-local memory of recent decisions. Nothing here does I/O; a policy feeds it the
index's ``match`` (services/index/client.py) plus its own load view, and gets a decision back.

The cost of sending a request of ``L`` prompt tokens to worker ``w`` (Dynamo's, in tokens)::

    credit(w) = block_size * (m_device(w) + c_host * m_host(w) + c_kvstore * m_kvstore(w))
    cost(w)   = alpha * max(0, queued_prefill_tokens(w) + L - credit(w))
              + decode_tokens(w) + beta_tokens * num_queued_requests(w)

``m_t(w)`` is the worker's cached prefix of the request split by the fastest tier holding each
block (so ``credit`` never exceeds the matched prefix). ``c_host``/``c_kvstore`` are the share of
recompute a reload saves (1 - reload cost / recompute cost): configurable, 0.75 and 0.5 by default.

Imbalance guard (SGLang's): when the busiest worker's load exceeds the idlest's by more than
``imbalance_abs_tokens`` and by a factor over ``imbalance_ratio``, credits are ignored (load
only), so a hot prefix cannot pile every request onto one worker. Ties go to the worker listed
first (callers list workers in a stable order; the loser of a tie is not starved because its
cost falls as the winner's load rises).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.kv_cache.hashing import BlockHash


@dataclass(frozen=True)
class PrefixScoringConfig:
    host_credit: float = 0.75
    kvstore_credit: float = 0.5
    alpha: float = 1.0  # weight of the prefill work
    beta_tokens: float = 16.0  # cost of one queued request, tokens (one block by default)
    imbalance_abs_tokens: int = 64 * 16
    imbalance_ratio: float = 1.5
    memory_ttl_s: float = 2.0
    max_memory_entries: int = 100_000

    def __post_init__(self) -> None:
        if not (0.0 <= self.kvstore_credit <= 1.0 and 0.0 <= self.host_credit <= 1.0):
            raise ValueError(f"tier credits must be in [0, 1], got host {self.host_credit}, "
                             f"kvstore {self.kvstore_credit}")
        if self.alpha <= 0 or self.beta_tokens < 0 or self.imbalance_ratio < 1:
            raise ValueError(f"need alpha > 0, beta_tokens >= 0, imbalance_ratio >= 1: {self}")
        if self.memory_ttl_s < 0 or self.max_memory_entries < 0:
            raise ValueError(f"memory_ttl_s and max_memory_entries must be >= 0: {self}")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One healthy worker as scored: its cached prefix of the request (blocks, by fastest tier)
    and its load (prompt tokens queued or computing, decode load in tokens, queued requests)."""

    worker_id: str
    num_device_blocks: int = 0
    num_host_blocks: int = 0
    num_kvstore_blocks: int = 0
    num_queued_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_queued_requests: int = 0

    @property
    def load_tokens(self) -> int:
        return self.num_queued_prefill_tokens + self.num_decode_tokens


@dataclass(frozen=True, slots=True)
class Decision:
    worker_id: str
    cost: float  # tokens
    num_credited_tokens: float  # prompt tokens the pick is expected to reuse (tier-weighted)
    reason: str  # "prefix" | "load" (no credit anywhere) | "imbalance" (guard tripped)


def credit_tokens(candidate: Candidate, block_size: int, num_prompt_tokens: int,
                  config: PrefixScoringConfig) -> float:
    """Tier-weighted cached prompt tokens of ``candidate``, at most ``num_prompt_tokens``."""
    blocks = (candidate.num_device_blocks + config.host_credit * candidate.num_host_blocks
              + config.kvstore_credit * candidate.num_kvstore_blocks)
    return min(block_size * blocks, float(num_prompt_tokens))


def worker_cost(candidate: Candidate, block_size: int, num_prompt_tokens: int,
                config: PrefixScoringConfig, use_credit: bool = True) -> float:
    """The cost in tokens of sending the request to ``candidate`` (module docstring)."""
    credit = credit_tokens(candidate, block_size, num_prompt_tokens, config) if use_credit else 0.0
    prefill = max(0.0, candidate.num_queued_prefill_tokens + num_prompt_tokens - credit)
    return (config.alpha * prefill + candidate.num_decode_tokens
            + config.beta_tokens * candidate.num_queued_requests)


def is_imbalanced(candidates: Sequence[Candidate], config: PrefixScoringConfig) -> bool:
    loads = [c.load_tokens for c in candidates]
    if len(loads) < 2:
        return False
    low, high = min(loads), max(loads)
    return high - low > config.imbalance_abs_tokens and high > config.imbalance_ratio * low


def choose_worker(candidates: Sequence[Candidate], block_size: int, num_prompt_tokens: int,
                  config: PrefixScoringConfig = PrefixScoringConfig()) -> Decision | None:
    """The cheapest of ``candidates`` (None if empty); see the module docstring for the cost,
    the guard and ties. Raises ValueError on a non-positive block size or negative length."""
    if block_size <= 0 or num_prompt_tokens < 0:
        raise ValueError(f"need block_size > 0 and num_prompt_tokens >= 0, got {block_size}, "
                         f"{num_prompt_tokens}")
    if not candidates:
        return None
    guard = is_imbalanced(candidates, config)
    costs = [worker_cost(c, block_size, num_prompt_tokens, config, use_credit=not guard)
             for c in candidates]
    best = min(range(len(candidates)), key=lambda i: costs[i])  # first of equal costs
    credit = 0.0 if guard else credit_tokens(candidates[best], block_size, num_prompt_tokens, config)
    reason = "imbalance" if guard else ("prefix" if credit > 0 else "load")
    return Decision(candidates[best].worker_id, costs[best], credit, reason)


class RecentDecisions:
    """Router-local memory: which worker this router recently sent which prompt blocks to, for
    ``ttl_s``, so a burst sharing a new prefix sticks to one worker before its events reach the
    index. Never written to Redis. At most ``max_entries`` blocks (oldest dropped first)."""

    def __init__(self, ttl_s: float, max_entries: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[BlockHash, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, block_hashes: Sequence[BlockHash], worker_id: str) -> None:
        expires_at = self._clock() + self.ttl_s
        for h in block_hashes:
            self._entries[h] = (worker_id, expires_at)
            self._entries.move_to_end(h)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def num_predicted_blocks(self, block_hashes: Sequence[BlockHash], worker_id: str) -> int:
        """Leading blocks of ``block_hashes`` last routed to ``worker_id`` within the TTL."""
        now = self._clock()
        count = 0
        for h in block_hashes:
            entry = self._entries.get(h)
            if entry is None or entry[0] != worker_id or entry[1] < now:
                break
            count += 1
        return count

    def with_predictions(self, candidates: Sequence[Candidate],
                         block_hashes: Sequence[BlockHash]) -> list[Candidate]:
        """``candidates`` with each one's device run raised to what this router predicts it
        holds (a worker's index view wins where it is longer)."""
        out = []
        for c in candidates:
            predicted = self.num_predicted_blocks(block_hashes, c.worker_id)
            known = c.num_device_blocks + c.num_host_blocks + c.num_kvstore_blocks
            if predicted > known:
                c = Candidate(c.worker_id, predicted, 0, 0, c.num_queued_prefill_tokens,
                              c.num_decode_tokens, c.num_queued_requests)
            out.append(c)
        return out

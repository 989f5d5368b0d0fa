"""Which prefill worker and which decode worker serve a request.

The policy sees :class:`WorkerLoad` estimates (the last GetStats reply corrected by what this
router sent since, see worker_pool.py) of the *healthy* workers only, and picks one:

* prefill: fewest outstanding prefill tokens (prompt tokens queued or computing), then fewest
  requests, then the one picked least recently;
* decode: among workers with room for the prompt's blocks, most free KV blocks, then fewest
  running requests, then the one picked least recently. If none has room, the one with the
  most free blocks (it answers RESOURCE_EXHAUSTED and the router tries the next).

A prefix-cache-aware policy (the prefix index issue) subclasses :class:`RoutingPolicy` and
gets the prompt's token ids for hashing.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from engine.mathutils import cdiv


@dataclass(slots=True)
class WorkerLoad:
    """One worker as the policy sees it. Counts are estimates, never negative."""

    address: str
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    block_size: int = 16
    num_running: int = 0
    num_waiting: int = 0
    num_outstanding_prefill_tokens: int = 0
    worker_id: str = ""  # from its GetStats: the id it publishes to the prefix index under


class RoutingPolicy(abc.ABC):
    @abc.abstractmethod
    def pick_prefill(self, workers: Sequence[WorkerLoad],
                     prompt_token_ids: Sequence[int]) -> WorkerLoad | None:
        """One of ``workers`` (all healthy), or None when the list is empty."""

    @abc.abstractmethod
    def pick_decode(self, workers: Sequence[WorkerLoad],
                    prompt_token_ids: Sequence[int]) -> WorkerLoad | None:
        """One of ``workers`` (all healthy), or None when the list is empty."""


class LoadPolicy(RoutingPolicy):
    def __init__(self) -> None:
        self._picks = itertools.count(1)
        self._last_picked: dict[str, int] = {}  # address -> pick number (ties go to the oldest)

    def pick_prefill(self, workers, prompt_token_ids):
        return self._pick(workers, lambda w: (w.num_outstanding_prefill_tokens,
                                              w.num_running + w.num_waiting))

    def pick_decode(self, workers, prompt_token_ids):
        fitting = [w for w in workers
                   if w.num_free_blocks >= cdiv(len(prompt_token_ids), max(w.block_size, 1))]
        return self._pick(fitting or workers,
                          lambda w: (-w.num_free_blocks, w.num_running + w.num_waiting))

    def _pick(self, workers: Sequence[WorkerLoad], key) -> WorkerLoad | None:
        if not workers:
            return None
        best = min(workers, key=lambda w: (*key(w), self._last_picked.get(w.address, 0)))
        self._last_picked[best.address] = next(self._picks)
        return best

"""Which prefill worker and which decode worker serve a request.

The policy sees :class:`WorkerLoad` estimates (the last GetStats reply corrected by what this
router sent since, see worker_pool.py) of the *healthy* workers only, and picks one:

* prefill: fewest outstanding prefill tokens (prompt tokens queued or computing), then fewest
  requests, then the one picked least recently;
* decode: among workers with room for the prompt's blocks, most free KV blocks, then fewest
  running requests, then the one picked least recently. If none has room, the one with the
  most free blocks (it answers RESOURCE_EXHAUSTED and the router tries the next).

Before a sample starts, the backend asks the policy for a *plan* (``plan``: both workers and
the path, services/router/routing/route_plan.py). The load policy is the null planner: it has
no index to configure or consult, answers None (pick by load as the sample goes, counted as
``remote/load``), and its hooks (``configure``, ``finish``, ``close``) do nothing. The
prefix-aware policy (prefix_aware.py) overrides them; the backend never asks which it holds.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from engine.kv_transfer.base import KVCompat
from engine.mathutils import cdiv
from engine.sampling_params import SamplingParams
from services.router.routing.route_decisions import RouteDecisions
from services.router.routing.route_plan import RoutePlan
from services.router.routing.worker_load import WorkerLoad

if TYPE_CHECKING:
    from services.router.metrics import RoutingRecorder

# (prefill loads, decode loads) as they are now: a plan reads them when it decides, after any
# wait (an index lookup), so the plans of one burst see the work the ones before them began
CurrentLoads = Callable[[], tuple[Sequence[WorkerLoad], Sequence[WorkerLoad]]]


class RoutingPolicy(abc.ABC):
    """Picks workers by load (``pick_*``: the first try without a plan, and every retry) and
    plans samples (``plan``). ``decisions`` counts every plan by ``path/reason``."""

    #: the TTFT stage ``plan`` spends (services/router/metrics.py STAGES); None: none worth one
    plan_stage: str | None = None

    def __init__(self, decisions: RouteDecisions | None = None) -> None:
        self.decisions = decisions or RouteDecisions()
        self.routing: RoutingRecorder | None = None  # the router's metrics, once attached

    @property
    def is_configured(self) -> bool:
        """Whether ``configure`` has what it needs (always, without an index)."""
        return True

    def configure(self, compat: KVCompat) -> None:
        """Take the workers' KV compatibility (prefix hashing follows it); see prefix_aware.py."""

    async def plan(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                   loads: CurrentLoads) -> RoutePlan | None:
        """Where ``request_id`` runs; None: the ``pick_*`` methods choose as it goes.
        ``loads()``: the workers' (prefill, decode) loads, read when the plan decides."""
        self.decisions.record("remote/load")
        return None

    def finish(self, request_id: str) -> None:
        """The request ended (any way): release what its plan holds."""

    def close(self) -> None:
        """Stop background work (index lookups, reservations)."""

    @abc.abstractmethod
    def pick_prefill(self, workers: Sequence[WorkerLoad],
                     prompt_token_ids: Sequence[int]) -> WorkerLoad | None:
        """One of ``workers`` (all healthy), or None when the list is empty."""

    @abc.abstractmethod
    def pick_decode(self, workers: Sequence[WorkerLoad],
                    prompt_token_ids: Sequence[int]) -> WorkerLoad | None:
        """One of ``workers`` (all healthy), or None when the list is empty."""


class LoadPolicy(RoutingPolicy):
    """The load-only policy, and the null planner (module docstring)."""

    def __init__(self, decisions: RouteDecisions | None = None) -> None:
        super().__init__(decisions)
        self._picks = itertools.count(1)
        self._last_picked: dict[str, int] = {}  # address -> pick number (ties go to the oldest)

    def pick_prefill(self, workers: Sequence[WorkerLoad],
                     prompt_token_ids: Sequence[int]) -> WorkerLoad | None:
        return self._pick(workers, lambda w: (w.num_outstanding_prefill_tokens,
                                              w.num_running + w.num_waiting))

    def pick_decode(self, workers: Sequence[WorkerLoad],
                    prompt_token_ids: Sequence[int]) -> WorkerLoad | None:
        fitting = [w for w in workers
                   if w.num_free_blocks >= cdiv(len(prompt_token_ids), max(w.block_size, 1))]
        return self._pick(fitting or workers,
                          lambda w: (-w.num_free_blocks, w.num_running + w.num_waiting))

    def _pick(self, workers: Sequence[WorkerLoad],
              key: Callable[[WorkerLoad], tuple[int, ...]]) -> WorkerLoad | None:
        if not workers:
            return None
        best = min(workers, key=lambda w: (*key(w), self._last_picked.get(w.address, 0)))
        self._last_picked[best.address] = next(self._picks)
        return best

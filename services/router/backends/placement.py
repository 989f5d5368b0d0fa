"""Which healthy worker a path calls next: the plan's while it is healthy and not tried yet,
else the load policy's pick among the healthy ones not tried yet.

    placement = Placement(pool, policy)
    worker = placement.planned("decode", plan, excluded) or placement.pick("decode", prompt,
                                                                            excluded, last_error)

``pick`` raises when none is left: Overloaded when the last one tried was full
(RESOURCE_EXHAUSTED), else Unavailable naming every worker's state.
"""

from __future__ import annotations

from collections.abc import Sequence, Set

import grpc

from services.router.errors import Overloaded, Unavailable
from services.router.routing.policy import RoutingPolicy
from services.router.routing.route_plan import RoutePlan
from services.router.routing.worker_pool import Worker, WorkerPool


class Placement:
    def __init__(self, pool: WorkerPool, policy: RoutingPolicy) -> None:
        self.pool = pool
        self.policy = policy

    def planned(self, role: str, plan: RoutePlan | None, excluded: Set[str]) -> Worker | None:
        """The plan's worker of ``role`` while it is healthy and not excluded."""
        if plan is None:
            return None
        address = plan.prefill_address if role == "prefill" else plan.decode_address
        return self.healthy(role, address, excluded)

    def healthy(self, role: str, address: str | None, excluded: Set[str] = frozenset()) -> Worker | None:
        """The worker of ``role`` at ``address`` while it is healthy and not excluded."""
        return next((w for w in self.pool.healthy(role, excluded) if w.address == address), None)

    def pick(self, role: str, prompt: Sequence[int], excluded: Set[str],
             last_error: grpc.aio.AioRpcError | None) -> Worker:
        """The load policy's choice among the healthy workers of ``role`` not in ``excluded``."""
        candidates = {w.address: w for w in self.pool.healthy(role, excluded)}
        loads = [w.load() for w in candidates.values()]
        chosen = (self.policy.pick_prefill(loads, prompt) if role == "prefill"
                  else self.policy.pick_decode(loads, prompt))
        if chosen is not None:
            return candidates[chosen.address]
        if last_error is not None and last_error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise Overloaded(f"every {role} worker is full: {last_error.details()}")
        states = ", ".join(f"{w.address}: {w.status}" for w in self.pool.workers[role])
        detail = f"; last error: {last_error.details()}" if last_error is not None else ""
        raise Unavailable(f"no healthy {role} worker ({states}){detail}")

    def fits_some_decode(self, num_prompt_tokens: int) -> bool:
        """Whether an empty pool of some healthy decode worker holds the prompt (else waiting
        for free blocks cannot help)."""
        return any(w.stats.num_total_blocks * w.block_size >= num_prompt_tokens + 1
                   for w in self.pool.healthy("decode", set()))

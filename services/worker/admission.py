"""Per-worker admission: a worker whose engine queue is full refuses new work at once.

``--max-waiting-requests`` (``PDSERVE_MAX_WAITING_REQUESTS``; 0 = no limit) bounds the
requests waiting in the engine (admitted, not yet scheduled). Beyond it the work-taking RPCs
answer RESOURCE_EXHAUSTED before touching the engine:

    PrefillService.Prefill     (trailing metadata pdserve-failed-peer: prefill)
    DecodeService.ReserveBlocks (the decode side's admission point: a Prefill call passes it
                                on with pdserve-failed-peer: decode) and DecodeService.Generate

The router reads RESOURCE_EXHAUSTED as "full, try another worker" and, when every worker of a
role is full, answers the client 429 / RESOURCE_EXHAUSTED; a full worker is not unhealthy.
The count is read without pausing the engine, so calls arriving together may overshoot the
limit by the number of them in flight: a bound on the queue, not an exact cap.
"""

from __future__ import annotations

import argparse

from services.common.async_engine import AsyncEngine
from services.common.settings import add_env_argument

DEFAULT_MAX_WAITING_REQUESTS = 256


def add_admission_argument(parser: argparse.ArgumentParser) -> None:
    add_env_argument(parser, "--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                     help="refuse new work (RESOURCE_EXHAUSTED) while this many requests wait in the "
                          "engine's queue (0: no limit)")


class QueueLimit:
    """``refusal()``: why the worker takes no new request now, or None."""

    def __init__(self, engine: AsyncEngine, max_waiting_requests: int, worker_id: str) -> None:
        if max_waiting_requests < 0:
            raise ValueError(f"--max-waiting-requests must be >= 0, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.worker_id = worker_id

    @classmethod
    def from_args(cls, engine: AsyncEngine, args: argparse.Namespace, worker_id: str) -> QueueLimit:
        return cls(engine, getattr(args, "max_waiting_requests", 0), worker_id)

    def refusal(self) -> str | None:
        if not self.max_waiting_requests:
            return None
        num_waiting = self.engine.stats().num_waiting_requests
        if num_waiting < self.max_waiting_requests:
            return None
        return (f"worker {self.worker_id} is full: {num_waiting} requests wait in its engine "
                f"(--max-waiting-requests {self.max_waiting_requests}); try another worker or later")

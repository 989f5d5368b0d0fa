"""Per-worker admission: a worker whose engine queue is full refuses new work at once.

``--max-waiting-requests`` (``PDSERVE_MAX_WAITING_REQUESTS``; 0 = no limit) bounds the
requests waiting in the engine (admitted, not yet scheduled). Beyond it the work-taking RPCs
answer RESOURCE_EXHAUSTED before touching the engine:

    PrefillService.Prefill     (trailing metadata pdserve-failed-peer: prefill)
    DecodeService.ReserveBlocks (the decode side's admission point: a Prefill call passes it
                                on with pdserve-failed-peer: decode) and DecodeService.Generate

The router reads RESOURCE_EXHAUSTED as "full, try another worker" and, when every worker of a
role is full, answers the client 429 / RESOURCE_EXHAUSTED; a full worker is not unhealthy.

What counts: the engine's waiting requests (read without pausing it) plus the calls this
worker accepted whose request the engine has not taken yet (``pending``): an engine step can
take a while, and calls arriving meanwhile would all see the old count. So at most
``max_waiting_requests`` requests wait, however many calls arrive at once::

    pending = queue_limit.admit("Prefill", failed_peer="prefill")   # WorkerFull when full
    ...                                  # reserve, then add the request to the engine
    pending.done()                       # once the engine took it, or the call ended (idempotent)
"""

from __future__ import annotations

import argparse

from services.common.async_engine import AsyncEngine
from services.common.errors import ResourceExhausted
from services.common.settings import add_env_argument

DEFAULT_MAX_WAITING_REQUESTS = 256


def add_admission_argument(parser: argparse.ArgumentParser) -> None:
    add_env_argument(parser, "--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                     help="refuse new work (RESOURCE_EXHAUSTED) while this many requests wait in the "
                          "engine's queue (0: no limit)")


class QueueLimit:
    """The worker's queue bound; ``admit`` (module docstring) or ``refusal`` (a check only)."""

    def __init__(self, engine: AsyncEngine, max_waiting_requests: int, worker_id: str) -> None:
        if max_waiting_requests < 0:
            raise ValueError(f"--max-waiting-requests must be >= 0, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.worker_id = worker_id
        self.num_pending = 0

    @classmethod
    def from_args(cls, engine: AsyncEngine, args: argparse.Namespace, worker_id: str) -> QueueLimit:
        return cls(engine, getattr(args, "max_waiting_requests", 0), worker_id)

    def admit(self, rpc: str, failed_peer: str = "") -> Pending:
        """A pending place for one request of the ``rpc`` call; WorkerFull (its message names
        ``rpc``, ``failed_peer`` says which role was full) when the queue is full."""
        refusal = self.refusal()
        if refusal is not None:
            raise WorkerFull(f"{rpc}: {refusal}", failed_peer=failed_peer)
        self.num_pending += 1
        return Pending(self)

    def refusal(self) -> str | None:
        """Why the worker takes no new request now, or None."""
        if not self.max_waiting_requests:
            return None
        num_waiting = self.engine.stats().num_waiting_requests + self.num_pending
        if num_waiting < self.max_waiting_requests:
            return None
        return (f"worker {self.worker_id} is full: {num_waiting} requests wait for its engine "
                f"(--max-waiting-requests {self.max_waiting_requests}); try another worker or later")


class WorkerFull(ResourceExhausted):
    """The worker's queue is full (RESOURCE_EXHAUSTED with this message)."""


class Pending:
    """One accepted call whose request the engine has not taken yet."""

    def __init__(self, limit: QueueLimit) -> None:
        self._limit = limit
        self.is_pending = True

    def done(self) -> None:
        if self.is_pending:
            self.is_pending = False
            self._limit.num_pending -= 1

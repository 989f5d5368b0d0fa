"""Admission control: the router's bounded queue, answered at once when full.

    admission = Admission(AdmissionConfig(max_queued_requests=64, max_running_requests=256))
    ticket = admission.admit()        # QueueFull (HTTP 429 / RESOURCE_EXHAUSTED) when full
    await ticket.acquire_slot()       # waits (bounded by the caller's deadline) for a running slot
    ticket.on_streaming()             # the first token arrived: the request left the queue
    ticket.release()                  # the request ended (idempotent; also frees a queue place)

Two counts, both per router:

* *queued*: admitted and not streaming yet, that is waiting for a running slot, or sent to
  the workers with no first token back. At most ``max_queued_requests``; one more is refused
  with ``QueueFull`` at once, never made to wait.
* *running*: holding a running slot (sent to the workers and not finished). At most
  ``max_running_requests``; a request admitted beyond it waits in the queue (FIFO) for a
  slot, so the workers never see more than that many of this router's requests.

``Retry-After`` is an honest estimate: the queue length times the mean interval between
requests leaving the queue lately (an exponential average), rounded up, 1..60 s; 1 s before
anything was measured. Everything runs on the event loop; nothing polls.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

from services.router.errors import Overloaded

MAX_RETRY_AFTER_S = 60
_EWMA_WEIGHT = 0.2  # of the newest interval between two requests leaving the queue


@dataclass(frozen=True)
class AdmissionConfig:
    """The router's queue bounds (``--max-queued-requests``, ``--max-running-requests``)."""

    max_queued_requests: int = field(default=256, metadata={
        "help": "most requests admitted but not streaming yet (waiting for a running slot or "
                "for their first token); beyond it HTTP 429 / RESOURCE_EXHAUSTED at once"})
    max_running_requests: int = field(default=1024, metadata={
        "help": "most requests sent to the workers at once; more wait in the queue"})

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


class QueueFull(Overloaded):
    """The router's queue is full (HTTP 429 / RESOURCE_EXHAUSTED, with Retry-After)."""


class Admission:
    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()
        self.num_queued = 0
        self.num_running = 0
        self._slots = asyncio.Semaphore(self.config.max_running_requests)
        self._mean_interval_s: float | None = None
        self._last_dequeued_at: float | None = None

    def admit(self) -> Ticket:
        """A queue place for one request, or QueueFull (never waits)."""
        if self.num_queued >= self.config.max_queued_requests:
            raise QueueFull(f"the router's queue is full ({self.num_queued} requests waiting, "
                            f"--max-queued-requests {self.config.max_queued_requests}); retry "
                            f"after {self.retry_after_s()} s", self.retry_after_s())
        self.num_queued += 1
        return Ticket(self)

    def retry_after_s(self) -> int:
        """Whole seconds until the queue has likely drained enough to admit one more."""
        if self._mean_interval_s is None:
            return 1
        estimate = math.ceil((self.num_queued + 1) * self._mean_interval_s)
        return min(max(estimate, 1), MAX_RETRY_AFTER_S)

    def _on_dequeued(self) -> None:
        now = time.monotonic()
        if self._last_dequeued_at is not None:
            interval = now - self._last_dequeued_at
            mean = self._mean_interval_s
            self._mean_interval_s = (interval if mean is None
                                     else (1 - _EWMA_WEIGHT) * mean + _EWMA_WEIGHT * interval)
        self._last_dequeued_at = now


class Ticket:
    """One admitted request's share of the counts; see the module docstring."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.is_queued = True
        self.has_slot = False

    async def acquire_slot(self) -> None:
        """Wait for a running slot (cancellable: a caller's timeout or disconnect ends the wait
        and ``release`` then gives back the queue place)."""
        if self.has_slot or not self.is_queued:
            return
        await self._admission._slots.acquire()
        self.has_slot = True
        self._admission.num_running += 1

    def on_streaming(self) -> None:
        """The first token arrived: the request no longer counts as queued."""
        if self.is_queued:
            self.is_queued = False
            self._admission.num_queued -= 1
            self._admission._on_dequeued()

    def release(self) -> None:
        """The request ended: give back its slot and, if it never streamed, its queue place."""
        if self.is_queued:
            self.is_queued = False
            self._admission.num_queued -= 1
        if self.has_slot:
            self.has_slot = False
            self._admission.num_running -= 1
            self._admission._slots.release()

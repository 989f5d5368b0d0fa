"""Keeping a decode reservation while its prefill job works on it: renew the lease.

A decode worker releases a reservation that nobody claimed or renewed for ``lease_ms`` (so a
crashed prefill worker or router cannot leak its blocks). A prefill job is not a failure for
being slow — queued behind other prompts, on a busy or small CPU, or computing a long prompt
under a small token budget — so while the job runs it calls RenewReservation every
``lease_s / 3``; each acknowledged renewal moves the job's *write deadline* on::

    deadline = (when the acknowledged call was sent) + LEASE_SAFETY * lease_s

The decode worker, for its part, holds the blocks until ``lease_s`` after the call *arrived*,
so no write (a one-sided NIXL write included) is started after a release by the lease. A
renewal that fails (decode worker slow or unreachable) is retried at the next tick; the
deadline stays where the last one put it, so two failed renewals in a row still leave time
for a third. NOT_FOUND means the decode worker no longer holds the reservation (released,
lease ran out): the job must stop writing at once (``lost``). A decode worker that predates
RenewReservation (UNIMPLEMENTED) keeps the first lease only. Renewal stops when the job ends
(``stop``): from then on the lease is what frees the blocks if no Decode call claims them.

Why renew instead of reserving only once the first chunk is computed: the reservation is the
Prefill stream's first event, so a full decode worker (RESOURCE_EXHAUSTED) is answered before
any compute is spent and the router tries the next one; reserving late would compute prompts
that then have nowhere to go, add a round trip between compute and the first push, and a
long prompt would still outlive a lease — renewal is needed either way. The price: a queued
prompt holds its decode blocks while it waits.

    lease = LeaseKeeper(peer.decode, reservation_id, lease_s, sent_at, address)
    lease.start()
    output = await lease.hold_while(engine.next_output(queue))  # LeaseLost: stop, release
    lease.check()                                               # before each push
    await lease.stop()
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TypeVar

import grpc

from services.common.pb import worker_pb2, worker_pb2_grpc
from services.prefill.transfer import TransferFailed

log = logging.getLogger(__name__)
T = TypeVar("T")
LEASE_SAFETY = 0.8  # stop writing after this fraction of the lease since the last renewal
RENEWALS_PER_LEASE = 3


class LeaseLost(TransferFailed):
    """The decode worker no longer holds the reservation (``expired`` False), or it could
    not be renewed before the write deadline (``expired`` True)."""

    def __init__(self, message: str, expired: bool) -> None:
        super().__init__(message)
        self.expired = expired


class LeaseKeeper:
    def __init__(self, stub: worker_pb2_grpc.DecodeServiceStub, reservation_id: str,
                 lease_s: float, reserve_sent_at: float, address: str) -> None:
        self.stub = stub
        self.reservation_id = reservation_id
        self.lease_s = lease_s
        self.address = address
        self.deadline = reserve_sent_at + LEASE_SAFETY * lease_s  # time.monotonic()
        self.lost: str | None = None  # why the decode worker no longer holds it
        self.last_error: str | None = None  # the last renewal that failed, for messages
        self.num_renewals = 0
        self._changed = asyncio.Event()  # deadline moved, or lost
        self._task: asyncio.Task[None] | None = None

    @property
    def interval_s(self) -> float:
        return self.lease_s / RENEWALS_PER_LEASE

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._renew_until_stopped())

    async def stop(self) -> None:
        """No more renewals (the job ended); waits for a renewal in flight to be dropped."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def check(self) -> None:
        """Raise LeaseLost unless writes into the reservation are still allowed now."""
        if self.lost is not None:
            raise LeaseLost(f"the decode worker no longer holds the reservation: {self.lost}",
                            expired=False)
        if time.monotonic() >= self.deadline:
            raise LeaseLost(
                f"the reservation {self.reservation_id!r} on decode worker {self.address} could "
                f"not be renewed before its lease ran out (lease {self.lease_s:g} s, "
                f"{self.num_renewals} renewals; last failed renewal: {self.last_error or 'none'})",
                expired=True)

    async def hold_while(self, awaitable: Awaitable[T]) -> T:
        """``await awaitable`` (cancelled on exit if unfinished) unless the reservation is
        lost or the write deadline passes first: then LeaseLost. Renewals move the deadline."""
        task = asyncio.ensure_future(awaitable)
        try:
            while not task.done():
                self.check()
                self._changed.clear()
                changed = asyncio.ensure_future(self._changed.wait())
                try:
                    await asyncio.wait({task, changed}, timeout=self.deadline - time.monotonic(),
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    changed.cancel()
            return task.result()
        finally:
            task.cancel()

    async def _renew_until_stopped(self) -> None:
        request = worker_pb2.RenewReservationRequest(reservation_id=self.reservation_id)
        while True:
            await asyncio.sleep(self.interval_s)
            sent_at = time.monotonic()
            try:
                reply = await self.stub.RenewReservation(request, timeout=self.interval_s)
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code is grpc.StatusCode.NOT_FOUND:
                    self.lost = exc.details()
                    self._changed.set()
                    return
                if code is grpc.StatusCode.UNIMPLEMENTED:
                    log.warning("decode worker %s cannot renew reservations; %s keeps its first "
                                "lease of %g s", self.address, self.reservation_id, self.lease_s)
                    return
                self.last_error = f"{code.name}: {exc.details()}"
                log.info("renewing reservation %s on %s failed: %s", self.reservation_id,
                         self.address, self.last_error)
                continue
            self.num_renewals += 1
            self.deadline = max(self.deadline, sent_at + LEASE_SAFETY * reply.lease_ms / 1000)
            self._changed.set()

"""The workers a disaggregated router talks to: channels, health, and load estimates.

Every ``poll_interval_s`` each worker gets a grpc.health.v1 Check and a GetStats (each with a
deadline). A worker is healthy while both succeed and it reports SERVING (a poll that only
timed out counts after ``MAX_SLOW_POLLS`` in a row: a worker slow on a busy machine is not dead,
and the Watch stream below reports a dead or draining one at once); a request that
finds it unreachable marks it unhealthy at once, and it is skipped until a later poll passes.
Each worker's grpc.health.v1 Watch stream is followed too: a drain (NOT_SERVING) or a dead
worker (the stream breaks) takes it out of routing at once, not at the next poll; a broken
stream is reopened after ``poll_interval_s``. An idle stream costs nothing.

Load between polls: GetStats is a snapshot, so each worker also counts what this router has
in flight on it (requests, prompt tokens not prefilled yet, reserved blocks), as running sums of
what began and what ended. The estimate the policy sees is the snapshot, plus what began after
the reply came, less what ended after the poll was sent. A request is begun before the worker
can see it and ended after the worker let it go, so a request the snapshot holds began before
the reply and ended after the send: it comes off the estimate when it ends (counting begins
only up to the send, a request begun during the poll's round trip stayed in the estimate after
it ended, until the next poll, and the next request sharing its prefix went elsewhere). The
error left is an undercount, never below zero: a request begun during the round trip that the
worker had not seen yet, or one ended during it that the worker had already let go.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence, Set

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.channels import internal_channel
from services.common.grpc_server import MAX_MESSAGE_BYTES, PEER_CHANNEL_OPTIONS
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.router.routing.worker_load import WorkerLoad

log = logging.getLogger(__name__)
MAX_SLOW_POLLS = 3
STATS_BLOCK_SIZE_UNSET = 16  # a worker's block size before its first GetStats answered


class InFlight:
    """One request's share of a worker's counts: begun before the request is sent to the worker,
    ended after the worker let it go (its prompt tokens at its first token, ``end_prefill``).
    ``end_prefill`` and ``end`` are idempotent."""

    def __init__(self, worker: Worker, prefill_tokens: int, blocks: int) -> None:
        self.worker, self.prefill_tokens, self.blocks = worker, prefill_tokens, blocks
        self.is_open = True
        worker.begun[0] += 1
        worker.begun[1] += prefill_tokens
        worker.begun[2] += blocks

    def end_prefill(self) -> None:
        self.worker.ended[1] += self.prefill_tokens
        self.prefill_tokens = 0

    def end(self) -> None:
        if self.is_open:
            self.end_prefill()
            self.worker.ended[0] += 1
            self.worker.ended[2] += self.blocks
            self.is_open = False


class Worker:
    def __init__(self, address: str, role: str) -> None:
        self.address = address
        self.role = role
        self.channel: grpc.aio.Channel | None = None  # opened by connect(), on the serving loop
        self.is_healthy = False
        self.status = "not checked yet"
        self.stats = worker_pb2.WorkerStats()
        # this router's requests, prompt tokens, blocks: begun and ended so far (running sums),
        # and the sums the last poll's snapshot holds (module docstring)
        self.begun = [0, 0, 0]
        self.ended = [0, 0, 0]
        self._begun_at_poll = [0, 0, 0]  # when its reply came
        self._ended_at_poll = [0, 0, 0]  # when it was sent
        self._num_slow_polls = 0  # health polls in a row that timed out

    def connect(self) -> None:
        """Open the channel; must run on the event loop that will use it (grpc.aio binds it)."""
        self.channel = internal_channel(self.address, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), *PEER_CHANNEL_OPTIONS])
        self.prefill = worker_pb2_grpc.PrefillServiceStub(self.channel)
        self.decode = worker_pb2_grpc.DecodeServiceStub(self.channel)
        self._stats_stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        self._health_stub = health_pb2_grpc.HealthStub(self.channel)

    @property
    def worker_id(self) -> str:
        return self.stats.worker_id

    @property
    def local(self) -> list[int]:
        """This router's requests, prompt tokens not prefilled, and blocks open on the worker."""
        return [b - e for b, e in zip(self.begun, self.ended)]

    @property
    def block_size(self) -> int:
        return self.stats.block_size or STATS_BLOCK_SIZE_UNSET

    def begin(self, prefill_tokens: int = 0, blocks: int = 0) -> InFlight:
        return InFlight(self, prefill_tokens, blocks)

    def mark_unhealthy(self, reason: str) -> None:
        if self.is_healthy:
            log.warning("%s worker %s marked unhealthy: %s", self.role, self.address, reason)
        self.is_healthy, self.status = False, reason

    def load(self) -> WorkerLoad:
        """The last poll's stats corrected by what this router began and ended since (module
        docstring). A request that ended since was counted running or waiting (a decode
        worker's request waits for its KV): it comes off the running count first, then off the
        waiting one (correcting only the running count left a request that was waiting at the
        poll queued until the next one, and the next request sharing its prefix went to another
        worker)."""
        s = self.stats
        requests, tokens, blocks = ((b - b0) - (e - e0) for b, b0, e, e0 in zip(
            self.begun, self._begun_at_poll, self.ended, self._ended_at_poll))
        running = s.num_running_requests + requests
        return WorkerLoad(
            address=self.address,
            num_free_blocks=max(s.num_free_blocks - blocks, 0),
            num_total_blocks=s.num_total_blocks, block_size=self.block_size,
            num_running=max(running, 0),
            num_waiting=max(s.num_waiting_requests + min(running, 0), 0),
            num_outstanding_prefill_tokens=max(s.num_outstanding_prefill_tokens + tokens, 0),
            worker_id=s.worker_id)

    async def refresh(self, timeout_s: float) -> None:
        try:
            health = await self._health_stub.Check(health_pb2.HealthCheckRequest(service=""),
                                                   timeout=timeout_s)
            if health.status != health_pb2.HealthCheckResponse.SERVING:
                self.mark_unhealthy(health_pb2.HealthCheckResponse.ServingStatus.Name(health.status))
                return
            ended = list(self.ended)
            stats = await self._stats_stub.GetStats(worker_pb2.GetStatsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                self._num_slow_polls += 1
                if self._num_slow_polls < MAX_SLOW_POLLS:
                    return
            self.mark_unhealthy(f"{exc.code().name}: {exc.details()}")
            return
        self._num_slow_polls = 0
        self.stats, self._begun_at_poll, self._ended_at_poll = stats, list(self.begun), ended
        if not self.is_healthy:
            log.info("%s worker %s (%s) is healthy", self.role, self.address, stats.worker_id)
        self.is_healthy, self.status = True, "SERVING"

    async def watch(self, retry_s: float) -> None:
        """Follow the Watch stream until cancelled (module docstring). SERVING is left to the
        poll, which reads the stats a routing decision needs."""
        while True:
            try:
                call = self._health_stub.Watch(health_pb2.HealthCheckRequest(service=""))
                async for reply in call:
                    if reply.status != health_pb2.HealthCheckResponse.SERVING:
                        self.mark_unhealthy(
                            health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
                        call.cancel()  # a draining server: let it stop without our stream
                        break
                else:
                    self.mark_unhealthy("health Watch stream ended")
            except grpc.aio.AioRpcError as exc:
                self.mark_unhealthy(f"{exc.code().name}: {exc.details()}")
            await asyncio.sleep(retry_s)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()


class WorkerPool:
    def __init__(self, prefill_addresses: Sequence[str], decode_addresses: Sequence[str],
                 poll_interval_s: float = 0.5, timeout_s: float = 1.0) -> None:
        self.workers = {"prefill": [Worker(a, "prefill") for a in prefill_addresses],
                        "decode": [Worker(a, "decode") for a in decode_addresses]}
        self.poll_interval_s = poll_interval_s
        self.timeout_s = timeout_s
        self._poller: asyncio.Task[None] | None = None
        self._watchers: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        for workers in self.workers.values():
            for worker in workers:
                worker.connect()
        await self.refresh()
        loop = asyncio.get_running_loop()
        self._poller = loop.create_task(self._poll_loop())
        self._watchers = [loop.create_task(w.watch(self.poll_interval_s))
                          for ws in self.workers.values() for w in ws]

    async def refresh(self) -> None:
        await asyncio.gather(*(w.refresh(self.timeout_s) for ws in self.workers.values() for w in ws))

    def healthy(self, role: str, exclude: Set[str] = frozenset()) -> list[Worker]:
        return [w for w in self.workers[role] if w.is_healthy and w.address not in exclude]

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for watcher in self._watchers:
            watcher.cancel()
        for workers in self.workers.values():
            for worker in workers:
                await worker.close()

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - polling must go on
                log.exception("polling workers failed")

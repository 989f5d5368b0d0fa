"""A worker's load as the router sees it: the last poll corrected by its own in-flight requests
(services/router/routing/worker_pool.py). The poll is the real ``Worker.refresh`` against stubs
that answer in-process, so a test can begin or end requests while a GetStats is on its way."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from grpc_health.v1 import health_pb2

from services.common.pb import worker_pb2
from services.router.routing.worker_pool import Worker

TOTAL_BLOCKS = 128


class Health:
    async def Check(self, request, timeout=None):
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


class Stats:
    """GetStats answering ``reply``; ``during`` runs while the call is on its way (after the
    router sent it, before its reply came back)."""

    def __init__(self, reply: worker_pb2.WorkerStats, during: Callable[[], None] = lambda: None) -> None:
        self.reply, self.during = reply, during

    async def GetStats(self, request, timeout=None):
        self.during()
        return self.reply


def stats(running: int = 0, waiting: int = 0, used_blocks: int = 0) -> worker_pb2.WorkerStats:
    return worker_pb2.WorkerStats(worker_id="d0", num_running_requests=running,
                                  num_waiting_requests=waiting, block_size=16,
                                  num_free_blocks=TOTAL_BLOCKS - used_blocks,
                                  num_total_blocks=TOTAL_BLOCKS)


def poll(worker: Worker, reply: worker_pb2.WorkerStats, during: Callable[[], None] = lambda: None) -> None:
    worker._health_stub, worker._stats_stub = Health(), Stats(reply, during)  # type: ignore[assignment]
    asyncio.run(worker.refresh(timeout_s=1.0))
    assert worker.is_healthy


def polled(running: int, waiting: int, in_flight: int) -> tuple[Worker, list]:
    """A decode worker whose last poll saw ``running`` and ``waiting`` requests while this
    router had ``in_flight`` of them open (returned, to end)."""
    worker = Worker("127.0.0.1:1", "decode")
    flights = [worker.begin(prefill_tokens=10, blocks=2) for _ in range(in_flight)]
    poll(worker, worker_pb2.WorkerStats(num_running_requests=running, num_waiting_requests=waiting,
                                        num_free_blocks=100, num_total_blocks=128, block_size=16))
    return worker, flights


def test_a_request_waiting_at_the_poll_that_ended_since_leaves_no_queue():
    worker, (flight,) = polled(running=0, waiting=1, in_flight=1)  # waiting for its KV at the poll
    flight.end()
    load = worker.load()
    assert (load.num_running, load.num_waiting) == (0, 0)
    assert load.num_free_blocks == 102


def test_ended_requests_come_off_running_first_then_waiting():
    worker, flights = polled(running=2, waiting=2, in_flight=3)
    for flight in flights:
        flight.end()
    load = worker.load()
    assert (load.num_running, load.num_waiting) == (0, 1)


def test_requests_begun_since_the_poll_count_as_running():
    worker, _ = polled(running=1, waiting=1, in_flight=0)
    worker.begin(prefill_tokens=5, blocks=1)
    load = worker.load()
    assert (load.num_running, load.num_waiting, load.num_outstanding_prefill_tokens) == (2, 1, 5)


def test_a_request_begun_while_the_poll_was_on_its_way_is_gone_once_it_ended():
    """The worker's snapshot holds a request that began after the poll was sent: once it ends,
    the estimate is an idle worker, not one still running it until the next poll (the flake of
    test_routing: the follow-up request sharing its prefix went to the other decode worker)."""
    worker = Worker("127.0.0.1:1", "decode")
    flights = []
    poll(worker, stats(running=1, used_blocks=13),
         during=lambda: flights.append(worker.begin(blocks=13)))
    assert (worker.load().num_running, worker.load().num_free_blocks) == (1, TOTAL_BLOCKS - 13)
    flights[0].end()
    load = worker.load()
    assert (load.num_running, load.num_waiting, load.num_free_blocks) == (0, 0, TOTAL_BLOCKS)


def test_a_request_ended_while_the_poll_was_on_its_way_comes_off_once():
    worker = Worker("127.0.0.1:1", "decode")
    flight = worker.begin(prefill_tokens=40, blocks=3)
    poll(worker, stats(running=1, used_blocks=3), during=flight.end)
    load = worker.load()
    assert (load.num_running, load.num_free_blocks, load.num_outstanding_prefill_tokens) == (0, TOTAL_BLOCKS, 0)
    assert worker.local == [0, 0, 0]

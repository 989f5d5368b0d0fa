"""A worker's load as the router sees it: the last poll corrected by its own in-flight requests
(services/router/routing/worker_pool.py)."""

from __future__ import annotations

from services.common.pb import worker_pb2
from services.router.routing.worker_pool import Worker


def polled(running: int, waiting: int, in_flight: int) -> tuple[Worker, list]:
    """A decode worker whose last poll saw ``running`` and ``waiting`` requests while this
    router had ``in_flight`` of them open (returned, to end)."""
    worker = Worker("127.0.0.1:1", "decode")
    flights = [worker.begin(prefill_tokens=10, blocks=2) for _ in range(in_flight)]
    worker.stats = worker_pb2.WorkerStats(num_running_requests=running, num_waiting_requests=waiting,
                                          num_free_blocks=100, num_total_blocks=128, block_size=16)
    worker._local_at_poll = list(worker.local)  # what refresh() records with the reply
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

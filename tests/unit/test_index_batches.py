"""BatchingThread (services/index/batches.py): what queues during a round trip goes in the next one,
in order, at most max_batch at a time; a failure reaches every caller; nobody waits forever."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.index.batches import BatchingThread


class Gate:
    """run() that holds its first call until opened, recording every batch it is given."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.batches: list[list[int]] = []

    def __call__(self, items: list[int]) -> list[int]:
        self.entered.set()
        self.opened.wait(5.0)
        self.batches.append(list(items))
        return [item * 10 for item in items]


def test_calls_that_queue_behind_a_round_trip_go_together_in_order_and_bounded() -> None:
    gate = Gate()
    batching: BatchingThread[int, int] = BatchingThread(gate, "test-batch", max_batch=4)

    async def burst() -> list[int]:
        first = asyncio.ensure_future(batching.call(0))
        await asyncio.to_thread(gate.entered.wait, 5.0)  # 0 is in flight alone: nothing waited for it
        rest = [asyncio.ensure_future(batching.call(i)) for i in range(1, 10)]
        await asyncio.sleep(0.05)
        gate.opened.set()
        return await asyncio.gather(first, *rest)

    try:
        assert asyncio.run(burst()) == [i * 10 for i in range(10)]
        assert gate.batches == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9]]
        assert (batching.batches, batching.items) == (4, 10)
    finally:
        batching.shutdown()


def test_a_failing_batch_fails_each_of_its_callers_and_the_next_batch_runs() -> None:
    calls = []

    def run(items: list[int]) -> list[int]:
        calls.append(items)
        if len(calls) == 1:
            raise ConnectionError("index gone")
        return items

    batching: BatchingThread[int, int] = BatchingThread(run, "test-batch", max_batch=8)

    async def two() -> None:
        with pytest.raises(ConnectionError, match="index gone"):
            await batching.call(1)
        assert await batching.call(2) == 2

    try:
        asyncio.run(two())
    finally:
        batching.shutdown()


def test_a_run_giving_the_wrong_number_of_results_is_an_error_not_a_hang() -> None:
    batching: BatchingThread[int, int] = BatchingThread(lambda items: [], "test-batch", max_batch=8)
    try:
        with pytest.raises(RuntimeError, match="0 results for a batch of 1"):
            asyncio.run(batching.call(1))
    finally:
        batching.shutdown()


def test_a_cancelled_caller_leaves_the_others_their_answers() -> None:
    gate = Gate()
    batching: BatchingThread[int, int] = BatchingThread(gate, "test-batch", max_batch=8)

    async def one_gives_up() -> list[int]:
        blocker = asyncio.ensure_future(batching.call(0))
        await asyncio.to_thread(gate.entered.wait, 5.0)
        quitter = asyncio.ensure_future(batching.call(1))
        stayer = asyncio.ensure_future(batching.call(2))
        await asyncio.sleep(0.01)
        quitter.cancel()
        gate.opened.set()
        return await asyncio.gather(blocker, stayer)

    try:
        assert asyncio.run(one_gives_up()) == [0, 20]
    finally:
        batching.shutdown()


def test_shutdown_answers_what_was_never_sent() -> None:
    gate = Gate()
    batching: BatchingThread[int, int] = BatchingThread(gate, "test-batch", max_batch=8)
    answers: list[object] = []
    batching.submit(0, answers.append)
    assert gate.entered.wait(5.0)
    batching.submit(1, answers.append)  # queued behind the round trip in flight
    batching.shutdown()
    assert len(answers) == 1 and isinstance(answers[0], RuntimeError)
    gate.opened.set()


def test_max_batch_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_batch"):
        BatchingThread(lambda items: items, "test-batch", max_batch=0)


def test_flush_returns_once_everything_submitted_has_run() -> None:
    gate = Gate()
    batching: BatchingThread[int, int] = BatchingThread(gate, "test-batch", max_batch=2)
    answers: list[object] = []
    try:
        for i in range(5):
            batching.submit(i, answers.append)
        with pytest.raises(TimeoutError):
            batching.flush(0.05)  # the first round trip is held
        gate.opened.set()
        batching.flush(5.0)
        assert answers == [0, 10, 20, 30, 40] and batching.items == 5
    finally:
        batching.shutdown()

"""Index calls batched on one thread: what queued while a round trip was in flight goes in the next.

A router's lookups come in bursts: requests that finish together under a closed-loop load come
back together, 64 at c=64. One call per round trip queued them behind each other on the lookup
thread (~0.25 ms each on an idle 2-core EPYC VM, ms when redis-server waits for a core), so the
last of a burst waited tens of ms and missed its budget. Here the thread takes every call queued
since its last round trip, up to ``max_batch``, and makes one (``IndexClient.match_many``, one
script for them all; ``IndexClient.reservations``, one pipeline). A lone call goes at once, as
before: nothing waits to fill a batch, and an idle thread blocks (nothing spins).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")


class BatchingThread(Generic[T, R]):
    """``run(items) -> results`` (one per item, in order) called on one thread with the items
    queued since its last call, at most ``max_batch`` at a time, in submission order."""

    def __init__(self, run: Callable[[list[T]], list[R]], name: str, max_batch: int) -> None:
        if max_batch <= 0:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        self._run = run
        self.max_batch = max_batch
        self._pending: deque[tuple[T, Callable[[R | Exception], None] | None]] = deque()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.batches = 0  # round trips made, for tests and benchmarks
        self.items = 0

    def submit(self, item: T, done: Callable[[R | Exception], None] | None = None) -> None:
        """Queue ``item``; ``done(result)`` is called on the batching thread once its batch ran
        (with the exception instead if ``run`` raised)."""
        with self._lock:
            self._pending.append((item, done))
        self._executor.submit(self._drain)

    async def call(self, item: T) -> R:
        """``submit`` for an asyncio caller: the item's result (or ``run``'s exception)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()

        def settle(result: R | Exception) -> None:
            if future.done():  # the caller was cancelled meanwhile
                return
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)

        def done(result: R | Exception) -> None:
            loop.call_soon_threadsafe(settle, result)

        self.submit(item, done)
        return await future

    def _drain(self) -> None:
        # one job is submitted per item: the first to run takes what is queued, the rest find
        # their items taken and return at once
        while True:
            with self._lock:
                batch = [self._pending.popleft() for _ in range(min(self.max_batch, len(self._pending)))]
            if not batch:
                return
            results: list[R | Exception]
            try:
                results = list(self._run([item for item, _ in batch]))
                if len(results) != len(batch):
                    raise RuntimeError(f"{len(results)} results for a batch of {len(batch)}")
            except Exception as exc:  # noqa: BLE001 - every caller hears of it, none waits forever
                log.exception("index batch of %d failed", len(batch))
                results = [exc] * len(batch)
            self.batches += 1
            self.items += len(batch)
            for (_, done), result in zip(batch, results):
                if done is not None:
                    try:
                        done(result)
                    except Exception:  # noqa: BLE001 - one callback must not starve the others
                        log.exception("index batch callback failed")

    def flush(self, timeout_s: float) -> None:
        """Wait until every item submitted so far has run (TimeoutError after ``timeout_s``)."""
        self._executor.submit(lambda: None).result(timeout_s)  # one thread, first in first out

    def shutdown(self) -> None:
        """Stop; items not yet sent are answered with an error (no caller waits forever)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            left = list(self._pending)
            self._pending.clear()
        for _, done in left:
            if done is not None:
                try:
                    done(RuntimeError("index calls stopped"))
                except Exception:  # noqa: BLE001 - e.g. the caller's event loop is closed
                    pass

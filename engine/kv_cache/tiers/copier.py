"""Block copies off the engine thread: one background thread runs copy jobs in submission order.

The host tier hands a ``Copier`` a job (a function that copies some blocks and returns how
many leading ones it copied) and gets a ``CopyJob`` back; the engine thread checks
``is_done`` between steps, or ``wait``s for one job when it has nothing else to do (counted by
the caller). The copies release the GIL (numpy's memcpy for CPU tensors, torch's for CUDA), so
the engine thread keeps stepping while they run.

Ordering contract: jobs run one at a time, first submitted first; a job's effects (its bytes,
``result``, ``error``, ``seconds``) are visible to the engine thread once ``is_done`` reads True.
Fences are the caller's: a block being copied must not be handed out, or written, until its
job is done (``engine/kv_cache/tiers/host_tier.py`` keeps that).

``InlineCopier`` runs each job at ``submit`` on the calling thread: the synchronous baseline
(``CacheConfig.kv_offload_sync``), with the same interface.

Nothing spins: the thread sleeps on a condition while the queue is empty, and is started by the
first ``submit`` (an engine that never offloads has no thread). ``close`` runs what is queued,
then stops the thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

CopyFn = Callable[[], int]
"""Copies some blocks; returns how many leading ones hold their data (a short count: failed)."""

WAIT_LIMIT_S = 60.0  # a copy job of a few hundred MB runs in well under a second; beyond: a bug


class CopyJob:
    """One submitted batch of block copies. Read ``result``/``error``/``seconds`` only once
    ``is_done``; ``error`` is an exception other than the RuntimeError a failed copy raises
    (those become a short ``result`` inside the job function)."""

    __slots__ = ("fn", "is_done", "result", "error", "seconds")

    def __init__(self, fn: CopyFn) -> None:
        self.fn = fn
        self.is_done = False
        self.result = 0
        self.error: BaseException | None = None
        self.seconds = 0.0  # wall time of the copy itself (queueing excluded)

    def run(self) -> None:
        start = time.perf_counter()
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - handed to the engine thread, never lost
            self.error = e
        self.seconds = time.perf_counter() - start


class Copier(Protocol):
    """Runs copy jobs in submission order (see the module docstring)."""

    def submit(self, fn: CopyFn) -> CopyJob: ...

    def wait(self, job: CopyJob) -> bool:
        """Block until ``job`` is done; returns whether it had to block."""
        ...

    def close(self) -> None: ...


class InlineCopier:
    """Runs every job at ``submit``, on the caller's thread (the synchronous baseline)."""

    def submit(self, fn: CopyFn) -> CopyJob:
        job = CopyJob(fn)
        job.run()
        job.is_done = True
        return job

    def wait(self, job: CopyJob) -> bool:
        if not job.is_done:
            raise RuntimeError("an InlineCopier job is always done at submit")
        return False

    def close(self) -> None:
        pass


class BackgroundCopier:
    """One daemon thread running jobs first in, first out; idle, it sleeps on a condition."""

    def __init__(self, name: str = "kv-copier") -> None:
        self._name = name
        self._queue: deque[CopyJob] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._is_closing = False

    def submit(self, fn: CopyFn) -> CopyJob:
        job = CopyJob(fn)
        with self._cond:
            if self._is_closing:
                raise RuntimeError("submitting a copy to a closed copier")
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return job

    def wait(self, job: CopyJob, timeout_s: float = WAIT_LIMIT_S) -> bool:
        """Block until ``job`` is done; True if it was not done yet. Raises RuntimeError after
        ``timeout_s`` (a copy that long means the copier is stuck: a bug)."""
        if job.is_done:
            return False
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not job.is_done:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RuntimeError(f"a KV block copy job did not finish within {timeout_s:g} s "
                                       f"({len(self._queue)} queued behind it)")
                self._cond.wait(remaining)
        return True

    def close(self) -> None:
        """Run what is queued, then stop the thread (idempotent)."""
        with self._cond:
            self._is_closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(WAIT_LIMIT_S)

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._is_closing:
                    self._cond.wait()
                if not self._queue:
                    return
                job = self._queue[0]
            job.run()  # outside the lock: the engine thread submits and polls meanwhile
            with self._cond:
                self._queue.popleft()
                job.is_done = True
                self._cond.notify_all()

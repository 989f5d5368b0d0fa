"""Worker side of the prefix index: KV events in, ``apply`` batches to Redis out.

Usage (any thread may publish; the publisher owns one background thread)::

    publisher = IndexPublisher(redis_url, meta, WorkerInfo("prefill-0", "prefill"), holdings)
    publisher.start()              # raises IndexMetaMismatch; Redis down only logs
    publisher.publish(events)      # never blocks on Redis, never raises for Redis
    publisher.close()              # removes this worker's entries (best effort)

Contract. Each op gets a per-worker sequence number; each process start gets a random 64-bit
epoch. Ops wait in a bounded queue and are flushed every ``flush_interval_s`` or
``max_batch_ops``. ``apply`` answers OK/DUP (done), GAP (send a snapshot) or FENCED (re-register,
then snapshot). A queue overflow drops the queue and sends a snapshot instead: never a silent
drop. ``holdings()`` returns the worker's current blocks (hash -> tier mask); it is called on the
publisher thread, so it must be thread-safe. A heartbeat every ``heartbeat_s`` renews the lease
(``lease_ms``) and publishes ``load()``; a FENCED heartbeat (Redis restarted or flushed) makes
the worker re-register and snapshot, so the index is rebuilt within two heartbeats. Every
``janitor_interval_s`` one publisher of the deployment (a lock in Redis decides) removes the
entries of workers whose lease lapsed. Redis errors are logged and retried with backoff; at
rest the thread sleeps until the next heartbeat.

``counts`` (read by the worker's metrics): apply answers (``ok``, ``dup``, ``gap``, ``fenced``),
``register``, ``overflow``, ``error``, ``snapshot_<status>``, and ``resync_<reason>`` for every
snapshot the index took, by why it was sent (``RESYNC_REASONS``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from engine.kv_cache.events import KVCacheEvent
from engine.kv_cache.hashing import BlockHash
from services.index.config import PublisherConfig
from services.index.ops import events_to_ops
from services.index.schema import IndexMeta, IndexMetaMismatch, WorkerInfo
from services.index.scripts import ApplyOp, IndexScripts

logger = logging.getLogger(__name__)

# why a snapshot was sent: first registration, a GAP answer, re-registration after FENCED, the
# queue overflowed, the caller asked, or a failed snapshot is retried
RESYNC_REASONS = ("start", "gap", "fenced", "overflow", "requested", "retry")
Holdings = Callable[[], Mapping[BlockHash, int]]
LoadFn = Callable[[], Mapping[str, str | int | float]]


def new_epoch() -> str:
    """A random 64-bit epoch in hex: new per process start."""
    return os.urandom(8).hex()


class IndexPublisher:
    """Mirrors one worker's prefix cache into the index; see the module docstring."""

    def __init__(self, redis_url: str, meta: IndexMeta, worker: WorkerInfo, holdings: Holdings,
                 load: LoadFn | None = None, config: PublisherConfig | None = None,
                 epoch: str | None = None) -> None:
        self.worker = worker
        self.epoch = epoch or new_epoch()
        self.config = config = config or PublisherConfig()
        self._holdings = holdings
        self._load = load
        client = redis.Redis.from_url(redis_url, socket_timeout=config.redis_timeout_s,
                                      socket_connect_timeout=config.redis_timeout_s,
                                      retry=Retry(NoBackoff(), 0))
        self._scripts = IndexScripts(client, meta)
        self._cond = threading.Condition()
        self._queue: deque[tuple[int, ApplyOp]] = deque()
        self._next_seq = 1
        self._first_pending_at = 0.0
        self._needs_register = True
        self._needs_snapshot = True
        self._snapshotting = False  # a snapshot is being sent (its flag already cleared)
        self._closing = False
        self._disabled = False
        self._next_heartbeat = 0.0
        self._next_janitor = time.monotonic() + config.janitor_interval_s
        self._backoff_s = 0.0
        self._thread = threading.Thread(target=self._run, name=f"index-publisher-{worker.worker_id}",
                                        daemon=True)
        self.counts: dict[str, int] = {}
        self._resync_reason = "start"  # of the pending snapshot (RESYNC_REASONS)

    # ---- caller side -------------------------------------------------------------------------

    def start(self) -> None:
        """Register once now (so a hash-settings mismatch fails the worker's start loudly), then
        run the background thread. Redis being down only logs: the thread keeps retrying."""
        try:
            self._register()
        except IndexMetaMismatch:
            raise
        except Exception as exc:  # noqa: BLE001 - Redis down: the background thread retries
            logger.warning("prefix index at start: %s; will retry", exc)
        self._thread.start()

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        """Queue ``events`` (thread-safe, O(len)). Never touches Redis, never raises for it."""
        ops = events_to_ops(events)
        if not ops or self._disabled:
            return
        with self._cond:
            if len(self._queue) + len(ops) > self.config.max_queue_ops:
                # The queue's ops are lost: their seq numbers are skipped, so Redis answers GAP, and
                # the snapshot covers them anyway.
                self._next_seq += len(ops)
                self._queue.clear()
                self._needs_snapshot = True
                self._resync_reason = "overflow"
                self._count("overflow")
            else:
                if not self._queue:
                    self._first_pending_at = time.monotonic()
                for op in ops:
                    self._queue.append((self._next_seq, op))
                    self._next_seq += 1
            self._cond.notify()

    def request_snapshot(self, reason: str = "requested") -> None:
        """Resend the full holdings (e.g. after the caller lost events)."""
        with self._cond:
            self._needs_snapshot = True
            self._resync_reason = reason
            self._cond.notify()

    @property
    def scope(self) -> str:
        """The index's key prefix this worker writes under."""
        return self._scripts.scope

    @property
    def is_synced(self) -> bool:
        """Registered, no snapshot pending or being sent, and every queued op applied."""
        with self._cond:
            return not (self._needs_register or self._needs_snapshot or self._snapshotting
                        or self._queue)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread and remove this worker's entries from the index (best effort)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        try:
            self._scripts.remove(self.worker.worker_id, self.epoch)
        except Exception as exc:  # noqa: BLE001 - best effort: the lease lapses anyway
            logger.info("prefix index: could not remove %s on close: %s", self.worker.worker_id, exc)
        self._scripts.client.close()

    # ---- publisher thread --------------------------------------------------------------------

    def _count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def _is_due(self, now: float) -> bool:
        if self._disabled:
            return False
        return (self._needs_register or self._needs_snapshot or now >= self._next_heartbeat
                or len(self._queue) >= self.config.max_batch_ops
                or (bool(self._queue) and now >= self._first_pending_at + self.config.flush_interval_s))

    def _wait_until_due(self) -> bool:
        """Sleep until there is work (or the backoff ends); False when closing."""
        with self._cond:
            retry_at = time.monotonic() + self._backoff_s
            while not self._closing:
                now = time.monotonic()
                if now >= retry_at and self._is_due(now):
                    return True
                if self._disabled:
                    timeout = None
                elif now < retry_at:
                    timeout = retry_at - now
                else:
                    timeout = self._next_heartbeat - now
                    if self._queue:
                        timeout = min(timeout, self._first_pending_at + self.config.flush_interval_s - now)
                self._cond.wait(None if timeout is None else max(timeout, 0.0))
            return False

    def _run(self) -> None:
        while self._wait_until_due():
            try:
                self._work()
                if self._backoff_s:
                    logger.info("prefix index reachable again")
                self._backoff_s = 0.0
            except IndexMetaMismatch as exc:
                logger.error("prefix index disabled for this worker: %s", exc)
                self._disabled = True
            except Exception as exc:  # noqa: BLE001 - Redis down or slow: never raise into the worker
                if self._backoff_s == 0.0:
                    logger.warning("prefix index unavailable (%s: %s); retrying with backoff",
                                   type(exc).__name__, exc)
                self._count("error")
                self._backoff_s = min(max(2 * self._backoff_s, self.config.min_backoff_s),
                                      self.config.max_backoff_s)

    def _work(self) -> None:
        if self._needs_register:
            self._register()
        if self._needs_snapshot:
            self._snapshot()
        self._flush()
        if time.monotonic() >= self._next_heartbeat:
            self._heartbeat()

    def _register(self) -> None:
        self._scripts.register(self.worker, self.epoch, self.config.lease_ms)
        self._count("register")
        with self._cond:
            self._needs_register = False
            self._needs_snapshot = True
            self._next_heartbeat = time.monotonic()  # publish the load right away

    def _snapshot(self) -> None:
        with self._cond:
            # Every queued op happened before the holdings are read: the snapshot covers them.
            seq_at = self._next_seq - 1
            self._queue.clear()
            self._needs_snapshot = False
            self._snapshotting = True
            reason = self._resync_reason
        try:
            try:
                holdings = self._holdings()
                status = self._scripts.snapshot(
                    self.worker.worker_id, self.epoch, seq_at,
                    ((h.hex(), int(mask)) for h, mask in holdings.items()),
                    self.config.snapshot_chunk_blocks)
            except BaseException:
                self.request_snapshot("retry")
                raise
            self._count(f"snapshot_{status.lower()}")
            if status == "OK":
                self._count(f"resync_{reason}")
            elif status == "FENCED":
                self._fenced()
            else:  # STALE: another writer of this epoch; retry after a backoff
                self.request_snapshot("retry")
                raise RuntimeError(f"prefix index snapshot of {self.worker.worker_id} was {status}")
        finally:  # after its counts and follow-up flags: is_synced never sees a gap between
            with self._cond:
                self._snapshotting = False

    def _set_flags(self, register: bool) -> None:
        with self._cond:
            self._needs_register = self._needs_register or register
            self._needs_snapshot = True
            self._resync_reason = "fenced" if register else "gap"

    def _flush(self) -> None:
        for _ in range(self.config.max_queue_ops // self.config.max_batch_ops + 1):
            with self._cond:
                if not self._queue or self._needs_snapshot or self._needs_register:
                    return
                batch = [self._queue[i] for i in range(min(len(self._queue), self.config.max_batch_ops))]
            status = self._scripts.apply(self.worker.worker_id, self.epoch, batch[0][0],
                                         [op for _, op in batch])
            self._count(status.lower())
            if status in ("OK", "DUP"):
                with self._cond:
                    # publish() may have cleared the queue meanwhile (overflow): drop by seq.
                    while self._queue and self._queue[0][0] <= batch[-1][0]:
                        self._queue.popleft()
                    if self._queue:
                        self._first_pending_at = time.monotonic()
            elif status == "GAP":
                self._set_flags(register=False)
                return
            else:
                self._fenced()
                return

    def _heartbeat(self) -> None:
        load = dict(self._load()) if self._load is not None else {}
        status = self._scripts.heartbeat(self.worker.worker_id, self.epoch, self.config.lease_ms, load)
        self._next_heartbeat = time.monotonic() + self.config.heartbeat_s
        if status != "OK":
            self._count("heartbeat_fenced")
            self._fenced()
        elif time.monotonic() >= self._next_janitor:
            self._next_janitor = time.monotonic() + self.config.janitor_interval_s
            reaped = self._scripts.reap(int(self.config.janitor_interval_s * 1000))
            if reaped > 0:
                logger.info("prefix index janitor: removed %d dead workers' entries", reaped)

    def _fenced(self) -> None:
        """Our epoch is not the registered one. Redis lost or reaped the registration: register
        again. A newer process took this worker id: this one is stale and stops publishing."""
        registered = self._scripts.registered_epoch(self.worker.worker_id)
        if registered is not None and registered != self.epoch:
            logger.error("prefix index: worker id %s was registered by a newer process (epoch %s); "
                         "this one (epoch %s) stops publishing", self.worker.worker_id, registered,
                         self.epoch)
            self._disabled = True
            return
        self._set_flags(register=True)

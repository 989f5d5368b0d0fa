"""Router side of the prefix index: one ``match`` round trip per request, or per batch of them; never a wait.

``IndexClient.match(block_hashes)`` returns, per live worker, its cached prefix of the request
split by tier plus its load (``scripts.WorkerMatch``), or None for "unknown": the caller then
routes by load only. A call has a time budget (``budget_s``, default 5 ms, for connect and for
the reply); a timeout or error counts as a failure for the circuit breaker (``breaker.py``), and
while the breaker is open ``match`` returns None at once without touching the network.

The first successful lookup (and the first after each outage) reads the index's ``meta``; other
hash settings than this router's make ``match`` return None with reason ``meta_mismatch`` and log
an error, never a silent 0 % hit rate. ``check_meta`` raises the same mismatch for a startup
check. Calls are synchronous and bounded by the budget; an asyncio caller may run them in a
thread. Fallbacks are counted by reason in ``fallbacks`` and told to ``on_fallback(reason)`` when set
(metric ``pdserve_index_fallback_total``; called on the calling thread).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from engine.kv_cache.hashing import BlockHash
from services.common.faults import faults
from services.index.breaker import BreakerState, CircuitBreaker
from services.index.config import IndexClientConfig
from services.index.schema import IndexMeta, IndexMetaMismatch
from services.index.scripts import IndexScripts, WorkerMatch

logger = logging.getLogger(__name__)
T = TypeVar("T")


class IndexClient:
    """See the module docstring. Thread-safe (redis-py's pool; the breaker has a lock)."""

    def __init__(self, redis_url: str, meta: IndexMeta,
                 config: IndexClientConfig | None = None) -> None:
        self.meta = meta
        self.config = config = config or IndexClientConfig()
        self.breaker = CircuitBreaker(config.breaker)
        client = redis.Redis.from_url(redis_url, socket_timeout=config.budget_s,
                                      socket_connect_timeout=config.budget_s,
                                      retry=Retry(NoBackoff(), 0))
        self._scripts = IndexScripts(client, meta)
        self._lock = threading.Lock()
        self._meta_ok = False
        self.meta_error: IndexMetaMismatch | None = None
        self.fallbacks: dict[str, int] = {}
        self.on_fallback: Callable[[str], None] | None = None

    @property
    def is_available(self) -> bool:
        """False while the breaker is open or the index's meta disagrees (gauge ``pdserve_index_available``)."""
        return self.breaker.state is BreakerState.CLOSED and self.meta_error is None

    def check_meta(self) -> None:
        """Raise ``IndexMetaMismatch`` if the index was written with other hash settings; Redis
        errors propagate (a startup check, not for the request path)."""
        self.meta.check_stored(self._scripts.stored_meta())

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, WorkerMatch] | None:
        """Per live worker, its cached prefix of ``block_hashes`` (a chain from the root) and its
        load; None when the index cannot answer within the budget (route by load only)."""
        return self.match_many([block_hashes])[0]

    def match_many(self, chains: Sequence[Sequence[BlockHash]]) -> list[dict[str, WorkerMatch] | None]:
        """``match`` of several requests in one round trip (a router's lookups that queued while
        the one before was in flight): one budget and one breaker outcome for them all, and each
        of them counted in ``fallbacks`` when the index cannot answer."""
        if not chains:
            return []
        if not self.breaker.allow():
            self._count_fallback("breaker_open", len(chains))
            return [None] * len(chains)
        try:
            if not self._meta_ok:
                self._verify_meta()
            result: list[dict[str, WorkerMatch] | None] = list(
                self._scripts.match_many([[h.hex() for h in chain] for chain in chains]))
        except IndexMetaMismatch as exc:
            self.breaker.record_success()  # Redis answered; the index is unusable, not down
            if self.meta_error is None:
                logger.error("prefix index refused: %s", exc)
            self.meta_error = exc
            self._count_fallback("meta_mismatch", len(chains))
            return [None] * len(chains)
        except redis.RedisError as exc:
            self.breaker.record_failure()
            with self._lock:
                self._meta_ok = False
            self._count_fallback("timeout" if isinstance(exc, redis.TimeoutError) else "error", len(chains))
            return [None] * len(chains)
        self.breaker.record_success()
        return result

    def _verify_meta(self) -> None:
        stored = self._scripts.stored_meta()
        self.meta.check_stored(stored)
        with self._lock:
            self.meta_error = None
            self._meta_ok = bool(stored)  # an empty index is checked again once a worker writes

    def _count_fallback(self, reason: str, count: int = 1) -> None:
        with self._lock:
            self.fallbacks[reason] = self.fallbacks.get(reason, 0) + count
        if self.on_fallback is not None:
            for _ in range(count):
                self.on_fallback(reason)

    def reserve(self, worker_id: str, request_id: str) -> int | None:
        """Count ``request_id`` in flight on ``worker_id`` for every router (expires after
        ``reservation_ttl_ms``); the worker's live reservation count, or None if unavailable."""
        replies = self.reservations([("reserve", worker_id, request_id)])
        return None if replies is None else replies[0]

    def release(self, worker_id: str, request_id: str) -> bool | None:
        replies = self.reservations([("release", worker_id, request_id)])
        return None if replies is None else bool(replies[0])

    def reservations(self, ops: Sequence[tuple[str, str, str]]) -> list[int] | None:
        """``reserve`` and ``release`` calls, in order, in one round trip: ``ops`` are
        ("reserve" | "release", worker id, request id); their replies, or None if unavailable."""
        return self._guarded(lambda: self._scripts.reservations(ops, self.config.reservation_ttl_ms))

    def reap_dead_workers(self) -> int | None:
        """Janitor: forget workers whose lease lapsed; how many, or None if unavailable."""
        return self._guarded(lambda: self._scripts.reap())

    def _guarded(self, call: Callable[[], T]) -> T | None:
        if not self.breaker.allow():
            return None
        try:
            faults().redis_stall()  # PDSERVE_FAULTS only
            result = call()
        except redis.RedisError:
            self.breaker.record_failure()
            return None
        self.breaker.record_success()
        return result

    def close(self) -> None:
        self._scripts.client.close()

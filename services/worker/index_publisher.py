"""Worker glue for the prefix index: this worker's KV events -> ``services.index.IndexPublisher``.

Started by ``serve`` when ``--redis-url`` is given (the engine is then built with
``enable_kv_events``). The engine loop hands each iteration's events to ``publish`` (queueing
only, no I/O on the engine thread); the publisher's thread reads the full holdings for a
snapshot through ``AsyncEngine.call`` (so on the engine thread, between steps) and the load from
``AsyncEngine.stats``. The index scope is the model name plus this cache's KV compatibility hash.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from engine.kv_cache.hashing import BlockHash
from engine.kv_transfer.base import KVCompat
from services.common.async_engine import AsyncEngine
from services.index.config import PublisherConfig
from services.index.publisher import IndexPublisher
from services.index.schema import IndexMeta, WorkerInfo
from services.index.settings import LEASE_HEARTBEATS

log = logging.getLogger(__name__)
HOLDINGS_TIMEOUT_S = 10.0  # the engine thread may be in a long prefill step


def index_meta(model_name: str, engine: AsyncEngine) -> IndexMeta:
    """The index settings of this worker's engine (its scope names model and compat hash)."""
    compat = KVCompat.from_kv_cache(model_name, engine.kv_cache)
    return IndexMeta(model=model_name, compat_hash=compat.hash, block_size=compat.block_size)


class WorkerIndexPublisher:
    """Publishes one worker's prefix cache while the worker serves; see the module docstring.
    ``worker_id`` / ``role`` / ``grpc_address`` name it in the index at ``redis_url``, renewed
    every ``heartbeat_s`` seconds."""

    def __init__(self, engine: AsyncEngine, model_name: str, worker_id: str, role: str,
                 grpc_address: str, redis_url: str, heartbeat_s: float) -> None:
        self._engine = engine
        config = PublisherConfig(heartbeat_s=heartbeat_s, lease_ms=int(LEASE_HEARTBEATS * heartbeat_s * 1000),
                                 max_backoff_s=heartbeat_s, min_backoff_s=min(0.1, heartbeat_s))
        worker = WorkerInfo(worker_id, role, node=socket.gethostname(), grpc=grpc_address)
        self.publisher = IndexPublisher(redis_url, index_meta(model_name, engine),
                                        worker, self._holdings, self._load, config)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        """Register (raises ``IndexMetaMismatch`` if the index uses other hash settings; Redis
        being down only logs), then route the engine's events to the publisher."""
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self.publisher.start)
        self._engine.set_kv_event_sink(self.publisher.publish)
        log.info("publishing the prefix cache to the index %s as %s (epoch %s)",
                 self.publisher.scope, self.publisher.worker.worker_id, self.publisher.epoch)

    async def close(self) -> None:
        """Stop publishing and remove this worker's entries from the index."""
        self._engine.set_kv_event_sink(None)
        await asyncio.to_thread(self.publisher.close)

    def _holdings(self) -> dict[BlockHash, int]:
        # Runs on the publisher thread: read the pool on the engine thread, between two steps.
        assert self._loop is not None, "start() first"
        future = asyncio.run_coroutine_threadsafe(
            self._engine.call(lambda core: core.kv_holdings()), self._loop)
        return {h: int(tiers) for h, tiers in future.result(HOLDINGS_TIMEOUT_S).items()}

    def _load(self) -> dict[str, str | int | float]:
        stats = self._engine.stats()
        usage = 1.0 - stats.num_free_blocks / max(stats.num_total_blocks, 1)
        return {"running": stats.num_running_requests, "waiting": stats.num_waiting_requests,
                "kv_usage": round(usage, 4), "free_blocks": stats.num_free_blocks,
                "outstanding_prefill_tokens": stats.num_outstanding_prefill_tokens}

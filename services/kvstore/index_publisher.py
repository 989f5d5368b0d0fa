"""The kvstore in the prefix index: its KVSTORE-tier blocks published as worker ``kvstore@<node>``.

    index = KVStoreIndexPublisher(redis_url, store, "127.0.0.1:50081")
    await index.on_register(compat)   # the servicer, after a Handshake registered a compat
    index.flush()                     # the servicer, after each Put (events: stored, evicted)
    await index.close()

One ``IndexPublisher`` per KV compat the store serves (each compat is its own index scope: model
and compat hash), created when a worker's Handshake first registers it; its initial snapshot
covers what was stored before. ``flush`` hands the store's queued events to each compat's
publisher (queueing only: the publisher thread talks to Redis). The snapshot reads the store on
the event loop's thread (``holdings``), since the store is single-threaded. A Redis that is down
only logs (the publisher retries); an index written with other hash settings
(``IndexMetaMismatch``) is logged and that compat is not published: the store keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from engine.kv_cache.events import Tier
from engine.kv_cache.hashing import BlockHash
from engine.kv_transfer.base import KVCompat
from services.index.config import PublisherConfig
from services.index.publisher import IndexPublisher
from services.index.schema import IndexMeta, IndexMetaMismatch, WorkerInfo
from services.index.settings import LEASE_HEARTBEATS
from services.kvstore.store import BlockStore

log = logging.getLogger(__name__)
HOLDINGS_TIMEOUT_S = 10.0


class KVStoreIndexPublisher:
    """Mirrors a ``BlockStore`` into the prefix index; see the module docstring."""

    def __init__(self, redis_url: str, store: BlockStore, grpc_address: str, heartbeat_s: float = 2.0,
                 node: str | None = None) -> None:
        self.redis_url = redis_url
        self.store = store
        self.node = node or socket.gethostname()
        self.worker = WorkerInfo(f"kvstore@{self.node}", "kvstore", node=self.node, grpc=grpc_address)
        self.config = PublisherConfig(heartbeat_s=heartbeat_s, lease_ms=int(LEASE_HEARTBEATS * heartbeat_s * 1000),
                                      max_backoff_s=heartbeat_s, min_backoff_s=min(0.1, heartbeat_s))
        self._publishers: dict[str, IndexPublisher | None] = {}  # None: not published (mismatch)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def on_register(self, compat: KVCompat) -> None:
        """Start publishing ``compat``'s blocks (once per compat)."""
        if compat.hash in self._publishers:
            return
        self._loop = asyncio.get_running_loop()
        meta = IndexMeta(model=compat.model_name, compat_hash=compat.hash, block_size=compat.block_size)
        publisher = IndexPublisher(self.redis_url, meta, self.worker,
                                   lambda: self._holdings(compat.hash), config=self.config)
        self._publishers[compat.hash] = publisher
        try:
            await asyncio.to_thread(publisher.start)
        except IndexMetaMismatch as error:
            self._publishers[compat.hash] = None
            log.error("not publishing kvstore blocks of %s to the prefix index: %s", compat.model_name, error)
            return
        log.info("publishing the kvstore's %s blocks to the index %s as %s", compat.model_name,
                 publisher.scope, self.worker.worker_id)

    def flush(self) -> None:
        """Queue the store's events with their compat's publisher (drops those of unpublished ones:
        a publisher's snapshot covers what came before it)."""
        for compat_hash, events in self.store.take_events_by_compat().items():
            publisher = self._publishers.get(compat_hash)
            if publisher is not None:
                publisher.publish(events)

    async def close(self) -> None:
        """Stop every publisher and remove the store's entries from the index (best effort)."""
        for publisher in self._publishers.values():
            if publisher is not None:
                await asyncio.to_thread(publisher.close)

    def _holdings(self, compat_hash: str) -> dict[BlockHash, int]:
        """Runs on a publisher thread: read the store on the event loop's thread."""
        assert self._loop is not None, "on_register first"

        async def read() -> dict[BlockHash, int]:
            return dict.fromkeys(self.store.block_hashes(compat_hash), int(Tier.KVSTORE))
        return asyncio.run_coroutine_threadsafe(read(), self._loop).result(HOLDINGS_TIMEOUT_S)

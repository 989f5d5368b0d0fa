"""The kvstore publishes its blocks to the prefix index: a real ``pdserve serve kvstore
--redis-url`` process and a real ``redis-server``; blocks a worker puts show up under worker
``kvstore@<node>`` with tier KVSTORE for the router's ``IndexClient.match``."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import time

import torch

from engine.kv_cache.hashing import BlockHash
from engine.kv_transfer.base import KVCompat
from services.index.client import IndexClient
from services.index.config import IndexClientConfig
from services.index.schema import IndexMeta
from services.kvstore.client import KVStoreClient
from tests.integration.cluster_fixtures import start_kvstore, stop_all, wait_serving

COMPAT = KVCompat("tiny-index-model", "float32", 16, 4, 3, 64)


def h(i: int) -> BlockHash:
    return BlockHash(hashlib.sha256(f"kvstore-index-{i}".encode()).digest())


def test_put_blocks_are_published_as_the_kvstore_tier(tmp_path, redis_server):
    store = start_kvstore(tmp_path, "--kvstore-gib", "0.01", "--redis-url", redis_server.url,
                          "--index-heartbeat-s", "0.5", transfer="grpc")
    hashes = [h(i) for i in range(4)]
    blocks = torch.randn((4, *COMPAT.block_shape))

    async def put() -> int:
        client = KVStoreClient(store.address, COMPAT, timeout_s=5.0)
        try:
            return await client.offer_and_put(hashes, None, list(range(4 * COMPAT.block_size)), blocks)
        finally:
            await client.close()

    index = IndexClient(redis_server.url, IndexMeta(model=COMPAT.model_name, compat_hash=COMPAT.hash,
                                                    block_size=COMPAT.block_size),
                        IndexClientConfig(budget_s=1.0))
    try:
        wait_serving([store], timeout_s=60)
        assert asyncio.run(put()) == 4
        worker_id = f"kvstore@{socket.gethostname()}"
        deadline = time.monotonic() + 10
        match = None
        while time.monotonic() < deadline:
            match = (index.match(hashes + [h(99)]) or {}).get(worker_id)
            if match is not None and match.num_kvstore_blocks == 4:
                break
            time.sleep(0.1)
        assert match is not None, f"{worker_id} not in the index; kvstore log:\n{store.log_tail()}"
        assert (match.num_device_blocks, match.num_host_blocks, match.num_kvstore_blocks) == (0, 0, 4)
        assert match.role == "kvstore"
    finally:
        index.close()
        stop_all([store])

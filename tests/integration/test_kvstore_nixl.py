"""The kvstore's NIXL path between real processes: a store (``pdserve serve kvstore``) and a
worker-like child that READs store slots into its registered KV cache over loopback UCX.
This test process never imports NIXL (its libprotobuf must not meet grpc's); the reader runs
in a spawned child. Skipped only where the nixl module cannot load."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os

import pytest
import torch

from services.kvstore.client import KVStoreClient
from tests.integration.cluster_fixtures import start_kvstore, stop_all, wait_serving
from tests.integration.test_kv_transfer import nixl_import_error
from tests.integration.test_kvstore_service import COMPAT, _stats, h, random_blocks, raw, tokens

SPAWN = mp.get_context("spawn")
NUM_LOCAL_BLOCKS = 12
READS = [([3, 0, 5], [11, 2, 7]), ([1], [0])]  # (store chain indices, local block ids)


def _reader_main(conn, address: str) -> None:
    os.environ["UCX_NET_DEVICES"] = "lo"
    from services.kvstore.nixl_reader import NixlBlockReader

    async def main() -> None:
        kv_cache = torch.zeros((NUM_LOCAL_BLOCKS, *COMPAT.block_shape))
        reader = NixlBlockReader(COMPAT.model_name, kv_cache)
        client = KVStoreClient(address, COMPAT, timeout_s=10.0)
        try:
            landed = [await client.read_into(reader, [h(i) for i in chain], dst)
                      for chain, dst in READS]
            missing = await client.read_into(reader, [h(0), h(12345)], [4, 5])
            conn.send({"landed": landed, "missing": missing, "failures": client.num_failures})
            conn.send_bytes(raw(kv_cache))
        finally:
            await client.close()
            reader.close()

    asyncio.run(main())


# cma (cross-memory attach) reads need nothing from the store; over tcp the store's UCX must
# make progress, which the server drives only while a NIXL read lease is live.
UCX_CASES = {"default-ucx": {}, "tcp-ucx": {"UCX_TLS": "tcp"}}


@pytest.mark.slow  # a store and a reader process, each importing torch and NIXL: ~10 s
@pytest.mark.parametrize("case", sorted(UCX_CASES))
def test_nixl_read_from_the_store_is_byte_identical(tmp_path, monkeypatch, case):
    if nixl_import_error() is not None:
        pytest.skip(f"NIXL is not importable here: {nixl_import_error()}")
    for name, value in UCX_CASES[case].items():
        monkeypatch.setenv(name, value)  # the store and the spawned reader inherit it
    store = start_kvstore(tmp_path, "--kvstore-gib", "0.05", transfer="nixl")
    reader = None
    try:
        wait_serving([store], timeout_s=60)
        assert _stats(store.address).has_nixl, store.log_tail()
        blocks = random_blocks(6, seed=5)

        async def put() -> int:
            client = KVStoreClient(store.address, COMPAT)
            try:
                return await client.offer_and_put([h(i) for i in range(6)], None, tokens(6), blocks)
            finally:
                await client.close()

        assert asyncio.run(put()) == 6
        conn, child = SPAWN.Pipe()
        reader = SPAWN.Process(target=_reader_main, args=(child, store.address), daemon=True)
        reader.start()
        assert conn.poll(90), "the NIXL reader did not report"
        result = conn.recv()
        cache = torch.frombuffer(bytearray(conn.recv_bytes()), dtype=torch.float32).view(
            NUM_LOCAL_BLOCKS, *COMPAT.block_shape)
    finally:
        if reader is not None:
            reader.join(20)
            if reader.is_alive():
                reader.kill()
        stats = _stats(store.address) if store.proc.poll() is None else None
        stop_all([store])
    assert result == {"landed": [3, 1], "missing": 0, "failures": 1}, result
    written = set()
    for chain, dst in READS:
        assert raw(cache[dst]) == raw(blocks[chain])
        written |= set(dst)
    assert not cache[[b for b in range(NUM_LOCAL_BLOCKS) if b not in written]].any()
    assert stats is not None and stats.num_leases == 0 and stats.num_leases_granted == 2

"""``pdserve serve kvstore`` as a real process: Put / Lookup / Get byte-identical over gRPC, the
bad-input matrix (the service keeps serving), leases against eviction over RPC, and a store
killed mid-Get or restarted: the client reports misses, never an exception."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import time

import grpc
import pytest
import torch

from engine.kv_cache.hashing import BlockHash
from engine.kv_transfer.base import KVCompat, KVHandshake, KVRegion
from services.common.pb import kvstore_pb2, kvstore_pb2_grpc
from services.common.wire import handshake_to_proto
from services.kvstore.client import RECONNECT_BACKOFF_MAX_MS, KVStoreClient
from tests.integration.cluster_fixtures import WorkerProcess, start_kvstore, stop_all, wait_serving

# [num_layers=4, 2, block_size=16, kv_heads=3, head_dim=64] float32: 96 KiB per block, so
# 4 MiB chunks end mid-block
COMPAT = KVCompat("tiny-test-model", "float32", 16, 4, 3, 64)
BLOCK_BYTES = 96 * 1024
# 512-byte blocks for the capacity tests
SMALL = KVCompat("tiny-test-model", "float32", 4, 2, 1, 8)
GIB = 1 << 30


def h(i: int) -> BlockHash:
    return BlockHash(hashlib.sha256(b"block %d" % i).digest())


def random_blocks(n: int, compat: KVCompat = COMPAT, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((n, *compat.block_shape), generator=gen)


def tokens(n: int, compat: KVCompat = COMPAT) -> list[int]:
    return list(range(n * compat.block_size))


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    process = start_kvstore(tmp_path_factory.mktemp("kvstore"), "--kvstore-gib", "0.05",
                            transfer="grpc")
    try:
        wait_serving([process], timeout_s=60)
        yield process
    finally:
        stop_all([process])


def stub(channel: grpc.aio.Channel) -> kvstore_pb2_grpc.KVStoreServiceStub:
    return kvstore_pb2_grpc.KVStoreServiceStub(channel)


def test_put_lookup_get_round_trip_is_byte_identical(store: WorkerProcess):
    blocks = random_blocks(60)  # 5.6 MiB: more than one 4 MiB chunk each way

    async def main() -> tuple[int, int, int, int, torch.Tensor]:
        client = KVStoreClient(store.address, COMPAT)
        try:
            assert await client.lookup([h(i) for i in range(60)]) == 0
            stored = await client.offer_and_put([h(i) for i in range(60)], None, tokens(60), blocks)
            again = await client.offer_and_put([h(i) for i in range(60)], None, tokens(60), blocks)
            num_cached = await client.lookup([h(i) for i in (0, 1, 2, 99, 3)])
            dst = torch.zeros((61, *COMPAT.block_shape))
            order = [7, 59, 0, 12, *range(16, 60)]  # 48 blocks: 4.5 MiB
            landed = await client.get_into([h(i) for i in order], [dst[i + 1] for i in range(48)])
            return stored, again, num_cached, landed, dst[1:49]
        finally:
            await client.close()

    stored, again, num_cached, landed, got = asyncio.run(main())
    assert (stored, again, num_cached, landed) == (60, 0, 3, 48)
    assert raw(got) == raw(blocks[[7, 59, 0, 12, *range(16, 60)]])
    stats = _stats(store.address)
    assert stats.num_blocks >= 60 and stats.num_leases == 0 and not stats.has_nixl
    assert stats.bytes_out >= 48 * BLOCK_BYTES


def _stats(address: str) -> kvstore_pb2.KVStoreStats:
    with grpc.insecure_channel(address) as channel:
        return kvstore_pb2_grpc.KVStoreServiceStub(channel).GetStats(
            kvstore_pb2.KVStoreStatsRequest(), timeout=5)


def test_bad_input_gets_a_clear_error_and_the_service_keeps_serving(store: WorkerProcess):
    async def main() -> dict[str, tuple[grpc.StatusCode, str]]:
        async with grpc.aio.insecure_channel(store.address) as channel:
            kv = stub(channel)
            mine = handshake_to_proto(KVHandshake(compat=COMPAT, agent_name="t",
                                                  region=KVRegion("DRAM", 0, 0, 0, BLOCK_BYTES)))
            await kv.Handshake(mine, timeout=5)
            await kv.Put(_chunks(kvstore_pb2.KVStorePutHeader(
                compat_hash=COMPAT.hash, hashes=[h(500)], token_ids=tokens(1),
                total_bytes=BLOCK_BYTES), raw(random_blocks(1))), timeout=5)
            lying = handshake_to_proto(KVHandshake(compat=COMPAT, agent_name="t",
                                                   region=KVRegion("DRAM", 0, 0, 0, 1)))
            lying.compat_hash = "0" * 64
            flat = handshake_to_proto(KVHandshake(compat=KVCompat("m", "float32", 0, 1, 1, 1),
                                                  agent_name="t", region=KVRegion("DRAM", 0, 0, 0, 1)))
            good = {"compat_hash": COMPAT.hash, "token_ids": tokens(1), "total_bytes": BLOCK_BYTES}
            calls = {
                "handshake hash": kv.Handshake(lying, timeout=5),
                "zero block size": kv.Handshake(flat, timeout=5),
                "wrong compat": kv.Lookup(kvstore_pb2.KVStoreLookupRequest(
                    compat_hash="ab" * 32, hashes=[h(1)]), timeout=5),
                "short hash": kv.Offer(kvstore_pb2.KVStoreOfferRequest(
                    compat_hash=COMPAT.hash, hashes=[b"xyz"]), timeout=5),
                "unknown block": _drain(kv.Get(kvstore_pb2.KVStoreGetRequest(
                    compat_hash=COMPAT.hash, hashes=[h(500), h(10_000)]), timeout=5)),
                "long lease": _drain(kv.Get(kvstore_pb2.KVStoreGetRequest(
                    compat_hash=COMPAT.hash, hashes=[h(500)], lease_ms=3_600_000), timeout=5)),
                "size mismatch": kv.Put(_chunks(kvstore_pb2.KVStorePutHeader(
                    hashes=[h(501)], **{**good, "total_bytes": 100}), b"x" * 100), timeout=5),
                "short payload": kv.Put(_chunks(kvstore_pb2.KVStorePutHeader(
                    hashes=[h(502)], **good), b"x" * 100), timeout=5),
                "token count": kv.Put(_chunks(kvstore_pb2.KVStorePutHeader(
                    hashes=[h(503)], **{**good, "token_ids": [1, 2]}), b"x" * BLOCK_BYTES), timeout=5),
                "no header": kv.Put(_chunks(None, b"x"), timeout=5),
                "over capacity": kv.Put(_chunks(kvstore_pb2.KVStorePutHeader(
                    hashes=[h(i) for i in range(1000)], **{**good, "total_bytes": 1000 * BLOCK_BYTES}),
                    b""), timeout=5),
                "no nixl": kv.PrepareRead(kvstore_pb2.KVStoreReadRequest(
                    compat_hash=COMPAT.hash, hashes=[h(500)]), timeout=5),
            }
            errors = {}
            for name, call in calls.items():
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                errors[name] = (err.value.code(), err.value.details())
            reply = await kv.Lookup(kvstore_pb2.KVStoreLookupRequest(
                compat_hash=COMPAT.hash, hashes=[h(500), h(501), h(502), h(503)]), timeout=5)
            errors["after"] = (reply.num_prefix_hits, list(reply.present))
            return errors

    errors = asyncio.run(main())
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    expected = {
        "handshake hash": (invalid, "is not the hash of the compat sent"),
        "zero block size": (invalid, "Handshake: KV compat dimensions must be >= 1, got block_size=0"),
        "wrong compat": (invalid, "Lookup: unknown compat_hash 'abababababababab'"),
        "short hash": (invalid, "block hashes must be 32 bytes; entries [0] are not"),
        "unknown block": (grpc.StatusCode.NOT_FOUND, "Get: 1 of 2 blocks are not in the kvstore"),
        "long lease": (invalid, "lease must be in (0, 60.0] s"),
        "size mismatch": (invalid, "the header says total_bytes=100"),
        "short payload": (invalid, "got 100 bytes, the header says 98304"),
        "token count": (invalid, "need 16 token ids, got 2"),
        "no header": (invalid, "the first chunk must carry the header"),
        "over capacity": (invalid, "exceed the store's capacity of 53687091 bytes"),
        "no nixl": (grpc.StatusCode.FAILED_PRECONDITION, "runs without NIXL; use Get"),
    }
    for name, (code, text) in expected.items():
        assert errors[name][0] == code and text in errors[name][1], (name, errors[name])
    assert errors["after"] == (1, [True, False, False, False])  # nothing half-stored
    assert _stats(store.address).num_leases == 0  # the failed Get leaked no lease
    assert store.proc.poll() is None


async def _drain(stream) -> None:
    async for _ in stream:
        pass


async def _chunks(header: kvstore_pb2.KVStorePutHeader | None, data: bytes):
    if header is not None:
        yield kvstore_pb2.KVStorePutChunk(header=header)
    yield kvstore_pb2.KVStorePutChunk(offset=0, data=data)


@pytest.mark.slow  # two store processes: ~5 s
def test_killed_store_mid_get_and_restart_are_misses_not_errors(tmp_path):
    process = start_kvstore(tmp_path, "--kvstore-gib", "0.05", transfer="grpc")
    port = int(process.address.rsplit(":", 1)[1])
    blocks = random_blocks(8, seed=3)
    hashes = [h(1000 + i) for i in range(8)]

    async def main() -> list[int]:
        nonlocal process
        client = KVStoreClient(process.address, COMPAT, timeout_s=3.0)
        try:
            results = [await client.offer_and_put(hashes, None, tokens(8), blocks)]
            process.proc.send_signal(signal.SIGSTOP)  # the Get reaches a frozen store ...
            dst = torch.zeros((8, *COMPAT.block_shape))
            get = asyncio.ensure_future(client.get_into(hashes, list(dst)))
            await asyncio.sleep(0.3)
            process.proc.kill()  # ... that dies mid-Get
            results += [await asyncio.wait_for(get, 10), await client.lookup(hashes)]
            await asyncio.to_thread(process.proc.wait, 10)
            process = start_kvstore(tmp_path, "--kvstore-gib", "0.05", transfer="grpc", port=port)
            await asyncio.to_thread(wait_serving, [process], 60)
            await asyncio.sleep(RECONNECT_BACKOFF_MAX_MS / 1000 + 0.2)  # the channel's backoff
            # the same client: it handshakes again; the restarted store is empty: misses
            results += [await client.lookup(hashes), await client.get_into(hashes, list(dst)),
                        await client.offer_and_put(hashes[:2], None, tokens(2), blocks[:2]),
                        await client.lookup(hashes)]
            return [*results, int(dst.any())]
        finally:
            await client.close()

    try:
        wait_serving([process], timeout_s=60)
        assert asyncio.run(main()) == [8, 0, 0, 0, 0, 2, 2, 0]
    finally:
        if process.proc.poll() is None:
            process.proc.send_signal(signal.SIGCONT)
        stop_all([process])


def test_a_lease_holds_eviction_and_an_expired_lease_permits_it(tmp_path):
    """Over RPC, with PrepareRead's lease (a store with NIXL) or skipped without NIXL."""
    process = start_kvstore(tmp_path, "--kvstore-gib", str(4 * 512 / GIB), transfer="nixl")
    try:
        wait_serving([process], timeout_s=60)
        if not _stats(process.address).has_nixl:
            pytest.skip(f"the kvstore could not start NIXL here:\n{process.log_tail()}")

        async def main() -> list[object]:
            client = KVStoreClient(process.address, SMALL)
            async with grpc.aio.insecure_channel(process.address) as channel:
                kv = stub(channel)
                blocks = random_blocks(6, SMALL)
                put = [lambda i=i: client.offer_and_put([h(i)], None, tokens(1, SMALL), blocks[i:i + 1])
                       for i in range(6)]
                for i in range(3):
                    await put[i]()
                lease = await kv.PrepareRead(kvstore_pb2.KVStoreReadRequest(
                    compat_hash=SMALL.hash, hashes=[h(0), h(1), h(2)], lease_ms=800), timeout=5)
                # 3 fits under capacity; 4 evicts 3, the only unleased block
                results: list[object] = [await put[3](), await put[4]()]
                results.append(await client.lookup([h(i) for i in range(5)]))
                await asyncio.sleep(1.0)
                results.append(await put[5]())  # the lease expired: LRU 0 and 1 go
                present = await kv.Lookup(kvstore_pb2.KVStoreLookupRequest(
                    compat_hash=SMALL.hash, hashes=[h(i) for i in range(6)]), timeout=5)
                results.append(list(present.present))
                results.append((await kv.Release(kvstore_pb2.KVStoreReleaseRequest(
                    lease_id=lease.lease_id), timeout=5)).released)
            await client.close()
            return results

        started = time.monotonic()
        assert asyncio.run(main()) == [1, 1, 3, 1, [False, False, True, False, True, True], False]
        assert time.monotonic() - started < 20
    finally:
        stop_all([process])


def test_client_rejects_a_caller_bug_with_a_clear_error_and_sends_nothing(store: WorkerProcess):
    async def main() -> None:
        client = KVStoreClient(store.address, COMPAT)
        try:
            with pytest.raises(ValueError, match=r"blocks must be \[2, \*\(4, 2, 16, 3, 64\)\]"):
                await client.offer_and_put([h(7000), h(7001)], None, tokens(2), random_blocks(1))
            with pytest.raises(ValueError, match="need 32 token ids, got 3"):
                await client.offer_and_put([h(7000), h(7001)], None, [1, 2, 3], random_blocks(2))
            with pytest.raises(ValueError, match="one block of 98304 bytes"):
                await client.get_into([h(7000)], [torch.zeros(3)])
            assert await client.lookup([h(7000)]) == 0
        finally:
            await client.close()

    asyncio.run(main())

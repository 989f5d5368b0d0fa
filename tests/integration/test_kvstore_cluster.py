"""The kvstore tier through real processes: ``pdserve serve kvstore --transfer nixl`` + one prefill
and one decode worker started with ``--kvstore-address``, tiny pools (4 device blocks of 8 tokens,
a host tier of 3 blocks), so that a prefix is pushed out of a worker's device and host tiers into
the kvstore. Running it again loads it back from the kvstore (seen in ``WorkerStats.tiers``, not
in logs) and greedy output is token for token the cold run's. The workers move KV over NIXL; the
prefill worker loads from the kvstore over NIXL too (``--kvstore-transfer auto``), the decode
worker over gRPC Get (``--kvstore-transfer grpc``): the KVSTORE tier's loaded bytes are all NIXL
on one and all gRPC on the other (where NIXL cannot load, everything uses gRPC)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from engine.sampling_params import SamplingParams
from services.common.pb import kvstore_pb2, kvstore_pb2_grpc, worker_pb2
from services.router.backends.disaggregated import DisaggregatedBackend
from tests.integration.cluster_fixtures import (
    WorkerProcess,
    start_kvstore,
    start_worker,
    stop_all,
    wait_all_blocks_free,
    wait_serving,
)
from tests.integration.test_kv_transfer import nixl_import_error

pytestmark = pytest.mark.slow

BS = 8
BLOCK_BYTES = 30 * 2 * BS * 3 * 64 * 4  # SmolLM2: layers x K,V x tokens x kv heads x head_dim x fp32
PROMPTS = {name: [(k * i + off) % 4000 + 100 for i in range(28)]  # 3 full blocks + 4 tokens each
           for name, k, off in (("a", 7, 3), ("b", 11, 5), ("c", 13, 9))}
GREEDY = SamplingParams(temperature=0.0, max_tokens=3)


def kvstore_blocks(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return kvstore_pb2_grpc.KVStoreServiceStub(channel).GetStats(
            kvstore_pb2.KVStoreStatsRequest(), timeout=5).num_blocks


def tier(worker: WorkerProcess, which: int) -> worker_pb2.TierStats:
    return next(t for t in worker.stats().tiers if t.tier == which)


def test_a_prefix_evicted_from_device_and_host_comes_back_from_the_kvstore(tmp_path):
    has_nixl = nixl_import_error() is None  # without NIXL, both load over gRPC
    store = start_kvstore(tmp_path, "--kvstore-gib", "0.05", transfer="nixl" if has_nixl else "grpc")
    common = ["--kvstore-address", store.address, "--kvstore-lookup-ms", "500", "--block-size", str(BS),
              "--num-kv-blocks", "4", "--cpu-offload-gb", repr(3 * BLOCK_BYTES / 2**30)]
    # KV between the workers over NIXL too: the prefill worker runs two agents (sender, kvstore reader)
    transfer = "nixl" if has_nixl else "grpc"
    prefill = start_worker("prefill", tmp_path, *common, "--kvstore-transfer", "auto", transfer=transfer)
    decode = start_worker("decode", tmp_path, *common, "--kvstore-transfer", "grpc", transfer=transfer)

    async def run(name: str) -> list[int]:
        backend = DisaggregatedBackend([prefill.address], [decode.address], transfer, poll_interval_s=0.2)
        await backend.start()
        try:
            tokens: list[int] = []
            async for event in backend.generate(f"{name}-{time.monotonic_ns()}", PROMPTS[name], GREEDY):
                tokens += event.token_ids
            return tokens
        finally:
            await backend.close()

    try:
        wait_serving([store, prefill, decode])
        cold = {name: asyncio.run(asyncio.wait_for(run(name), 120)) for name in PROMPTS}
        assert all(len(tokens) == 3 for tokens in cold.values())
        # C pushed A out of both workers' device (B) and host tiers: the store has A's 3 blocks
        # (once: both workers push the same hashes). The pushes are asynchronous: wait for them.
        def pushed() -> bool:
            return kvstore_blocks(store.address) >= 3 and all(
                tier(w, worker_pb2.CACHE_TIER_KVSTORE).num_offloaded_bytes > 0 for w in (prefill, decode))

        deadline = time.monotonic() + 30
        while not pushed() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert kvstore_blocks(store.address) >= 3
        before = [tier(w, worker_pb2.CACHE_TIER_KVSTORE) for w in (prefill, decode)]
        assert asyncio.run(asyncio.wait_for(run("a"), 120)) == cold["a"]
        after = [tier(w, worker_pb2.CACHE_TIER_KVSTORE) for w in (prefill, decode)]
        hits = [a.num_hit_blocks - b.num_hit_blocks for a, b in zip(after, before)]
        loaded = [a.num_loaded_bytes - b.num_loaded_bytes for a, b in zip(after, before)]
        assert hits[0] == 3, f"prefill kvstore tier {after[0]}"  # A's 3 full blocks, from the store
        assert loaded == [h * BLOCK_BYTES for h in hits]
        by_transport = [(a.num_loaded_bytes_nixl - b.num_loaded_bytes_nixl,
                         a.num_loaded_bytes_grpc - b.num_loaded_bytes_grpc) for a, b in zip(after, before)]
        assert by_transport == [(loaded[0], 0) if has_nixl else (0, loaded[0]), (0, loaded[1])], by_transport
        assert all(a.num_offloaded_bytes > 0 for a in after)
        seen = wait_all_blocks_free([prefill, decode], timeout_s=5)
        assert all(free == total for free, total in seen.values()), f"blocks in use: {seen}"
    finally:
        stop_all([prefill, decode, store])

"""``KVStoreTier`` loading over NIXL, between real processes: a ``pdserve serve kvstore`` child and a
spawned worker-like child that runs the tier (``transfer="nixl"``, a staging region of 2 blocks,
so a load of 5 goes in 3 chunks) over loopback UCX. No model: a small KV compat.

One store after another, on the same port, the tier in the child throughout:

1. a NIXL store: offered blocks come back byte for byte into arbitrary host slots over NIXL,
   counted as NIXL bytes; a load with a block the store lacks lands nothing; every lease is
   released; a PrepareRead with a wrong compat hash is refused and the store keeps serving; a
   worker process that dies holding a read lease does not pin the blocks past the lease;
2. a NIXL store that SIGKILLs itself when the first Release arrives (the READ ran, the lease is
   still held): the load is a miss, nothing is copied into the host slots, the staging region
   is free again (not busy, not tainted) and a later load is a fast miss;
3. a store without NIXL: the same tier loads over gRPC Get, counted as gRPC bytes.

This test process never imports NIXL (its libprotobuf must not meet grpc's)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import subprocess
import sys
import time

import grpc
import pytest
import torch

from engine.kv_cache.hashing import hash_request_blocks
from services.common.pb import kvstore_pb2, kvstore_pb2_grpc
from tests.integration.cluster_fixtures import REPO, start_kvstore, stop_all, wait_serving
from tests.integration.test_kv_transfer import nixl_import_error
from tests.integration.test_kvstore_service import BLOCK_BYTES, COMPAT, _stats, random_blocks, raw

pytestmark = pytest.mark.slow  # three store processes and a NIXL child: ~15 s

SPAWN = mp.get_context("spawn")
NUM_BLOCKS = 5
HASHES = hash_request_blocks(list(range(NUM_BLOCKS * COMPAT.block_size)), COMPAT.block_size)
SLOTS = [6, 1, 2, 7, 0]  # host slots the blocks land in: runs and gaps
NUM_SLOTS = 8


def _offer_until_held(tier, blocks: torch.Tensor, timeout_s: float = 20.0) -> bool:
    """Offer the chain (again every second: a restarted store drops the first put) until the
    store holds all of it."""
    from engine.kv_cache.tiers.lower_tier import EvictedBlock

    evicted = [EvictedBlock(h, HASHES[i - 1] if i else None,
                            tuple(range(i * COMPAT.block_size, (i + 1) * COMPAT.block_size)), blocks[i])
               for i, h in enumerate(HASHES)]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        tier.offer(evicted)
        for _ in range(20):
            if tier.match(HASHES) == NUM_BLOCKS:
                return True
            time.sleep(0.05)
    return False


def _tier_main(conn, address: str) -> None:
    """Spawned: the tier; one phase per "go" from the test, each reported back."""
    os.environ["UCX_NET_DEVICES"] = "lo"
    from services.worker.kvstore_tier import KVStoreTier, KVStoreTierConfig

    tier = KVStoreTier(KVStoreTierConfig(address, lookup_budget_s=2.0, load_budget_s=5.0,
                                         transfer="nixl", staging_blocks=2))
    tier.start(COMPAT)
    try:
        blocks = random_blocks(NUM_BLOCKS, seed=11)
        while conn.poll(120) and (phase := conn.recv()) != "stop":
            held = _offer_until_held(tier, blocks)
            dst = torch.zeros((NUM_SLOTS, *COMPAT.block_shape))
            started = time.monotonic()
            num_landed = tier.load(HASHES, dst, SLOTS)
            seconds = time.monotonic() - started
            report = {"phase": phase, "held": held, "landed": num_landed, "seconds": seconds,
                      "equal": all(raw(dst[s]) == raw(blocks[i]) for i, s in enumerate(SLOTS)),
                      "untouched": not dst.any(), "transport": tier.transport}
            if phase == "nixl":
                missing = [HASHES[0], bytes(32), HASHES[2]]  # the first chunk lacks its second block
                report["missing"] = tier.load(missing, torch.zeros((NUM_SLOTS, *COMPAT.block_shape)), [3, 4, 5])
            if phase == "killed":
                staging = tier._nixl.staging if tier._nixl is not None else None
                report["staging_free"] = staging is not None and not staging.busy and not staging.is_tainted
                started = time.monotonic()
                report["after_kill"] = tier.load(HASHES, dst, SLOTS)
                report["after_kill_s"] = time.monotonic() - started
            report["counters"] = dict(
                (name, getattr(tier.counters, name)) for name in tier.counters.__slots__)
            conn.send(report)
    finally:
        tier.close()


def _prepare_read_wrong_compat(address: str) -> tuple[grpc.StatusCode, str]:
    async def call() -> tuple[grpc.StatusCode, str]:
        async with grpc.aio.insecure_channel(address) as channel:
            try:
                await kvstore_pb2_grpc.KVStoreServiceStub(channel).PrepareRead(
                    kvstore_pb2.KVStoreReadRequest(compat_hash="cd" * 32, hashes=[HASHES[0]]), timeout=5)
            except grpc.aio.AioRpcError as error:
                return error.code(), error.details() or ""
        return grpc.StatusCode.OK, ""
    return asyncio.run(call())


DYING_READER = """
import os, sys
import grpc
from services.common.pb import kvstore_pb2, kvstore_pb2_grpc
with grpc.insecure_channel(sys.argv[1]) as channel:
    lease = kvstore_pb2_grpc.KVStoreServiceStub(channel).PrepareRead(kvstore_pb2.KVStoreReadRequest(
        compat_hash=sys.argv[2], hashes=[bytes.fromhex(sys.argv[3])], lease_ms=600), timeout=10)
print(lease.lease_id, flush=True)
os._exit(0)  # dies holding the lease
"""


def _die_holding_a_lease(address: str) -> None:
    subprocess.run([sys.executable, "-c", DYING_READER, address, COMPAT.hash, HASHES[0].hex()],
                   check=True, timeout=60, capture_output=True, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": str(REPO)})


def test_the_tier_loads_over_nixl_and_a_store_killed_mid_read_is_a_miss(tmp_path):
    if nixl_import_error() is not None:
        pytest.skip(f"NIXL is not importable here: {nixl_import_error()}")
    store = start_kvstore(tmp_path, "--kvstore-gib", "0.05", transfer="nixl")
    port = int(store.address.rsplit(":", 1)[1])
    conn, child_conn = SPAWN.Pipe()
    child = SPAWN.Process(target=_tier_main, args=(child_conn, store.address), daemon=True)
    reports = {}

    def phase(name: str) -> dict:
        conn.send(name)
        assert conn.poll(90), f"the tier child did not report phase {name}"
        reports[name] = conn.recv()
        return reports[name]

    try:
        wait_serving([store], timeout_s=60)
        assert _stats(store.address).has_nixl, store.log_tail()
        child.start()

        nixl = phase("nixl")
        stats = _stats(store.address)
        refused = _prepare_read_wrong_compat(store.address)
        assert _stats(store.address).num_leases == 0 and store.proc.poll() is None
        _die_holding_a_lease(store.address)
        held_by_the_dead = _stats(store.address).num_leases
        time.sleep(0.8)
        after_expiry = _stats(store.address)

        stop_all([store])
        store = start_kvstore(tmp_path, "--kvstore-gib", "0.05", transfer="nixl", port=port,
                              env={"PDSERVE_FAULTS": "kill:kvstore:at_release=1"})
        wait_serving([store], timeout_s=60)
        killed = phase("killed")
        assert store.proc.wait(10) == -9, store.log_tail()  # it died at the Release

        store = start_kvstore(tmp_path, "--kvstore-gib", "0.05", transfer="grpc", port=port)
        wait_serving([store], timeout_s=60)
        grpc_phase = phase("grpc")
        conn.send("stop")
    finally:
        if child.is_alive():
            child.join(20)
        if child.is_alive():
            child.kill()
        stop_all([store])

    # 1. NIXL: byte-identical, in 3 leases (2 + 2 + 1 blocks), all released; a miss lands nothing
    assert (nixl["held"], nixl["landed"], nixl["equal"], nixl["transport"]) == (True, 5, True, "nixl"), nixl
    assert nixl["missing"] == 0
    c = nixl["counters"]
    assert (c["num_nixl_loaded_blocks"], c["num_nixl_loaded_bytes"]) == (5, 5 * BLOCK_BYTES), c
    assert (c["num_grpc_loaded_bytes"], c["num_abandoned_reads"], c["num_load_timeouts"]) == (0, 0, 0), c
    assert stats.num_leases == 0 and stats.num_leases_granted == 3, stats
    assert refused[0] == grpc.StatusCode.INVALID_ARGUMENT and "unknown compat_hash 'cdcdcdcdcdcdcdcd'" in refused[1]
    assert held_by_the_dead == 1 and after_expiry.num_leases == 0, after_expiry
    assert after_expiry.num_leases_expired == stats.num_leases_expired + 1, after_expiry

    # 2. killed at the first Release: a miss, no byte copied, the staging region free again
    assert killed["held"] and killed["landed"] == 0 and killed["untouched"], killed
    assert killed["staging_free"] and killed["transport"] == "nixl", killed
    assert killed["after_kill"] == 0 and killed["after_kill_s"] < 5.0, killed
    assert killed["counters"]["num_nixl_loaded_bytes"] == 5 * BLOCK_BYTES  # unchanged since phase 1

    # 3. a store without NIXL: the same tier loads over gRPC
    assert (grpc_phase["held"], grpc_phase["landed"], grpc_phase["equal"]) == (True, 5, True), grpc_phase
    c = grpc_phase["counters"]
    assert (c["num_grpc_loaded_blocks"], c["num_grpc_loaded_bytes"]) == (5, 5 * BLOCK_BYTES), c
    assert c["num_nixl_loaded_bytes"] == 5 * BLOCK_BYTES and c["num_abandoned_reads"] == 0, c


def _stalled_main(conn, address: str) -> None:
    """Spawned: four loads from a store that drives no UCX progress (over tcp, READs wait)."""
    os.environ.update({"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp"})
    from services.worker.kvstore_tier import KVStoreTier, KVStoreTierConfig

    tier = KVStoreTier(KVStoreTierConfig(address, lookup_budget_s=2.0, load_budget_s=0.5,
                                         transfer="nixl", staging_blocks=8))
    tier.start(COMPAT)
    try:
        blocks = random_blocks(NUM_BLOCKS, seed=12)
        results: list[object] = [_offer_until_held(tier, blocks)]
        regions = []
        for _ in range(4):
            loader = tier._nixl
            assert loader is not None
            regions.append(id(loader.staging))
            dst = torch.zeros((NUM_SLOTS, *COMPAT.block_shape))
            num_landed = tier.load(HASHES, dst, SLOTS)
            equal = all(raw(dst[s]) == raw(blocks[i]) for i, s in enumerate(SLOTS))
            deadline = time.monotonic() + 10  # the abandoned read releases its lease, then frees
            while loader.staging is not None and loader.staging.busy and time.monotonic() < deadline:
                time.sleep(0.05)
            results.append((num_landed, equal if num_landed else not dst.any(),
                            tier.counters.num_abandoned_reads, tier.transport,
                            tier.counters.num_grpc_loaded_blocks))
        results.append(len(set(regions)))
        conn.send(results)
    finally:
        tier.close()


def test_a_read_stalled_past_the_budget_is_abandoned_and_its_staging_region_never_reused(tmp_path, monkeypatch):
    """A READ still in progress at the load budget is abandoned: nothing copied, the region is
    parked and a fresh one made; after MAX_PARKED (2) such regions the tier loads over gRPC."""
    if nixl_import_error() is not None:
        pytest.skip(f"NIXL is not importable here: {nixl_import_error()}")
    monkeypatch.setenv("UCX_TLS", "tcp")  # the store inherits it: its READs need its progress
    store = start_kvstore(tmp_path, "--kvstore-gib", "0.05", transfer="nixl",
                          env={"PDSERVE_FAULTS": "kvstore:progress_delay_ms=60000"})
    conn, child_conn = SPAWN.Pipe()
    child = SPAWN.Process(target=_stalled_main, args=(child_conn, store.address), daemon=True)
    try:
        wait_serving([store], timeout_s=60)
        child.start()
        assert conn.poll(120), "the tier child did not report"
        results = conn.recv()
        stats = _stats(store.address)
    finally:
        child.join(20)
        if child.is_alive():
            child.kill()
        stop_all([store])
    assert results[0], "the store never held the offered blocks"
    assert results[1:5] == [(0, True, 1, "nixl", 0), (0, True, 2, "nixl", 0), (0, True, 3, "grpc", 0),
                            (5, True, 3, "grpc", 5)], results
    assert results[5] == 4  # three regions, each used once, then none (gRPC)
    assert stats.num_leases == 0 and stats.num_leases_granted == 4, stats  # 3 PrepareRead + the Get

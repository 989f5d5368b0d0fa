"""The index's Lua scripts against a real redis-server: apply results, fencing, snapshots with
generations, match over live leases, reservations, removal without SCAN."""

from __future__ import annotations

import time

import pytest
import redis

from services.index.schema import IndexMeta, IndexMetaMismatch, WorkerInfo
from services.index.scripts import IndexScripts

META = IndexMeta("smollm2", "0123456789abcdef" * 4, 16)
H = [f"{i:064x}" for i in range(1, 9)]


@pytest.fixture
def scripts(redis_server) -> IndexScripts:
    return IndexScripts(redis.Redis.from_url(redis_server.url), META)


def blocks(scripts: IndexScripts, wid: str) -> dict[str, str]:
    """hash hex -> "<epoch>:<mask>" of every block entry of ``wid``."""
    out = {}
    for h in scripts.client.smembers(META.scope + f"wb:{wid}"):
        value = scripts.client.hget(META.scope + "b:" + h.decode(), wid)
        out[h.decode()] = value.decode()
    return out


def test_scope_names_model_and_compat_prefix():
    assert META.scope == "pds:v1:{smollm2:01234567}:"


def test_apply_ok_dup_gap_fenced(scripts):
    scripts.register(WorkerInfo("p0", "prefill"), "e1", 5000)
    assert scripts.apply("p0", "e1", 1, [("S", H[0], 1), ("S", H[1], 1)]) == "OK"
    assert scripts.apply("p0", "e1", 1, [("S", H[0], 1), ("S", H[1], 1)]) == "DUP"
    assert scripts.apply("p0", "e1", 5, [("S", H[2], 1)]) == "GAP"
    assert scripts.apply("p0", "e0", 3, [("R", H[0], 1)]) == "FENCED"
    assert blocks(scripts, "p0") == {H[0]: "e1:1", H[1]: "e1:1"}
    # A batch overlapping what was applied applies only its new tail.
    assert scripts.apply("p0", "e1", 2, [("R", H[1], 1), ("S", H[2], 2)]) == "OK"
    assert blocks(scripts, "p0") == {H[0]: "e1:1", H[1]: "e1:1", H[2]: "e1:2"}


def test_tier_masks_combine_and_clear(scripts):
    scripts.register(WorkerInfo("p0", "prefill"), "e1", 5000)
    ops = [("S", H[0], 1), ("S", H[0], 2), ("S", H[1], 4), ("R", H[0], 1)]
    assert scripts.apply("p0", "e1", 1, ops) == "OK"
    assert blocks(scripts, "p0") == {H[0]: "e1:2", H[1]: "e1:4"}
    assert scripts.apply("p0", "e1", 5, [("C", "", 2)]) == "OK"
    assert blocks(scripts, "p0") == {H[1]: "e1:4"}
    assert scripts.apply("p0", "e1", 6, [("C", "", 7)]) == "OK"
    assert blocks(scripts, "p0") == {}
    assert scripts.client.keys(META.scope + "b:*") == []


def test_match_walks_the_chain_and_splits_by_fastest_tier(scripts):
    scripts.register(WorkerInfo("p0", "prefill", grpc="127.0.0.1:7001"), "e1", 5000)
    scripts.register(WorkerInfo("d0", "decode"), "e2", 5000)
    scripts.apply("p0", "e1", 1, [("S", H[0], 1), ("S", H[1], 3), ("S", H[2], 2), ("S", H[4], 1)])
    scripts.apply("d0", "e2", 1, [("S", H[0], 4), ("S", H[2], 1)])  # d0 lacks H[1]: run stops at 1
    scripts.heartbeat("p0", "e1", 5000, {"running": 2, "waiting": 1, "kv_usage": 0.25})
    found = scripts.match(H[:6])
    p0, d0 = found["p0"], found["d0"]
    assert (p0.num_device_blocks, p0.num_host_blocks, p0.num_kvstore_blocks) == (2, 1, 0)
    assert p0.num_matched_blocks == 3
    assert (p0.num_running, p0.num_waiting, p0.kv_usage, p0.role) == (2, 1, 0.25, "prefill")
    assert (p0.grpc_address, d0.grpc_address) == ("127.0.0.1:7001", "")
    assert (d0.num_device_blocks, d0.num_host_blocks, d0.num_kvstore_blocks) == (0, 0, 1)
    assert scripts.match([H[7]])["p0"].num_matched_blocks == 0  # live workers always listed


def test_a_batch_of_lookups_answers_each_chain_as_its_own_lookup(scripts):
    scripts.register(WorkerInfo("p0", "prefill", grpc="127.0.0.1:7001"), "e1", 5000)
    scripts.register(WorkerInfo("d0", "decode"), "e2", 5000)
    scripts.apply("p0", "e1", 1, [("S", H[0], 1), ("S", H[1], 3), ("S", H[2], 2), ("S", H[4], 1)])
    scripts.apply("d0", "e2", 1, [("S", H[0], 4), ("S", H[2], 1)])
    scripts.heartbeat("d0", "e2", 5000, {"running": 3, "kv_usage": 0.5})
    scripts.reserve("d0", "req-1", 60_000)
    chains = [H[:6], [H[7]], [], H[:1], H[2:4], H[:3], [H[1], H[0]]]
    batched = scripts.match_many(chains)
    assert batched == [scripts.match(chain) for chain in chains]
    assert [b["p0"].num_matched_blocks for b in batched] == [3, 0, 0, 1, 1, 3, 2]
    assert [b["d0"].num_matched_blocks for b in batched] == [1, 0, 0, 1, 1, 1, 0]
    assert {(b["d0"].num_reserved, b["d0"].num_running, b["d0"].kv_usage) for b in batched} == {(1, 3, 0.5)}
    assert scripts.match_many([]) == []


def test_reservations_in_one_pipeline_run_in_order(scripts):
    scripts.register(WorkerInfo("d0", "decode"), "e1", 5000)
    ops = [("reserve", "d0", "a"), ("reserve", "d0", "b"), ("release", "d0", "a"), ("release", "d0", "a"),
           ("reserve", "d0", "c")]
    assert scripts.reservations(ops, 60_000) == [1, 2, 1, 0, 2]
    assert scripts.match([])["d0"].num_reserved == 2
    with pytest.raises(ValueError, match="reserve or release"):
        scripts.reservations([("hold", "d0", "x")], 60_000)


def test_new_epoch_hides_and_drops_old_entries(scripts):
    scripts.register(WorkerInfo("p0", "prefill"), "e1", 5000)
    scripts.apply("p0", "e1", 1, [("S", H[0], 1)])
    scripts.register(WorkerInfo("p0", "prefill"), "e2", 5000)  # the worker restarted
    assert scripts.match(H[:1])["p0"].num_matched_blocks == 0
    assert blocks(scripts, "p0") == {}
    assert scripts.apply("p0", "e1", 2, [("S", H[1], 1)]) == "FENCED"  # the old process is fenced
    assert scripts.heartbeat("p0", "e1", 5000, {}) == "FENCED"


def test_lease_expiry_hides_a_dead_worker_and_reap_removes_it(scripts):
    scripts.register(WorkerInfo("p0", "prefill"), "e1", 150)
    scripts.register(WorkerInfo("p1", "prefill"), "e9", 5000)
    scripts.apply("p0", "e1", 1, [("S", H[0], 1)])
    assert scripts.match(H[:1])["p0"].num_matched_blocks == 1
    time.sleep(0.3)
    assert "p0" not in scripts.match(H[:1])
    assert scripts.reap() == 1
    assert scripts.client.keys(META.scope + "b:*") == []
    assert scripts.client.smembers(META.scope + "workers") == {b"p1"}


def test_remove_drops_only_its_own_incarnation(scripts):
    scripts.register(WorkerInfo("p0", "prefill"), "e1", 5000)
    scripts.apply("p0", "e1", 1, [("S", H[0], 1), ("S", H[1], 1)])
    assert scripts.remove("p0", "e0") == "FENCED"
    assert scripts.remove("p0", "e1") == "OK"
    assert scripts.client.keys("*") == [(META.scope + "meta").encode()]


def test_snapshot_replaces_entries(scripts):
    scripts.register(WorkerInfo("p0", "prefill"), "e1", 5000)
    scripts.apply("p0", "e1", 1, [("S", H[0], 1), ("S", H[1], 1)])
    assert scripts.snapshot("p0", "e1", 7, [(H[1], 2), (H[2], 1)], chunk_size=1) == "OK"
    assert blocks(scripts, "p0") == {H[1]: "e1:2", H[2]: "e1:1"}
    assert scripts.apply("p0", "e1", 8, [("S", H[3], 1)]) == "OK"  # events resume after seq_at
    assert scripts.apply("p0", "e1", 8, [("S", H[3], 1)]) == "DUP"


def test_stale_snapshot_loses_to_newer_snapshot_and_newer_events(scripts):
    scripts.register(WorkerInfo("p0", "prefill"), "e1", 5000)
    old_gen = scripts.snapshot_begin("p0", "e1")
    assert scripts.snapshot_chunk("p0", "e1", old_gen, [H[0], 1]) == "OK"
    assert scripts.snapshot("p0", "e1", 3, [(H[1], 1)]) == "OK"          # a newer snapshot wins
    assert scripts.apply("p0", "e1", 4, [("S", H[2], 1)]) == "OK"        # then newer events
    assert scripts.snapshot_chunk("p0", "e1", old_gen, [H[5], 1]) == "STALE"
    assert scripts.snapshot_commit("p0", "e1", old_gen, 2) == "STALE"
    gen = scripts.snapshot_begin("p0", "e1")
    assert scripts.snapshot_commit("p0", "e1", gen, 3) == "STALE"        # older than seq 4
    assert blocks(scripts, "p0") == {H[1]: "e1:1", H[2]: "e1:1"}


def test_reservations_are_shared_and_expire(scripts):
    scripts.register(WorkerInfo("p0", "prefill"), "e1", 5000)
    assert scripts.reserve("p0", "req-a", 5000) == 1
    assert scripts.reserve("p0", "req-b", 100) == 2
    assert scripts.match([])["p0"].num_reserved == 2
    time.sleep(0.2)
    assert scripts.match([])["p0"].num_reserved == 1
    assert scripts.release("p0", "req-a") is True
    assert scripts.release("p0", "req-a") is False
    assert scripts.match([])["p0"].num_reserved == 0


def test_meta_mismatch_is_refused(scripts):
    scripts.register(WorkerInfo("p0", "prefill"), "e1", 5000)
    other = IndexScripts(scripts.client, IndexMeta("smollm2", META.compat_hash, 16, hash_seed="x"))
    with pytest.raises(IndexMetaMismatch, match="hash_seed"):
        other.register(WorkerInfo("p1", "prefill"), "e2", 5000)
    assert scripts.client.smembers(META.scope + "workers") == {b"p0"}


def test_scripts_reload_after_redis_restart(scripts, redis_server):
    scripts.register(WorkerInfo("p0", "prefill"), "e1", 5000)
    redis_server.kill()
    redis_server.restart()  # empty: no scripts cached, no keys
    assert scripts.apply("p0", "e1", 1, [("S", H[0], 1)]) == "FENCED"
    assert scripts.match(H[:1]) == {}


def test_one_janitor_per_lock_period(scripts):
    scripts.register(WorkerInfo("p0", "prefill"), "e1", 100)
    time.sleep(0.2)
    assert scripts.reap(lock_ms=5000) == 1
    assert scripts.reap(lock_ms=5000) == -1  # another janitor reaped within the period

"""IndexPublisher against a real redis-server: events reach the index, GAP and overflow resync by
snapshot, a flushed or restarted Redis is rebuilt within two heartbeats, Redis down never raises,
a newer process with the same worker id fences the old one, close removes the entries."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis

from engine.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, Tier
from engine.kv_cache.hashing import BlockHash
from services.index.publisher import IndexPublisher, PublisherConfig
from services.index.schema import IndexMeta, IndexMetaMismatch, WorkerInfo
from services.index.scripts import IndexScripts

META = IndexMeta("smollm2", "0123456789abcdef" * 4, 4)
FAST = PublisherConfig(flush_interval_s=0.005, heartbeat_s=0.2, lease_ms=600,
                       min_backoff_s=0.05, max_backoff_s=0.2)
H = [BlockHash(bytes([i]) * 32) for i in range(1, 17)]


def wait_for(condition: Callable[[], bool], timeout_s: float = 3.0) -> float:
    """Seconds until ``condition()`` held; fails the test after ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if condition():
            return time.monotonic() - start
        time.sleep(0.01)
    pytest.fail(f"condition not met within {timeout_s} s")


class Worker:
    """A worker's truth (hash -> tier mask) and its publisher."""

    def __init__(self, url: str, worker_id: str = "p0", config: PublisherConfig = FAST) -> None:
        self.truth: dict[BlockHash, int] = {}
        self.publisher = IndexPublisher(url, META, WorkerInfo(worker_id, "prefill"),
                                        lambda: dict(self.truth), lambda: {"running": 1},
                                        config)

    def store(self, hashes: list[BlockHash], tier: Tier = Tier.DEVICE) -> None:
        for h in hashes:
            self.truth[h] = self.truth.get(h, 0) | tier
        self.publisher.publish([BlockStored(hashes, None, [0] * 4 * len(hashes), 4, tier)])

    def remove(self, hashes: list[BlockHash], tier: Tier = Tier.DEVICE) -> None:
        for h in hashes:
            self.truth[h] &= ~tier
            if not self.truth[h]:
                del self.truth[h]
        self.publisher.publish([BlockRemoved(hashes, tier)])


@pytest.fixture
def index(redis_server) -> IndexScripts:
    return IndexScripts(redis.Redis.from_url(redis_server.url), META)


def held(index: IndexScripts, wid: str = "p0") -> dict[BlockHash, int]:
    """The worker's entries now. Not atomic against a running publisher: an entry removed
    between the two reads is left out (callers poll until the state they expect)."""
    out = {}
    for h in index.client.smembers(META.scope + f"wb:{wid}"):
        value = index.client.hget(META.scope + "b:" + h.decode(), wid)
        if value is not None:
            out[BlockHash(bytes.fromhex(h.decode()))] = int(value.decode().rsplit(":", 1)[1])
    return out


def test_events_reach_the_index_in_batches(redis_server, index):
    worker = Worker(redis_server.url)
    worker.publisher.start()
    try:
        worker.store(H[:4])
        worker.store(H[2:3], Tier.HOST)
        worker.remove(H[3:4])
        wait_for(lambda: held(index) == worker.truth)
        match = index.match([h.hex() for h in H[:4]])["p0"]
        assert (match.num_device_blocks, match.num_host_blocks, match.num_running) == (3, 0, 1)
        worker.truth.clear()
        worker.publisher.publish([AllBlocksCleared(None)])
        wait_for(lambda: held(index) == {})
        assert worker.publisher.counts.get("gap", 0) == 0
    finally:
        worker.publisher.close()
    assert index.client.smembers(META.scope + "workers") == set()


def test_gap_resyncs_by_snapshot(redis_server, index):
    worker = Worker(redis_server.url)
    worker.publisher.start()
    try:
        worker.store(H[:2])
        wait_for(lambda: held(index) == worker.truth and worker.publisher.is_synced)
        index.client.hset(META.scope + "w:p0", "last_seq", 0)  # as if Redis missed batches
        index.client.hdel(META.scope + "b:" + H[0].hex(), "p0")
        index.client.srem(META.scope + "wb:p0", H[0].hex())
        worker.store(H[2:3])
        wait_for(lambda: held(index) == worker.truth and worker.publisher.is_synced)
        assert worker.publisher.counts["gap"] == 1
        # resyncs by cause (pdserve_index_resync_total{reason}): the first snapshot, then the gap's
        assert worker.publisher.counts["resync_start"] == 1 and worker.publisher.counts["resync_gap"] == 1
    finally:
        worker.publisher.close()


def test_queue_overflow_becomes_a_snapshot(redis_server, index):
    config = PublisherConfig(flush_interval_s=0.005, heartbeat_s=0.2, lease_ms=600, max_batch_ops=2,
                             max_queue_ops=4, min_backoff_s=0.05, max_backoff_s=0.2)
    worker = Worker(redis_server.url, config=config)
    worker.publisher.start()
    try:
        worker.store(H[:10])
        wait_for(lambda: held(index) == worker.truth and worker.publisher.is_synced)
        assert worker.publisher.counts["overflow"] == 1
        assert worker.publisher.counts.get("resync_overflow", 0) >= 1
    finally:
        worker.publisher.close()


def test_a_snapshot_being_sent_is_not_synced(redis_server, index):
    """is_synced turns true once the snapshot is in Redis and counted, not when it begins (a
    test that waited for is_synced then read the counts once saw the snapshot still in flight,
    on a loaded machine)."""
    import threading
    reading, release = threading.Event(), threading.Event()
    worker = Worker(redis_server.url)
    truth = worker.publisher._holdings

    def slow_holdings() -> dict[BlockHash, int]:
        reading.set()
        assert release.wait(10)
        return truth()

    worker.publisher._holdings = slow_holdings
    worker.store(H[:2])
    worker.publisher.start()
    try:
        assert reading.wait(10), "the publisher never began its snapshot"
        assert not worker.publisher.is_synced  # the flag is cleared, the snapshot not sent
        release.set()
        wait_for(lambda: worker.publisher.is_synced)
        assert worker.publisher.counts.get("resync_start") == 1
        assert held(index) == worker.truth
    finally:
        release.set()
        worker.publisher.close()


@pytest.mark.parametrize("outage", ["flush", "restart"])
def test_index_rebuilt_within_two_heartbeats(redis_server, index, outage):
    """Counted in the publisher's own heartbeats, not in wall time: on a loaded machine (another
    xdist worker computing) its thread runs late, and 0.54 s was once measured against 0.5."""
    worker = Worker(redis_server.url)
    publisher = worker.publisher
    beats: list[float] = []  # the publisher thread's heartbeats that reached Redis
    snapshots_at: list[int] = []  # how many there had been at each snapshot
    heartbeat, snapshot = publisher._heartbeat, publisher._snapshot

    def counted_heartbeat() -> None:
        heartbeat()
        beats.append(time.monotonic())

    def counted_snapshot() -> None:
        snapshot()
        snapshots_at.append(len(beats))

    publisher._heartbeat, publisher._snapshot = counted_heartbeat, counted_snapshot
    publisher.start()
    try:
        worker.store(H[:3])
        wait_for(lambda: held(index) == worker.truth)
        if outage == "restart":
            redis_server.kill()
            worker.store(H[3:4])  # published while Redis is down: never raises
            time.sleep(0.3)
        beats_before, snapshots_before = len(beats), len(snapshots_at)  # none reach Redis until it is back
        if outage == "flush":
            index.client.flushall()
        else:
            redis_server.restart()
        wait_for(lambda: bool(held(index)) and held(index) == worker.truth)
        # the snapshot that rebuilt it came within two heartbeats of Redis being back
        assert len(snapshots_at) > snapshots_before
        assert snapshots_at[snapshots_before] - beats_before <= 2, (beats_before, snapshots_at)
        assert index.match([H[0].hex()])["p0"].num_device_blocks == 1
    finally:
        publisher.close()


def test_redis_down_at_start_does_not_raise_and_recovers(redis_server, index):
    redis_server.kill()
    worker = Worker(redis_server.url)
    worker.publisher.start()
    try:
        worker.store(H[:2])
        redis_server.restart()
        wait_for(lambda: held(index) == worker.truth)
    finally:
        worker.publisher.close()


def test_newer_process_with_same_worker_id_fences_the_old(redis_server, index):
    old, new = Worker(redis_server.url), Worker(redis_server.url)
    old.publisher.start()
    try:
        old.store(H[:2])
        wait_for(lambda: held(index) == old.truth)
        new.publisher.start()  # the worker restarted: its new epoch hides the old entries
        new.store(H[5:6])
        wait_for(lambda: held(index) == new.truth)
        old.store(H[8:9])  # the stale process is fenced and gives up, no ping-pong
        time.sleep(3 * FAST.heartbeat_s)
        assert held(index) == new.truth
        assert index.client.hget(META.scope + "w:p0", "epoch").decode() == new.publisher.epoch
    finally:
        old.publisher.close()
        new.publisher.close()


def test_meta_mismatch_fails_the_start(redis_server, index):
    first = Worker(redis_server.url)
    first.publisher.start()
    other = IndexPublisher(redis_server.url, IndexMeta("smollm2", META.compat_hash, 4, hash_seed="s"),
                           WorkerInfo("p1", "prefill"), dict)
    try:
        with pytest.raises(IndexMetaMismatch, match="hash_seed"):
            other.start()
    finally:
        first.publisher.close()


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="heartbeat_s"):
        PublisherConfig(heartbeat_s=6.0, lease_ms=6000)


def test_a_publisher_reaps_dead_workers(redis_server, index):
    index.register(WorkerInfo("dead", "decode"), "e0", 100)
    index.apply("dead", "e0", 1, [("S", H[0].hex(), 1)])
    config = PublisherConfig(flush_interval_s=0.005, heartbeat_s=0.1, lease_ms=600,
                             min_backoff_s=0.05, max_backoff_s=0.1, janitor_interval_s=0.3)
    worker = Worker(redis_server.url, config=config)
    worker.publisher.start()
    try:
        wait_for(lambda: index.client.smembers(META.scope + "workers") == {b"p0"})
        assert held(index, "dead") == {}
    finally:
        worker.publisher.close()


def test_an_idle_publisher_sleeps(redis_server, index):
    worker = Worker(redis_server.url, config=PublisherConfig(heartbeat_s=0.5, lease_ms=1500,
                                                             max_backoff_s=0.5))
    worker.publisher.start()
    try:
        worker.store(H[:2])
        wait_for(lambda: worker.publisher.is_synced)
        cpu_before, wall_before = time.process_time(), time.monotonic()
        time.sleep(1.0)  # two heartbeats, nothing to publish
        cpu = time.process_time() - cpu_before
        assert cpu < 0.05 * (time.monotonic() - wall_before), f"{cpu:.3f} s CPU while idle"
    finally:
        worker.publisher.close()

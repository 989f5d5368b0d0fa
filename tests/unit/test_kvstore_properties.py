"""A hypothesis state machine over the kvstore's BlockStore: puts of chains in two compats that
share one capacity, leases, releases and time passing. After every step: capacity is never
exceeded, slots and bytes agree, every block named by a live lease is still held with its
bytes, and every held block's bytes are the ones put."""

from __future__ import annotations

import hashlib

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv_cache.hashing import BlockHash
from engine.kv_transfer.base import KVCompat
from services.kvstore.leases import Lease
from services.kvstore.region import block_bytes_of
from services.kvstore.store import BlockStore, KVStoreConfig, MissingBlocksError

COMPATS = [KVCompat("tiny", "float32", 4, 2, 1, 8),    # 512-byte blocks
           KVCompat("tiny", "float16", 4, 4, 1, 8)]    # 512-byte blocks, another compat
BIG = KVCompat("big", "float32", 4, 2, 2, 8)           # 1 KiB blocks
ALL = [*COMPATS, BIG]
CAPACITY = 12 * 512
IDS = st.integers(min_value=0, max_value=30)


def h(i: int) -> BlockHash:
    return BlockHash(hashlib.sha256(b"%d" % i).digest())


def payload(compat: KVCompat, i: int) -> bytes:
    return bytes([(i * 7 + ALL.index(compat)) % 251]) * block_bytes_of(compat)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class KVStoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.store = BlockStore(KVStoreConfig(capacity_bytes=CAPACITY, max_lease_s=10), self.clock)
        for compat in ALL:
            self.store.register(compat)
        self.leases: list[Lease] = []

    @rule(compat=st.sampled_from(ALL), ids=st.lists(IDS, min_size=1, max_size=8, unique=True))
    def put(self, compat: KVCompat, ids: list[int]) -> None:
        data = b"".join(payload(compat, i) for i in ids)
        held_before = sum(self.store.contains(compat.hash, h(i)) for i in ids)
        num_stored = self.store.put(compat.hash, [h(i) for i in ids], None,
                                    list(range(len(ids) * compat.block_size)), data)
        assert num_stored <= len(ids) - held_before

    @rule(compat=st.sampled_from(ALL), ids=st.lists(IDS, min_size=1, max_size=4),
          lease_s=st.floats(min_value=0.5, max_value=10))
    def acquire(self, compat: KVCompat, ids: list[int], lease_s: float) -> None:
        present = all(self.store.contains(compat.hash, h(i)) for i in ids)
        try:
            lease = self.store.acquire(compat.hash, [h(i) for i in ids], lease_s)
        except MissingBlocksError:
            assert not present
            return
        assert present
        self.leases.append(lease)

    @precondition(lambda self: self.leases)
    @rule(index=st.integers(min_value=0))
    def release(self, index: int) -> None:
        lease = self.leases.pop(index % len(self.leases))
        assert self.store.release(lease.lease_id) == (lease.expires_at > self.clock.now)

    @rule(seconds=st.floats(min_value=0.1, max_value=6))
    def time_passes(self, seconds: float) -> None:
        self.clock.now += seconds
        self.store.expire_leases()
        self.leases = [lease for lease in self.leases if lease.expires_at > self.clock.now]

    @invariant()
    def capacity_and_integrity(self) -> None:
        self.store.check_integrity()
        assert self.store.used_bytes <= CAPACITY

    @invariant()
    def leased_blocks_stay_with_their_bytes(self) -> None:
        for lease in self.leases:
            region = self.store.region(lease.compat_hash)
            compat = region.compat
            for block_hash, slot_id in zip(lease.block_hashes, lease.slot_ids):
                assert self.store.contains(lease.compat_hash, block_hash)
                i = next(i for i in range(31) if h(i) == block_hash)
                assert bytes(region.read(slot_id)) == payload(compat, i)

    @invariant()
    def held_bytes_are_the_ones_put(self) -> None:
        for compat in ALL:
            region = self.store.region(compat.hash)
            held = [i for i in range(31) if self.store.contains(compat.hash, h(i))]
            if held:
                lease = self.store.acquire(compat.hash, [h(i) for i in held], 1.0)
                assert [bytes(region.read(s)) for s in lease.slot_ids] == [
                    payload(compat, i) for i in held]
                self.store.release(lease.lease_id)


TestKVStoreMachine = KVStoreMachine.TestCase
TestKVStoreMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])

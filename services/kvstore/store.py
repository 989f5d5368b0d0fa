"""The kvstore's block store: host memory keyed by (compat hash, block hash), LRU, read leases.

Pure and single-threaded (the gRPC server calls it from its event loop). A caller drives it as::

    store = BlockStore(KVStoreConfig(capacity_bytes=8 << 30))
    store.register(compat)                                   # once per KV compatibility
    new = store.offer(compat.hash, hashes)                   # which of these it lacks
    store.put(compat.hash, new_hashes, parent, token_ids, packed_bytes)
    lease = store.acquire(compat.hash, hashes, lease_s=5.0)  # MissingBlocksError if one is gone
    ... read store.region(compat.hash).read(slot) for slot in lease.slot_ids ...
    store.release(lease.lease_id)

Capacity: the bytes of all stored blocks never exceed ``capacity_bytes``. When a put would
take usage above ``high_watermark * capacity_bytes``, the least recently used unpinned blocks
are evicted until usage plus the incoming block is at most ``(high_watermark - evict_fraction)
* capacity_bytes`` (Mooncake: 5 % at 95 %). A block named by a live lease is never evicted; if
only pinned blocks (or blocks of the chain being put) remain, the put stores what fits and
reports the rest as not stored.

Recency: ``put`` and ``acquire`` make a block most recently used; ``lookup`` and ``offer`` do not.
Events for the prefix index (``take_events``) are BlockStored / BlockRemoved with tier KVSTORE.
"""

from __future__ import annotations

__all__ = ["BlockStore", "KVStoreConfig", "MissingBlocksError", "StoreStats", "UnknownCompatError"]

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from engine.kv_cache.events import BlockRemoved, BlockStored, KVCacheEvent, Tier
from engine.kv_cache.hashing import HASH_NUM_BYTES, BlockHash
from engine.kv_transfer.base import KV_LAYOUT_VERSION, KVCompat
from services.kvstore.config import (
    KVStoreConfig,
    MissingBlocksError,
    StoreStats,
    UnknownCompatError,
)
from services.kvstore.leases import BlockKey, Lease, LeaseTable
from services.kvstore.region import BlockRegion, block_bytes_of


class BlockStore:
    def __init__(self, config: KVStoreConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._regions: dict[str, BlockRegion] = {}
        self._slots: OrderedDict[BlockKey, int] = OrderedDict()  # LRU first
        self._leases = LeaseTable()
        self._events: list[tuple[str, KVCacheEvent]] = []  # (compat hash, event)
        self.used_bytes = 0
        self._hits = self._misses = self._stored = self._evicted = 0
        self._bytes_in = self._bytes_out = 0

    # -------------------------------------------------------------- compat and queries
    def register(self, compat: KVCompat) -> BlockRegion:
        """The region of ``compat`` (allocated on first call: capacity / block bytes slots)."""
        region = self._regions.get(compat.hash)
        if region is None:
            check_compat(compat)
            num_slots = self.config.capacity_bytes // block_bytes_of(compat)
            if num_slots < 1:
                raise ValueError(f"a block of {compat} is {block_bytes_of(compat)} bytes, more than "
                                 f"the store's capacity of {self.config.capacity_bytes} bytes")
            region = self._regions[compat.hash] = BlockRegion(compat, num_slots)
        return region

    def region(self, compat_hash: str) -> BlockRegion:
        region = self._regions.get(compat_hash)
        if region is None:
            raise UnknownCompatError(
                f"unknown compat_hash {compat_hash[:16]!r}...; send the KVCompat in a Handshake "
                f"first (known: {[h[:16] for h in self._regions]})")
        return region

    def lookup(self, compat_hash: str, block_hashes: Sequence[BlockHash]) -> tuple[int, list[bool]]:
        """(length of the held prefix, held or not per block). Counts prefix blocks as hits."""
        self.region(compat_hash)
        _check_hashes(block_hashes)
        present = [(compat_hash, h) in self._slots for h in block_hashes]
        num_prefix = next((i for i, p in enumerate(present) if not p), len(present))
        self._hits += num_prefix
        self._misses += len(present) - num_prefix
        return num_prefix, present

    def offer(self, compat_hash: str, block_hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """The hashes of ``block_hashes`` not held (first occurrence each): what a Put should send."""
        self.region(compat_hash)
        _check_hashes(block_hashes)
        wanted = dict.fromkeys(h for h in block_hashes if (compat_hash, h) not in self._slots)
        return list(wanted)

    def contains(self, compat_hash: str, block_hash: BlockHash) -> bool:
        return (compat_hash, block_hash) in self._slots

    # -------------------------------------------------------------- writes
    def put(self, compat_hash: str, block_hashes: Sequence[BlockHash], parent_hash: BlockHash | None,
            token_ids: Sequence[int], data: bytes | bytearray | memoryview) -> int:
        """Store the chain ``block_hashes`` (block i = ``data[i*block_bytes:(i+1)*block_bytes]``,
        tokens ``token_ids[i*block_size:(i+1)*block_size]``), skipping blocks already held.

        Returns the number of blocks newly stored; fewer than the new ones only when no room can
        be made (every other block is pinned by a lease or belongs to this chain): the chain is
        then stored up to that block. ValueError for sizes that do not match.
        """
        region = self.region(compat_hash)
        _check_hashes(block_hashes)
        if parent_hash is not None:
            _check_hashes([parent_hash])
        block_size, n = region.compat.block_size, len(block_hashes)
        if len(data) != n * region.block_bytes:
            raise ValueError(f"{n} blocks of {region.block_bytes} bytes need {n * region.block_bytes} "
                             f"bytes of data, got {len(data)}")
        if len(token_ids) != n * block_size:
            raise ValueError(f"{n} blocks of {block_size} tokens need {n * block_size} token ids, "
                             f"got {len(token_ids)}")
        self._leases.expire(self._clock())
        view = memoryview(data).cast("B")
        chain = {(compat_hash, h) for h in block_hashes}  # never evicted to make room for itself
        num_stored, run_start = 0, -1
        for i, block_hash in enumerate(block_hashes):
            key = (compat_hash, block_hash)
            if key in self._slots:
                self._slots.move_to_end(key)
                run_start = self._flush_run(compat_hash, block_hashes, parent_hash, token_ids,
                                            block_size, run_start, i)
                continue
            slot_id = self._make_room(region, chain)
            if slot_id is None:
                break
            region.write(slot_id, view[i * region.block_bytes:(i + 1) * region.block_bytes])
            self._slots[key] = slot_id
            self.used_bytes += region.block_bytes
            self._bytes_in += region.block_bytes
            num_stored += 1
            run_start = i if run_start < 0 else run_start
        else:
            i = n
        self._flush_run(compat_hash, block_hashes, parent_hash, token_ids, block_size, run_start, i)
        self._stored += num_stored
        return num_stored

    def _flush_run(self, compat_hash: str, block_hashes: Sequence[BlockHash],
                   parent_hash: BlockHash | None, token_ids: Sequence[int], block_size: int,
                   start: int, end: int) -> int:
        """Queue one BlockStored for the newly stored run ``[start, end)``; returns -1 (no run)."""
        if 0 <= start < end:
            self._events.append((compat_hash, BlockStored(
                block_hashes=list(block_hashes[start:end]),
                parent_block_hash=parent_hash if start == 0 else block_hashes[start - 1],
                token_ids=list(token_ids[start * block_size:end * block_size]),
                block_size=block_size, tier=Tier.KVSTORE)))
        return -1

    def _make_room(self, region: BlockRegion, keep: set[BlockKey]) -> int | None:
        """A free slot of ``region`` after evicting per the watermark policy (never a block
        in ``keep``), or None."""
        cap = self.config.capacity_bytes
        if self.used_bytes + region.block_bytes > self.config.high_watermark * cap:
            target = (self.config.high_watermark - self.config.evict_fraction) * cap
            self._evict(lambda: self.used_bytes + region.block_bytes <= target, keep)
        if self.used_bytes + region.block_bytes > cap:
            return None
        slot_id = region.allocate()
        if slot_id is None:  # this compat's slots are all used (other compats share the bytes)
            self._evict(lambda: region.num_free > 0, keep, only=region.compat.hash)
            slot_id = region.allocate()
        return slot_id

    def _evict(self, is_enough: Callable[[], bool], keep: set[BlockKey],
               only: str | None = None) -> None:
        removed: dict[str, list[BlockHash]] = {}
        for key in list(self._slots):
            if is_enough():
                break
            if (self._leases.is_pinned(key) or key in keep
                    or (only is not None and key[0] != only)):
                continue
            region = self._regions[key[0]]
            region.free(self._slots.pop(key))
            self.used_bytes -= region.block_bytes
            self._evicted += 1
            removed.setdefault(key[0], []).append(key[1])
        for compat_hash, hashes in removed.items():
            self._events.append((compat_hash, BlockRemoved(block_hashes=hashes, tier=Tier.KVSTORE)))

    # -------------------------------------------------------------- leases
    def acquire(self, compat_hash: str, block_hashes: Sequence[BlockHash],
                lease_s: float | None = None) -> Lease:
        """Pin ``block_hashes`` for ``lease_s`` seconds (default from the config) and return
        where they are. MissingBlocksError naming the missing ones if any is not held."""
        region = self.region(compat_hash)
        _check_hashes(block_hashes)
        if not block_hashes:
            raise ValueError("acquire needs at least one block hash")
        lease_s = self.config.default_lease_s if lease_s is None else lease_s
        if not 0 < lease_s <= self.config.max_lease_s:
            raise ValueError(f"lease must be in (0, {self.config.max_lease_s}] s, got {lease_s}")
        now = self._clock()
        self._leases.expire(now)
        missing = [i for i, h in enumerate(block_hashes) if (compat_hash, h) not in self._slots]
        if missing:
            raise MissingBlocksError(f"{len(missing)} of {len(block_hashes)} blocks are not in the "
                                     f"kvstore (indices {missing[:8]}, first hash "
                                     f"{block_hashes[missing[0]].hex()[:16]})")
        for h in block_hashes:
            self._slots.move_to_end((compat_hash, h))
        self._bytes_out += len(block_hashes) * region.block_bytes
        slot_ids = tuple(self._slots[(compat_hash, h)] for h in block_hashes)
        return self._leases.grant(compat_hash, tuple(block_hashes), slot_ids, now + lease_s)

    def release(self, lease_id: int) -> bool:
        """End a lease early; False if it already ended (released or expired)."""
        return self._leases.release(lease_id)

    def is_leased(self, lease_id: int) -> bool:
        self._leases.expire(self._clock())
        return self._leases.get(lease_id) is not None

    def expire_leases(self) -> int:
        return self._leases.expire(self._clock())

    # -------------------------------------------------------------- observation
    def take_events(self) -> list[KVCacheEvent]:
        """The BlockStored / BlockRemoved (tier KVSTORE) queued since the last call, in order."""
        events, self._events = self._events, []
        return [event for _, event in events]

    def take_events_by_compat(self) -> dict[str, list[KVCacheEvent]]:
        """``take_events``, each compat's events apart (its own prefix-index scope), in order."""
        by_compat: dict[str, list[KVCacheEvent]] = {}
        events, self._events = self._events, []
        for compat_hash, event in events:
            by_compat.setdefault(compat_hash, []).append(event)
        return by_compat

    def block_hashes(self, compat_hash: str) -> list[BlockHash]:
        """Every block of ``compat_hash`` held now, least recently used first (index snapshots)."""
        return [h for c, h in self._slots if c == compat_hash]

    def stats(self) -> StoreStats:
        self._leases.expire(self._clock())
        return StoreStats(
            num_hits=self._hits, num_misses=self._misses, num_stored=self._stored,
            num_evicted=self._evicted, bytes_in=self._bytes_in, bytes_out=self._bytes_out,
            num_leases=len(self._leases), num_leases_granted=self._leases.num_granted,
            num_leases_expired=self._leases.num_expired, num_blocks=len(self._slots),
            used_bytes=self.used_bytes, capacity_bytes=self.config.capacity_bytes)

    def check_integrity(self) -> None:
        """Raise AssertionError with the numbers unless slots, bytes and free lists agree."""
        used = sum(self._regions[c].block_bytes for c, _ in self._slots)
        assert used == self.used_bytes <= self.config.capacity_bytes, (used, self.used_bytes)
        for compat_hash, region in self._regions.items():
            held = sorted(s for (c, _), s in self._slots.items() if c == compat_hash)
            assert len(set(held)) == len(held), f"slot held twice in {compat_hash[:8]}: {held}"
            assert len(held) + region.num_free == region.num_slots, (len(held), region.num_free)


def check_compat(compat: KVCompat) -> None:
    """ValueError naming the field unless every dimension is >= 1 and the layout is ours."""
    bad = [f"{name}={getattr(compat, name)}" for name in
           ("block_size", "num_layers", "num_kv_heads", "head_dim") if getattr(compat, name) < 1]
    if bad:
        raise ValueError(f"KV compat dimensions must be >= 1, got {', '.join(bad)}")
    if compat.layout_version != KV_LAYOUT_VERSION:
        raise ValueError(f"KV layout_version {compat.layout_version} is not supported "
                         f"(this kvstore stores layout {KV_LAYOUT_VERSION})")


def _check_hashes(block_hashes: Sequence[BlockHash]) -> None:
    bad = [i for i, h in enumerate(block_hashes)
           if not isinstance(h, bytes) or len(h) != HASH_NUM_BYTES]
    if bad:
        raise ValueError(f"block hashes must be {HASH_NUM_BYTES} bytes; entries {bad[:8]} are not")

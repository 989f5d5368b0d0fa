"""Read leases: a lease pins blocks of the kvstore so they are not evicted while a reader copies them.

A lease is granted for all its blocks at once, lives until ``Release`` or until ``expires_at``
(seconds on the store's monotonic clock), whichever is first. A block is *pinned* while at least
one live lease names it; eviction skips pinned blocks. Expiry is lazy: the store calls
:meth:`LeaseTable.expire` at the start of each operation, so nothing runs at rest.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

from engine.kv_cache.hashing import BlockHash

BlockKey = tuple[str, BlockHash]
"""(compat hash, block hash): how the kvstore names a block."""


@dataclass(frozen=True, slots=True)
class Lease:
    """``slot_ids[i]`` is the region slot holding ``block_hashes[i]`` of compat ``compat_hash``."""

    lease_id: int
    compat_hash: str
    block_hashes: tuple[BlockHash, ...]
    slot_ids: tuple[int, ...]
    expires_at: float  # store clock, seconds


class LeaseTable:
    """Live leases and the pin count of every leased block."""

    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}
        self._pins: Counter[BlockKey] = Counter()
        self._ids = itertools.count(1)
        self.num_granted = 0
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, compat_hash: str, block_hashes: tuple[BlockHash, ...],
              slot_ids: tuple[int, ...], expires_at: float) -> Lease:
        lease = Lease(next(self._ids), compat_hash, block_hashes, slot_ids, expires_at)
        self._leases[lease.lease_id] = lease
        for block_hash in block_hashes:
            self._pins[(compat_hash, block_hash)] += 1
        self.num_granted += 1
        return lease

    def get(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def release(self, lease_id: int) -> bool:
        """Drop the lease; False if it is unknown (already released or expired)."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        for block_hash in lease.block_hashes:
            key = (lease.compat_hash, block_hash)
            self._pins[key] -= 1
            if self._pins[key] <= 0:
                del self._pins[key]
        return True

    def expire(self, now: float) -> int:
        """Release every lease with ``expires_at <= now``; returns how many."""
        expired = [lease_id for lease_id, lease in self._leases.items() if lease.expires_at <= now]
        for lease_id in expired:
            self.release(lease_id)
        self.num_expired += len(expired)
        return len(expired)

    def is_pinned(self, key: BlockKey) -> bool:
        return key in self._pins

    def next_expiry(self) -> float | None:
        """The earliest ``expires_at`` of a live lease, or None when there is none."""
        return min((lease.expires_at for lease in self._leases.values()), default=None)

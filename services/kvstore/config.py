"""The kvstore's configuration, its stats snapshot, and the errors its store raises."""

from __future__ import annotations

from dataclasses import dataclass


class UnknownCompatError(ValueError):
    """A request names a compat hash the store was never registered with."""


class MissingBlocksError(LookupError):
    """``acquire`` asked for blocks the store does not hold (never stored, or evicted)."""


@dataclass(frozen=True)
class KVStoreConfig:
    """Capacity in bytes of block data; watermark and eviction step as fractions of it;
    lease durations in seconds."""

    capacity_bytes: int
    high_watermark: float = 0.95
    evict_fraction: float = 0.05
    default_lease_s: float = 5.0
    max_lease_s: float = 60.0

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {self.capacity_bytes}")
        if not 0 < self.evict_fraction <= self.high_watermark <= 1:
            raise ValueError("need 0 < evict_fraction <= high_watermark <= 1, got "
                             f"{self.evict_fraction} and {self.high_watermark}")


@dataclass(frozen=True)
class StoreStats:
    """Counters since start (blocks and bytes) and the current occupancy."""

    num_hits: int  # Lookup: blocks of the requested prefix that were held
    num_misses: int  # Lookup: the requested blocks after that prefix
    num_stored: int
    num_evicted: int
    bytes_in: int
    bytes_out: int  # bytes of acquired blocks (read over gRPC or NIXL)
    num_leases: int  # live now
    num_leases_granted: int
    num_leases_expired: int
    num_blocks: int
    used_bytes: int
    capacity_bytes: int

"""Settings of the index's two sides, frozen and validated once. Times in seconds unless the
name says ``_ms``; tests shorten the heartbeat, lease and budget."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.index.breaker import BreakerConfig


@dataclass(frozen=True)
class PublisherConfig:
    """Timings in seconds unless named ``_ms``; tests shorten the heartbeat and lease."""

    flush_interval_s: float = 0.010
    max_batch_ops: int = 256
    max_queue_ops: int = 65536
    heartbeat_s: float = 2.0
    lease_ms: int = 6000
    redis_timeout_s: float = 1.0
    min_backoff_s: float = 0.1
    max_backoff_s: float = 2.0  # <= heartbeat_s: a restarted Redis is rebuilt within two heartbeats
    snapshot_chunk_blocks: int = 1024
    janitor_interval_s: float = 30.0  # every publisher offers; one per interval reaps dead workers

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s * 1000 < self.lease_ms:
            raise ValueError(f"heartbeat_s ({self.heartbeat_s}) must be positive and shorter than "
                             f"the lease ({self.lease_ms} ms)")
        if not 0 < self.min_backoff_s <= self.max_backoff_s <= self.heartbeat_s:
            raise ValueError("need 0 < min_backoff_s <= max_backoff_s <= heartbeat_s")
        if self.max_batch_ops <= 0 or self.max_queue_ops < self.max_batch_ops:
            raise ValueError("need 0 < max_batch_ops <= max_queue_ops")


@dataclass(frozen=True)
class IndexClientConfig:
    """``budget_s`` bounds a lookup's connect and its reply each; reservations expire after
    ``reservation_ttl_ms`` unless released."""

    budget_s: float = 0.005
    reservation_ttl_ms: int = 30_000
    breaker: BreakerConfig = field(default_factory=BreakerConfig)

    def __post_init__(self) -> None:
        if self.budget_s <= 0 or self.reservation_ttl_ms <= 0:
            raise ValueError(f"budget_s and reservation_ttl_ms must be positive, got {self}")

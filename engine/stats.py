"""What an engine reports about its load and its prefix-cache tiers: the types behind every stats
RPC (torch-free, so the router can import them)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache.events import Tier


@dataclass(slots=True)
class TierCounters:
    """Running totals of one tier, kept by whoever owns the tier (mutable, engine thread only)."""

    num_queried_blocks: int = 0  # blocks of admitted prompts looked up in this tier
    num_hit_blocks: int = 0  # of those, blocks it served (device: reused; host: loaded)
    num_hit_tokens: int = 0
    num_load_failures: int = 0  # loads that stopped short (the rest was recomputed)
    num_loaded_bytes: int = 0  # moved up into the device cache
    num_offloaded_bytes: int = 0  # moved down from the device cache


@dataclass(frozen=True, slots=True)
class TierStats:
    """One tier of the prefix cache at one moment. Counters are totals since the engine started.

    Hits and misses count blocks of admitted prompts (a prompt's last token is always computed,
    so at most ``(num_prompt_tokens - 1) // block_size`` blocks per prompt); the host tier is
    asked only for what the device tier missed. Bytes: ``num_loaded_bytes`` host -> device,
    ``num_offloaded_bytes`` device -> host (both 0 on the device tier)."""

    tier: Tier
    num_blocks: int  # capacity
    num_cached_blocks: int  # blocks holding a hash now
    num_queried_blocks: int
    num_hit_blocks: int
    num_hit_tokens: int
    num_stored_blocks: int  # hashes that entered this tier
    num_evicted_blocks: int  # hashes that left it to make room (or were dropped as bad)
    num_load_failures: int
    num_loaded_bytes: int
    num_offloaded_bytes: int

    @property
    def num_miss_blocks(self) -> int:
        return self.num_queried_blocks - self.num_hit_blocks

    @classmethod
    def of(cls, tier: Tier, num_blocks: int, num_cached_blocks: int, num_stored_blocks: int,
           num_evicted_blocks: int, counters: TierCounters) -> TierStats:
        return cls(tier, num_blocks, num_cached_blocks, counters.num_queried_blocks, counters.num_hit_blocks,
                   counters.num_hit_tokens, num_stored_blocks, num_evicted_blocks, counters.num_load_failures,
                   counters.num_loaded_bytes, counters.num_offloaded_bytes)


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_free_blocks: int
    num_total_blocks: int
    block_size: int  # tokens per KV block
    num_running_requests: int
    num_waiting_requests: int
    num_outstanding_prefill_tokens: int  # prompt tokens admitted, not computed, not arriving from a peer
    tiers: tuple[TierStats, ...] = ()  # DEVICE, then HOST when the host tier is on
    num_preemptions: int = 0  # requests preempted (recomputed) since the engine started
    num_chained_steps: int = 0  # steps launched before the one in flight was booked (async scheduling)


@dataclass(frozen=True, slots=True)
class Sendable:
    """What of a request's KV exists on this worker now (``EngineCore.sendable``)."""

    block_ids: list[int]  # its block table
    num_computed_tokens: int  # tokens whose KV is in those blocks
    was_preempted: bool  # it lost its blocks once and recomputed: KV sent before is stale


@dataclass(frozen=True, slots=True)
class RemoteReservation:
    """Blocks a DECODE engine holds for a prompt whose KV a prefill worker sends
    (``EngineCore.reserve_remote``)."""

    block_ids: list[int]  # the prompt's block table, in order
    num_cached_blocks: int  # leading blocks already filled from this worker's prefix cache

    @property
    def num_blocks_to_send(self) -> int:
        return len(self.block_ids) - self.num_cached_blocks

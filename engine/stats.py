"""What an engine reports about its load: the one type behind every stats RPC (torch-free, so
the router can import it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_free_blocks: int
    num_total_blocks: int
    block_size: int  # tokens per KV block
    num_running_requests: int
    num_waiting_requests: int
    num_outstanding_prefill_tokens: int  # prompt tokens admitted, not computed, not arriving from a peer


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

"""What the engine and the scheduler ask of the host tier, and the host tier turned off.

``HostTier`` (``host_tier.py``) is the real one; ``NoHostTier`` keeps nothing, so a worker with
``cpu_offload_gb`` 0 (or no prefix caching) runs the same code with no branch on the tier.

The scheduler's side, at admission (``engine/scheduler/prefix_loads.py``)::

    entries = tier.match(hashes_after_device_hit)   # pinned: load them or release them
    load = tier.start_load(entries, fresh_block_ids)
    tier.poll()                                      # later steps: book what landed
    if load.is_settled: ...load.num_loaded leading blocks hold their data...

The engine's side: ``flush`` after each schedule, ``observe_prefill`` after each forward, and
the tier's statistics, holdings, ``clear``, ``close`` and ``check_integrity``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.kv_cache.hashing import BlockHash
from engine.kv_cache.tiers.copier import CopyJob
from engine.kv_cache.tiers.host_pool import HostEntry
from engine.stats import TierStats


@dataclass(slots=True, eq=False)
class HostLoad:
    """Host entries being copied into device blocks (``start_load``). Once ``is_settled``,
    ``num_loaded`` leading blocks hold their data."""

    job: CopyJob
    entries: list[HostEntry]
    block_ids: list[int]
    num_host_run: int  # of ``entries``, those the host held (the rest came from the lower tier)
    num_loaded: int = 0
    is_settled: bool = False


class HostTierProtocol(Protocol):
    """The host tier (and, through it, the lower tier) as its callers see it. All calls come
    from the engine thread."""

    def flush(self) -> None:
        """After a schedule: start copying down what the next allocations will evict."""

    def poll(self) -> None:
        """Book every copy that has finished (offloads landed, loads settled)."""

    def match(self, block_hashes: Sequence[BlockHash], parent_hash: BlockHash | None = None,
              token_ids: Sequence[int] | None = None) -> list[HostEntry]:
        """The entries continuing a device hit's chain, pinned: ``start_load`` or ``release`` them."""
        ...

    def release(self, entries: Sequence[HostEntry]) -> None:
        """Unpin entries from ``match`` that will not be loaded."""

    def start_load(self, entries: Sequence[HostEntry], block_ids: Sequence[int]) -> HostLoad:
        """Start copying ``entries`` into device blocks ``block_ids`` (untouched until settled)."""
        ...

    def wait_for_load(self, load: HostLoad) -> None:
        """Block until ``load`` is settled."""

    def load(self, entries: Sequence[HostEntry], block_ids: Sequence[int]) -> int:
        """``start_load`` and wait: how many leading blocks hold their data."""
        ...

    def record_query(self, num_queried_blocks: int, num_hit_blocks: int, block_size: int,
                     num_host_run: int | None = None) -> None:
        """Count one admission's lookup of this tier."""

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A forward computed ``num_tokens`` prompt tokens in ``seconds`` (the recompute estimate)."""

    def tier_stats(self) -> tuple[TierStats, ...]:
        """HOST, then KVSTORE when there is a lower tier; () when the tier is off."""
        ...

    def cached_block_hashes(self) -> list[BlockHash]:
        ...

    def clear(self, emit: bool) -> None:
        """Forget every block (after finishing the copies in flight)."""

    def close(self) -> None:
        """Finish the copies in flight and stop the copier (engine shutdown)."""

    def check_integrity(self) -> None:
        """Raise RuntimeError if the tier is inconsistent (between steps)."""


class NoHostTier:
    """The host tier turned off (``cpu_offload_gb`` 0, or no prefix caching): nothing is kept,
    every match is empty, so nothing is ever loaded."""

    def flush(self) -> None:
        pass

    def poll(self) -> None:
        pass

    def match(self, block_hashes: Sequence[BlockHash], parent_hash: BlockHash | None = None,
              token_ids: Sequence[int] | None = None) -> list[HostEntry]:
        return []

    def release(self, entries: Sequence[HostEntry]) -> None:
        pass

    def start_load(self, entries: Sequence[HostEntry], block_ids: Sequence[int]) -> HostLoad:
        raise ValueError("the host tier is off: there is nothing to load")

    def wait_for_load(self, load: HostLoad) -> None:
        raise ValueError("the host tier is off: there is nothing to load")

    def load(self, entries: Sequence[HostEntry], block_ids: Sequence[int]) -> int:
        if entries:
            raise ValueError("the host tier is off: there is nothing to load")
        return 0

    def record_query(self, num_queried_blocks: int, num_hit_blocks: int, block_size: int,
                     num_host_run: int | None = None) -> None:
        pass

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        pass

    def tier_stats(self) -> tuple[TierStats, ...]:
        return ()

    def cached_block_hashes(self) -> list[BlockHash]:
        return []

    def clear(self, emit: bool) -> None:
        pass

    def close(self) -> None:
        pass

    def check_integrity(self) -> None:
        pass

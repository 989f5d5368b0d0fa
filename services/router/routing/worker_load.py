"""One worker's load as a routing policy sees it (worker_pool.py builds it: the last GetStats
reply corrected by what this router sent since)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class WorkerLoad:
    """One worker as the policy sees it. Counts are estimates, never negative."""

    address: str
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    block_size: int = 16
    num_running: int = 0
    num_waiting: int = 0
    num_outstanding_prefill_tokens: int = 0
    worker_id: str = ""  # from its GetStats: the id it publishes to the prefix index under

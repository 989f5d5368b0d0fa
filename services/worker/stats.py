"""WorkerService.GetStats: the load signal routers poll (free blocks, running, queued tokens).

One servicer for every process that runs an engine (prefill and decode workers, the colocated
router): it reads ``EngineStats`` through the callable it is given, and names the engine
settings the process runs with (``engine_argv``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from engine.args import EngineArgs
from engine.kv_transfer.base import KVCompat
from engine.stats import EngineStats
from services.common.engine_flags import engine_argv
from services.common.errors import Unavailable
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.common.wire import compat_to_proto, tier_stats_to_proto

if TYPE_CHECKING:  # the router serves GetStats too, and imports no torch
    from services.worker.kvstore_tier import KVStoreTierCounters


@dataclass
class TransferCounters:
    """KV blocks a worker moved since it started (``WorkerStats.kv_transfer``); the role's
    handler adds to them on the event loop."""

    num_blocks_sent: int = 0
    num_bytes_sent: int = 0
    num_blocks_skipped_cached: int = 0
    num_bytes_skipped_cached: int = 0  # what the delta transfer saved (metrics only, not on the wire)

    def to_proto(self) -> worker_pb2.KVTransferCounters:
        return worker_pb2.KVTransferCounters(num_blocks_sent=self.num_blocks_sent,
                                             num_bytes_sent=self.num_bytes_sent,
                                             num_blocks_skipped_cached=self.num_blocks_skipped_cached)


@dataclass
class PrefixCounters:
    """Prompt tokens a worker computed or reused since it started (``WorkerStats.prefix_cache``):
    the hit rate the prefix index is judged by. The role's handler adds on the event loop."""

    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0

    def add(self, num_prompt_tokens: int, num_cached_prompt_tokens: int) -> None:
        self.num_requests += 1
        self.num_prompt_tokens += num_prompt_tokens
        self.num_cached_prompt_tokens += num_cached_prompt_tokens

    def to_proto(self) -> worker_pb2.PrefixCacheCounters:
        return worker_pb2.PrefixCacheCounters(num_requests=self.num_requests,
                                              num_prompt_tokens=self.num_prompt_tokens,
                                              num_cached_prompt_tokens=self.num_cached_prompt_tokens)


class WorkerStatsServicer(worker_pb2_grpc.WorkerServiceServicer):
    """``read_stats`` returns the engine's stats, or raises RuntimeError (answered UNAVAILABLE)
    when the engine cannot be read."""

    def __init__(self, read_stats: Callable[[], Awaitable[EngineStats]], worker_id: str, role: str,
                 engine_args: EngineArgs, transfer_methods: Sequence[worker_pb2.KVTransferMethod] = (),
                 transfer_counters: TransferCounters | None = None,
                 kv_compat: KVCompat | None = None,
                 prefix_counters: PrefixCounters | None = None,
                 kvstore_counters: KVStoreTierCounters | None = None) -> None:
        self.read_stats = read_stats
        self.kvstore_counters = kvstore_counters  # the KVSTORE tier's bytes by transport
        self.kv_compat = compat_to_proto(kv_compat) if kv_compat is not None else None
        self.prefix_counters = prefix_counters or PrefixCounters()
        self.transfer_counters = transfer_counters or TransferCounters()
        self.worker_id = worker_id
        self.role = role
        self.transfer_methods = list(transfer_methods)
        self.engine_argv = engine_argv(engine_args)

    async def GetStats(self, request: worker_pb2.GetStatsRequest,
                       context: grpc.aio.ServicerContext) -> worker_pb2.WorkerStats:
        try:
            stats = await self.read_stats()
        except RuntimeError as error:
            raise Unavailable(f"GetStats: {error}") from error
        tiers = tier_stats_to_proto(stats.tiers)
        for tier in tiers:
            if tier.tier == worker_pb2.CACHE_TIER_KVSTORE and self.kvstore_counters is not None:
                tier.num_loaded_bytes_nixl = self.kvstore_counters.num_nixl_loaded_bytes
                tier.num_loaded_bytes_grpc = self.kvstore_counters.num_grpc_loaded_bytes
        return worker_pb2.WorkerStats(
            worker_id=self.worker_id, role=self.role,
            num_free_blocks=stats.num_free_blocks, num_total_blocks=stats.num_total_blocks,
            block_size=stats.block_size, num_running_requests=stats.num_running_requests,
            num_waiting_requests=stats.num_waiting_requests,
            num_outstanding_prefill_tokens=stats.num_outstanding_prefill_tokens,
            transfer_methods=self.transfer_methods, engine_argv=self.engine_argv,
            kv_transfer=self.transfer_counters.to_proto(), kv_compat=self.kv_compat,
            prefix_cache=self.prefix_counters.to_proto(), tiers=tiers)

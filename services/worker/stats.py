"""WorkerService.GetStats: the load signal routers poll (free blocks, running, queued tokens).

The numbers are read from the engine without pausing it (a step can take a while on CPU):
each is one int or one ``list(...)`` copy, which the GIL makes atomic, so a reply is a
consistent-enough snapshot for routing, never a torn read that raises. The reply also
names the engine settings the worker runs with (``engine_argv``).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from engine.args import EngineArgs
from engine.core import EngineCore
from engine.request import RequestStatus
from services.common.engine_flags import engine_argv
from services.common.pb import worker_pb2, worker_pb2_grpc

WORKER_SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name


def num_outstanding_prefill_tokens(core: EngineCore) -> int:
    """Prompt tokens admitted but not computed yet (excluding KV that arrives from elsewhere)."""
    requests = list(core.scheduler.requests.values())
    return sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in requests
               if r.status != RequestStatus.WAITING_FOR_REMOTE_KV)


class WorkerStatsServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, core: EngineCore, worker_id: str, role: str,
                 transfer_methods: Sequence[int], engine_args: EngineArgs) -> None:
        self.core = core
        self.worker_id = worker_id
        self.role = role
        self.transfer_methods = list(transfer_methods)
        self.engine_argv = engine_argv(engine_args)

    def snapshot(self) -> worker_pb2.WorkerStats:
        core = self.core
        return worker_pb2.WorkerStats(
            worker_id=self.worker_id, role=self.role,
            num_free_blocks=core.block_pool.num_free_blocks,
            num_total_blocks=core.runner.num_blocks,
            block_size=core.config.cache.block_size,
            num_running_requests=len(core.scheduler.running),
            num_waiting_requests=len(core.scheduler.waiting),
            num_outstanding_prefill_tokens=num_outstanding_prefill_tokens(core),
            transfer_methods=self.transfer_methods, engine_argv=self.engine_argv)

    async def GetStats(self, request: worker_pb2.GetStatsRequest,
                       context: grpc.aio.ServicerContext) -> worker_pb2.WorkerStats:
        return self.snapshot()

"""The skeleton both workers share: flags -> engine -> AsyncEngine -> gRPC server -> drain.

    runtime = await start_runtime(args, Role.PREFILL)  # model, EngineCore in that role, running
    await serve(runtime, PrefillWorker(runtime))

``serve`` creates the role's handler (its KV connectors too),
registers its servicers next to WorkerService (GetStats) and grpc.health.v1, prints one
``listening <role> <worker_id> <host:port>`` line to stdout, serves until SIGTERM/SIGINT, then
drains (health NOT_SERVING, in-flight RPCs get ``--drain-grace-s``) and closes the handler.
"""

from __future__ import annotations

import abc
import argparse
import dataclasses
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.args import EngineArgs
from engine.config import ConfigError, Role
from engine.core import EngineCore
from engine.heap import freeze_long_lived, thaw
from engine.kv_transfer.base import KVCompat, KVTransferError
from engine.stats import EngineStats
from services.common.async_engine import AsyncEngine
from services.common.engine_flags import engine_args_from
from services.common.faults import faults
from services.common.grpc_server import AddServicer, start_grpc_server
from services.common.internal_auth import install_from_args
from services.common.metrics import MetricsServer, start_metrics_server
from services.common.pb import worker_pb2_grpc
from services.common.wire import WORKER_SERVICE_NAME, transfer_methods
from services.index.schema import IndexMetaMismatch
from services.worker.index_publisher import WorkerIndexPublisher
from services.worker.kvstore_tier import KVStoreTier, KVStoreTierConfig
from services.worker.request_timer import WorkerMetrics
from services.worker.settings import apply_cpu_settings
from services.worker.stats import PrefixCounters, TransferCounters, WorkerStatsServicer

log = logging.getLogger(__name__)
STARTUP_ERRORS = (FileNotFoundError, ValueError, ConfigError, KVTransferError, OSError, IndexMetaMismatch)


@dataclass
class WorkerRuntime:
    args: argparse.Namespace
    engine_args: EngineArgs  # what the engine was built from (GetStats reports them)
    role: Role
    worker_id: str
    model_name: str
    engine: AsyncEngine
    metrics: WorkerMetrics  # request timers for the handler; disabled() with --metrics-port -1
    kvstore: KVStoreTier | None = None  # the engine's lower tier (--kvstore-address)


class RoleHandler(abc.ABC):
    """What a role adds to the skeleton: its servicers, and what to open and close."""

    service_names: Sequence[str] = ()
    transfer_counters: TransferCounters  # set by the role's __init__ (GetStats reports them)
    prefix_counters: PrefixCounters  # likewise

    @abc.abstractmethod
    async def start(self) -> list[AddServicer]:
        """Open connectors (on the running loop); return the servicers to register."""

    async def close(self) -> None:
        """Called after the server stopped."""


def configure_logging(role: Role, level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level), stream=sys.stderr,
                        format=f"%(asctime)s {role.value} %(levelname)s %(name)s: %(message)s")


async def start_runtime(args: argparse.Namespace, role: Role) -> WorkerRuntime:
    """Pin CPUs, then load the model and build the engine in ``role`` on the engine thread
    (``AsyncEngine.build`` says why that thread) and start it. Raises STARTUP_ERRORS."""
    from engine.models.loader import load_model

    engine_args = engine_args_from(args)
    apply_cpu_settings(args.cpus, engine_args.num_threads)

    def make_core() -> EngineCore:
        loaded = load_model(args.model)
        config = dataclasses.replace(engine_args.build(loaded.config, role), core_share=args.core_share)
        if getattr(args, "redis_url", ""):  # the prefix index follows the cache through its events
            config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, enable_kv_events=True))
        if kvstore is None:
            return EngineCore(config, loaded)
        core = EngineCore(config, loaded, lower_tier=kvstore)
        if len(core.stats().tiers) < 3:  # no host tier: the kvstore has nothing to stage through
            log.warning("--kvstore-address %s is unused: the host tier is off (--cpu-offload-gb 0 "
                        "or no prefix caching)", kvstore.config.address)
        kvstore.start(KVCompat.from_kv_cache(config.model.name, core.kv_cache))
        return core

    kvstore = kvstore_tier_from(args)
    engine = AsyncEngine()
    try:
        core = await engine.build(make_core)
    except BaseException:
        if kvstore is not None:
            kvstore.close()
        raise
    worker_id = args.worker_id or f"{role.value}-{args.port}"
    model_name = core.config.model.name
    metrics = (WorkerMetrics.disabled() if args.metrics_port == -1 else
               WorkerMetrics.create(engine, model_name, worker_id, role.value))
    return WorkerRuntime(args, engine_args, role, worker_id, model_name, engine, metrics, kvstore)


def kvstore_tier_from(args: argparse.Namespace) -> KVStoreTier | None:
    """The kvstore tier ``--kvstore-address`` names, not started; None without one.
    ``--kvstore-transfer auto`` follows ``--transfer`` (grpc there: gRPC loads only).
    Raises ValueError for a bad budget."""
    address = getattr(args, "kvstore_address", "")
    if not address:
        return None
    transfer = getattr(args, "kvstore_transfer", "auto")
    if transfer == "auto" and getattr(args, "transfer", "nixl") == "grpc":
        transfer = "grpc"
    return KVStoreTier(KVStoreTierConfig(address, lookup_budget_s=args.kvstore_lookup_ms / 1000,
                                         transfer=transfer))


async def serve(runtime: WorkerRuntime, handler: RoleHandler) -> None:
    args = runtime.args
    index: WorkerIndexPublisher | None = None
    metrics_server: MetricsServer | None = None
    try:
        servicers = await handler.start()
        runtime.metrics.attach_transfer_counters(handler.transfer_counters)
        metrics_server = start_metrics_server(args.metrics_port, args.host, runtime.metrics.registry)
        if metrics_server is not None:
            print(f"metrics {runtime.role.value} {runtime.worker_id} http://{metrics_server.address}/metrics",
                  flush=True)
        engine = runtime.engine

        async def read_stats() -> EngineStats:
            return engine.stats()

        stats = WorkerStatsServicer(read_stats, runtime.worker_id, runtime.role.value,
                                    runtime.engine_args, transfer_methods(args.transfer),
                                    handler.transfer_counters,
                                    KVCompat.from_kv_cache(runtime.model_name, engine.kv_cache),
                                    handler.prefix_counters,
                                    runtime.kvstore.counters if runtime.kvstore is not None else None)
        # before any request can come: its one full collection took ~0.13 s here (engine/heap.py)
        freeze_long_lived(f"{runtime.role.value} worker {runtime.worker_id}")
        server = await start_grpc_server(
            [*servicers, (worker_pb2_grpc.add_WorkerServiceServicer_to_server, stats)],
            port=args.port, host=args.host,
            service_names=[*handler.service_names, WORKER_SERVICE_NAME])
        log.info("%s worker %s serving on %s (transfer %s, %d KV blocks)", runtime.role.value,
                 runtime.worker_id, server.address, args.transfer, engine.stats().num_total_blocks)
        if getattr(args, "redis_url", ""):
            index = WorkerIndexPublisher(runtime.engine, runtime.model_name, runtime.worker_id,
                                         runtime.role.value, server.address, args.redis_url,
                                         args.index_heartbeat_s)
            runtime.metrics.attach_index_counts(index.publisher.counts)
            await index.start()
        print(f"listening {runtime.role.value} {runtime.worker_id} {server.address}", flush=True)
        await server.serve_until_signal(grace_s=args.drain_grace_s)
    finally:
        thaw()
        if metrics_server is not None:
            metrics_server.close()
        if index is not None:
            await index.close()
        await handler.close()
        runtime.engine.stop()
        if runtime.kvstore is not None:
            runtime.kvstore.close()
        log.info("%s worker %s stopped", runtime.role.value, runtime.worker_id)


def run_worker(argv: Sequence[str] | None, parser: argparse.ArgumentParser, role: Role,
               make_handler: Callable[[WorkerRuntime], RoleHandler]) -> None:
    """Parse, load and serve; a startup error exits 1 with a one-line reason on stderr."""
    import asyncio

    args = parser.parse_args(argv)
    install_from_args(args, parser)  # internal gRPC: mTLS / token for its server and channels
    configure_logging(role, args.log_level)
    try:
        if faults().plan.is_active:  # PDSERVE_FAULTS, parsed once here: a bad spec fails at start
            log.warning("fault injection on: %s", faults().plan)
    except ValueError as exc:
        print(f"pdserve serve {role.value}: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    async def main() -> None:
        runtime = await start_runtime(args, role)
        await serve(runtime, make_handler(runtime))

    try:
        asyncio.run(main())
    except STARTUP_ERRORS as exc:
        print(f"pdserve serve {role.value}: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)

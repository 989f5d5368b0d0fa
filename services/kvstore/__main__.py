"""``pdserve serve kvstore``: the node's block store (KVStoreService + grpc.health.v1).

    pdserve serve kvstore [--host 127.0.0.1] [--port 50081] [--kvstore-gib 1.0]
                          [--transfer nixl|grpc] [--default-lease-ms 5000] [--drain-grace-s 10]
                          [--redis-url redis://HOST:PORT/0] [--index-heartbeat-s 2]
                          (every flag: PDSERVE_* too)

With ``--transfer nixl`` (the default) each compat's region is registered with a NIXL agent
so workers can READ blocks one-sided; when NIXL cannot start here the store serves gRPC only
(Get), with a warning. Prints ``listening on HOST:PORT`` once SERVING.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.flags import add_flags, setting
from services.common.grpc_server import DEFAULT_GRACE_S, DEFAULT_HOST
from services.common.internal_auth import add_internal_auth_arguments, install_from_args
from services.common.metrics import add_metrics_argument
from services.common.wire import TRANSFERS
from services.index.settings import add_publisher_arguments

DEFAULT_PORT = 50081
GIB = 1 << 30


@dataclass(frozen=True)
class KVStoreFlags:
    """The kvstore's own flags (services/common/flags.py)."""

    host: str = setting(DEFAULT_HOST, "address to bind (loopback by default)")
    port: int = setting(DEFAULT_PORT, "gRPC port (0: any free port)")
    kvstore_gib: float = setting(1.0, "capacity in GiB of block bytes")
    transfer: str = setting("nixl", "nixl: also serve one-sided NIXL reads (falls back to grpc "
                            "when unusable)", choices=TRANSFERS)
    default_lease_ms: int = setting(5000, "read lease when a request asks for 0 ms")
    max_lease_ms: int = setting(60_000, "longest read lease granted")
    drain_grace_s: float = setting(DEFAULT_GRACE_S, "on SIGTERM, seconds in-flight requests may "
                                   "still run")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve serve kvstore", description=__doc__.split("\n\n")[0])
    add_flags(parser, KVStoreFlags)
    add_metrics_argument(parser)
    add_publisher_arguments(parser)
    add_internal_auth_arguments(parser)
    return parser


async def serve(args: argparse.Namespace) -> None:
    from engine.kv_transfer.base import KVTransferError
    from services.common.grpc_server import start_grpc_server
    from services.common.metrics import new_registry, start_metrics_server
    from services.common.pb import kvstore_pb2_grpc
    from services.kvstore.metrics import StoreCollector, on_loop
    from services.kvstore.nixl_host import NixlHost
    from services.kvstore.server import KVSTORE_SERVICE_NAME, KVStoreServicer
    from services.kvstore.store import BlockStore, KVStoreConfig

    store = BlockStore(KVStoreConfig(capacity_bytes=int(args.kvstore_gib * GIB),
                                     default_lease_s=args.default_lease_ms / 1000,
                                     max_lease_s=args.max_lease_ms / 1000))
    nixl = None
    if args.transfer == "nixl":
        try:
            nixl = NixlHost()
        except KVTransferError as error:
            print(f"pdserve serve kvstore: warning: {error}; serving gRPC Get only",
                  file=sys.stderr, flush=True)
    servicer = KVStoreServicer(store, nixl, agent_name=f"kvstore-grpc-{os.getpid()}")
    server = await start_grpc_server(
        [(kvstore_pb2_grpc.add_KVStoreServiceServicer_to_server, servicer)],
        port=args.port, host=args.host, service_names=[KVSTORE_SERVICE_NAME])
    registry = new_registry()
    registry.register(StoreCollector(on_loop(asyncio.get_running_loop(), store.stats)))
    metrics = start_metrics_server(args.metrics_port, args.host, registry)
    if metrics is not None:
        print(f"metrics kvstore http://{metrics.address}/metrics", flush=True)
    if args.redis_url:
        from services.kvstore.index_publisher import KVStoreIndexPublisher
        servicer.index = KVStoreIndexPublisher(args.redis_url, store, server.address, args.index_heartbeat_s)
    print(f"listening on {server.address}", flush=True)
    try:
        await server.serve_until_signal(grace_s=args.drain_grace_s)
    finally:
        if metrics is not None:
            metrics.close()
        if servicer.index is not None:
            await servicer.index.close()
        if nixl is not None:
            nixl.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    install_from_args(args, parser)
    if args.kvstore_gib <= 0:
        parser.error(f"--kvstore-gib must be > 0, got {args.kvstore_gib}")
    if not 0 < args.default_lease_ms <= args.max_lease_ms:
        parser.error("need 0 < --default-lease-ms <= --max-lease-ms")
    from services.common.faults import faults
    try:
        faults()  # PDSERVE_FAULTS, parsed once here: a bad spec fails at start
    except ValueError as exc:
        parser.error(str(exc))
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()

"""Flags of the prefill and decode workers: their own (WorkerFlags, DecodeFlags: one field
each, services/common/flags.py), the shared groups, then the engine's (engine_flags.py).

Every flag also reads a ``PDSERVE_*`` variable (``--num-kv-blocks`` -> ``PDSERVE_NUM_KV_BLOCKS``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from engine.config import Role
from services.common.engine_flags import add_engine_arguments
from services.common.flags import add_flags, setting
from services.common.grpc_server import DEFAULT_GRACE_S, DEFAULT_HOST
from services.common.internal_auth import add_internal_auth_arguments
from services.common.metrics import add_metrics_argument
from services.common.wire import TRANSFERS
from services.index.settings import add_publisher_arguments
from services.worker.admission import add_admission_argument

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
KVSTORE_TRANSFERS = ("nixl", "grpc", "auto")  # auto: as the worker's --transfer

@dataclass(frozen=True)
class WorkerFlags:
    """The flags of both workers that are neither the engine's nor a shared group's."""

    host: str = setting(DEFAULT_HOST, "address to bind")
    port: int = setting(0, "gRPC port (0: any free port)")  # each role passes its default
    worker_id: str = setting("", "name in stats and logs (default: role-port)")
    transfer: str = setting("nixl", "KV transport: nixl (one-sided writes over UCX; gRPC is "
                            "served as well) or grpc only", choices=TRANSFERS)
    kv_shared_memory: str = setting(
        "auto", "gRPC KV pushes between a prefill and a decode worker that share /dev/shm (one "
        "host): auto (the payload through a shared-memory file, its name over gRPC) or off "
        "(the bytes over gRPC)", choices=("auto", "off"))
    cpus: str = setting("", "pin to these CPUs, e.g. '0-3,6' (empty: no pinning)")
    core_share: str = setting("", "PATH:SLOT of a core-share file (pdserve up makes one for workers on "
                              "the same cores, engine/runner/core_share.py): each engine step on "
                              "--num-threads divided by the workers busy then (empty: always all)")
    log_level: str = setting("INFO", "log level (DEBUG: one line per request with its timings)",
                             choices=LOG_LEVELS)
    drain_grace_s: float = setting(DEFAULT_GRACE_S, "on SIGTERM, seconds in-flight RPCs may still run")
    kvstore_address: str = setting(
        "", "host:port of the node's kvstore (pdserve serve kvstore): host-tier evictions are "
        "offered to it and a prefix miss asks it before recomputing (empty: none; needs the "
        "host tier, --cpu-offload-gb > 0)")
    kvstore_lookup_ms: float = setting(5.0, "a kvstore lookup not answered within this many ms "
                                       "is a miss")
    kvstore_transfer: str = setting(
        "auto", "how blocks are loaded from the kvstore: nixl (one-sided READs; fails at start "
        "without NIXL), auto (as --transfer: nixl when that is nixl and NIXL starts here, else "
        "grpc) or grpc (Get); a kvstore without NIXL is always read with Get",
        choices=KVSTORE_TRANSFERS)


@dataclass(frozen=True)
class DecodeFlags:
    """The decode worker's own flags."""

    reservation_lease_ms: int = setting(60_000, "a reservation not claimed by a Decode call "
                                        "within this long is released; prefill workers stop "
                                        "writing before it runs out")


def worker_parser(role: Role, default_port: int) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"pdserve serve {role.value}",
                                     description=f"Serve one {role.value} worker over gRPC.")
    add_flags(parser, WorkerFlags, port=default_port)
    if role is Role.DECODE:
        add_flags(parser, DecodeFlags)
    add_metrics_argument(parser)
    add_admission_argument(parser)
    add_publisher_arguments(parser)
    add_internal_auth_arguments(parser)
    add_engine_arguments(parser)
    return parser


def parse_cpus(spec: str) -> set[int]:
    """'0-3,6' -> {0, 1, 2, 3, 6}. Raises ValueError naming the bad part."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise ValueError(f"--cpus {spec!r}: {part!r} is not a CPU number or range") from None
        if first > last or first < 0:
            raise ValueError(f"--cpus {spec!r}: bad range {part!r}")
        cpus.update(range(first, last + 1))
    return cpus


def apply_cpu_settings(cpus: str, num_threads: int) -> None:
    """Pin the process to ``cpus`` (``--cpus``; empty: no pinning) and size torch's thread
    pool to ``num_threads`` (0: the pinned CPUs, or leave torch's default when not pinned)."""
    import torch

    if cpus:
        os.sched_setaffinity(0, parse_cpus(cpus))
    threads = num_threads or (len(os.sched_getaffinity(0)) if cpus else 0)
    if threads:
        torch.set_num_threads(threads)

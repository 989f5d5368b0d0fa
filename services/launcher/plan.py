"""What ``pdserve up`` starts: its flags, and the command line of each child (workers, the
node's kvstore, the router), with the core split of ``--pin-cores``."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

from engine.args import EngineArgs
from engine.config import is_cuda_device
from engine.runner.core_share import create_share_file
from services.common.auth import add_api_key_arguments, api_key_argv, api_key_env
from services.common.engine_flags import add_engine_arguments, engine_args_from, engine_argv
from services.common.grpc_server import DEFAULT_GRACE_S
from services.common.internal_auth import add_internal_auth_arguments
from services.common.ports import free_port
from services.common.settings import add_env_argument
from services.common.wire import TRANSFERS
from services.index.settings import add_redis_url_argument
from services.launcher.child import HOST, Child
from services.launcher.supervisor import RestartPolicy

DESCRIPTION = ("pdserve up: the local cluster — N prefill + M decode workers, the node's kvstore "
               "and a router, one process each, restarted when they die")

# Unpinned workers share every core, each with an OpenMP pool as wide as the machine: a
# decode step then gets every core while prefill is idle (most of the time) and they split
# the cores while both work. After a parallel region libgomp spins 300,000 iterations before
# it sleeps, so two pools spin against each other's work; a short spin still covers the
# microseconds between the regions of one step. Measured on 2 cores, 1 prefill + 1 decode, the
# 196/128-token load at concurrency 16: 147 output tok/s with libgomp's default spin, 221 with
# this one, 166 with each worker pinned to its own core (--pin-cores), 279 colocated; at
# concurrency 1, 39.6 tok/s shared against 24.4 pinned. On top of that the workers share a
# core-share file (shared_cores_file): while both compute, each step runs on half the threads
# (2026-11-27, distinct prompts: 0.58-0.60x colocated at c=16 -> 0.75-0.89x, c=1 ITL unchanged).
SHARED_CORES_SPIN_COUNT = "20000"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve up", description=DESCRIPTION)
    add = add_env_argument
    add(parser, "--prefill", type=int, default=1, help="number of prefill workers")
    add(parser, "--decode", type=int, default=1, help="number of decode workers")
    add(parser, "--colocated", action="store_true",
        help="one router process with its own engine (prefill and decode together)")
    add(parser, "--transfer", choices=TRANSFERS, default="nixl", help="KV transport")
    add(parser, "--http-port", type=int, default=8000, help="router OpenAI HTTP port")
    add(parser, "--grpc-port", type=int, default=50051, help="router gRPC port")
    add(parser, "--pin-cores", action="store_true",
        help="split this process's CPUs: prefill workers on one half, decode workers on the other")
    add(parser, "--worker-args", default="",
        help="extra flags for every worker (after the engine flags, so they win), "
             "e.g. '--reservation-lease-ms 30000'")
    add(parser, "--router-args", default="",
        help="extra flags for the router (after the others, so they win), e.g. "
             "'--local-prefill-max-tokens 512'")
    add(parser, "--kvstore-gib", type=float, default=1.0,
        help="capacity of the node's kvstore (one `pdserve serve kvstore` child); 0: none")
    add(parser, "--log-dir", default="", help="children's logs (default: a new temp dir)")
    add(parser, "--startup-timeout-s", type=float, default=300.0, help="wait this long for SERVING")
    add(parser, "--drain-grace-s", type=float, default=DEFAULT_GRACE_S,
        help="on SIGINT/SIGTERM, seconds in-flight requests may still run")
    policy = RestartPolicy()
    add(parser, "--max-restarts", type=int, default=policy.max_restarts,
        help="a child that dies once `up` is ready is restarted on its port, at most this many "
             "times within --restart-window-s (backoff from "
             f"{policy.initial_backoff_s:g} s, doubling); one more death ends `up`. 0: a death ends it")
    add(parser, "--restart-window-s", type=float, default=policy.window_s,
        help="the window --max-restarts counts in")
    add_redis_url_argument(parser, "Redis of the prefix index, e.g. redis://10.0.0.5:6379/0 (default: "
                                   "start an embedded redis-server on a free loopback port)")
    add_api_key_arguments(parser)
    add_internal_auth_arguments(parser)
    add_engine_arguments(parser)
    return parser


def gpu_share(engine_args: EngineArgs, num_engines: int) -> EngineArgs:
    """The engine settings of one of ``num_engines`` worker processes on one CUDA device: an
    equal part of ``gpu_memory_utilization`` each (each engine sizes its KV cache from its part;
    all of them at 0.9 would leave the second nothing). Unchanged on a CPU."""
    if not is_cuda_device(engine_args.device) or num_engines <= 1:
        return engine_args
    return replace(engine_args, gpu_memory_utilization=engine_args.gpu_memory_utilization / num_engines)


def cpu_split(num_prefill: int, num_decode: int) -> tuple[list[int], list[int]] | None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    half = max(1, len(cpus) * num_prefill // (num_prefill + num_decode))
    half = min(half, len(cpus) - 1)
    return cpus[:half], cpus[half:]


def shared_cores_file(args: argparse.Namespace, log_dir: Path) -> Path | None:
    """The core-share file of workers that share every core on a CPU (engine/runner/core_share.py:
    each step on the cores divided by the workers busy then), or None: colocated, one worker, or
    CUDA."""
    num_workers = args.prefill + args.decode
    if args.colocated or num_workers < 2 or is_cuda_device(engine_args_from(args).device):
        return None
    return create_share_file(log_dir / "core-share", num_workers)


def plan(args: argparse.Namespace, log_dir: Path, kvstore_address: str = "") -> tuple[list[Child], Child]:
    """The worker processes and the router process to start. Each gets ``--model`` and every
    engine flag whose value in ``args`` differs from its default (the user's, from the command
    line or ``PDSERVE_*``); the workers' ``--num-threads`` from the core split comes before
    them, so one the user gave wins, and ``--worker-args`` come last (``--router-args`` last in
    the router's). ``args.redis_url``
    (when set) goes to every worker and the router, ``kvstore_address`` (the node's kvstore,
    when one runs) to every worker."""
    workers: list[Child] = []
    extra = args.worker_args.split()
    index_argv = ["--redis-url", args.redis_url] if getattr(args, "redis_url", "") else []
    kvstore_argv = ["--kvstore-address", kvstore_address] if kvstore_address else []
    model = ["--model", args.model] if args.model else []
    engine_args = engine_args_from(args)
    engine = [*model, *engine_argv(engine_args)]
    # every worker's engine shares the one GPU: each gets its part of --gpu-memory-utilization
    worker_engine = [*model, *engine_argv(gpu_share(engine_args, args.prefill + args.decode))]
    split = cpu_split(args.prefill, args.decode) if args.pin_cores else None
    share = shared_cores_file(args, log_dir) if split is None else None
    if not args.colocated:
        for role, count, index in (("prefill", args.prefill, 0), ("decode", args.decode, 1)):
            if split is not None:
                cpus = split[index]
                cpu_args = ["--cpus", ",".join(map(str, cpus)),
                            "--num-threads", str(max(1, len(cpus) // count))]
            else:  # every worker may use every core; SHARED_CORES_SPIN_COUNT keeps them fair
                cpu_args = ["--num-threads", str(len(os.sched_getaffinity(0)))]
            for i in range(count):
                port = free_port()
                name = f"{role}-{i}"
                share_args = [] if share is None else ["--core-share", f"{share}:{len(workers)}"]
                workers.append(Child(name, [
                    "-m", "services.cli", "serve", role, "--host", HOST, "--port", str(port),
                    "--worker-id", name, "--transfer", args.transfer,
                    "--drain-grace-s", str(args.drain_grace_s), *cpu_args, *share_args, *index_argv,
                    *kvstore_argv, *worker_engine, *extra],
                    f"{HOST}:{port}", log_dir / f"{name}.log"))
    router_argv = ["-m", "services.cli", "serve", "router", "--http-port", str(args.http_port),
                   "--grpc-port", str(args.grpc_port), *index_argv, *api_key_argv(args), *engine]
    if args.colocated:
        router_argv.append("--colocated")
    else:
        router_argv += [
            "--prefill", ",".join(w.grpc_address for w in workers if w.name.startswith("prefill")),
            "--decode", ",".join(w.grpc_address for w in workers if w.name.startswith("decode")),
            "--transfer", args.transfer]
    router_argv += args.router_args.split()
    router = Child("router", router_argv, f"{HOST}:{args.grpc_port}", log_dir / "router.log",
                   env=api_key_env(args, os.environ), http_port=args.http_port)
    return workers, router


def plan_kvstore(args: argparse.Namespace, log_dir: Path) -> Child | None:
    """The node's kvstore process (one per ``up``), or None with ``--kvstore-gib 0``; it
    publishes its blocks to the prefix index when ``args.redis_url`` is set."""
    if args.kvstore_gib <= 0:
        return None
    port = free_port()
    index_argv = ["--redis-url", args.redis_url] if getattr(args, "redis_url", "") else []
    return Child("kvstore", ["-m", "services.cli", "serve", "kvstore", "--host", HOST,
                             "--port", str(port), "--kvstore-gib", str(args.kvstore_gib),
                             "--transfer", args.transfer, "--drain-grace-s", str(args.drain_grace_s),
                             *index_argv],
                 f"{HOST}:{port}", log_dir / "kvstore.log")

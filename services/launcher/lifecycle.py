"""``pdserve up`` from start to exit: the index's Redis, then the workers and the kvstore,
then the router; the ``ready`` line; supervision (supervisor.py) until SIGINT / SIGTERM or a
child whose restarts ran out; then the router drains first, the workers after it."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path

from services.index.redis_server import EmbeddedRedis
from services.launcher.child import HOST, Child, ChildFailed, stop_children, wait_serving
from services.launcher.credentials import TOKEN_FILE, internal_auth_env, write_token_file
from services.launcher.plan import SHARED_CORES_SPIN_COUNT, plan, plan_kvstore
from services.launcher.supervisor import RestartPolicy, Supervisor, say

_NIXL_PROBE = ("from nixl import _api; "
               "_api.nixl_agent('pdserve-probe', _api.nixl_agent_config(backends=['UCX']))")


async def run(args: argparse.Namespace) -> int:
    env = {**os.environ, **internal_auth_env(args)}
    env.setdefault("UCX_NET_DEVICES", "lo")
    if not args.colocated and not args.pin_cores:
        env.setdefault("GOMP_SPINCOUNT", SHARED_CORES_SPIN_COUNT)
    if args.transfer == "nixl" and not args.colocated:
        reason = nixl_usable(env)
        if reason is not None:
            say(f"warning: NIXL is not usable here ({reason}); using --transfer grpc")
            args.transfer = "grpc"
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    say(f"logs in {log_dir}")
    write_token_file(log_dir / TOKEN_FILE, args.internal_token)
    # On this thread: the server dies with the thread that started it (PR_SET_PDEATHSIG).
    redis_server = None if args.colocated or args.redis_url else start_redis()
    if redis_server is not None:
        args.redis_url = redis_server.url
    try:
        return await _run_children(args, env, log_dir)
    finally:
        if redis_server is not None:
            await asyncio.to_thread(redis_server.close)


def nixl_usable(env: dict[str, str]) -> str | None:
    """None if a NIXL UCX agent can be created here, else why not (probed in a child)."""
    try:
        probe = subprocess.run([sys.executable, "-c", _NIXL_PROBE], env=env, capture_output=True,
                               text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "the NIXL probe timed out"
    if probe.returncode == 0:
        return None
    return (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]


def start_redis() -> EmbeddedRedis | None:
    """The embedded index server, or None (with a warning: routing is then by load only)."""
    try:
        server = EmbeddedRedis.start()
    except (FileNotFoundError, RuntimeError, OSError) as exc:
        say(f"warning: no prefix index ({exc}); routing by load only")
        return None
    say(f"prefix index at {server.url}")
    return server


async def _run_children(args: argparse.Namespace, env: dict[str, str], log_dir: Path) -> int:
    kvstore = plan_kvstore(args, log_dir)
    workers, router = plan(args, log_dir, kvstore.grpc_address if kvstore is not None else "")
    if kvstore is not None:
        say(f"kvstore at {kvstore.grpc_address}")
        workers = [kvstore, *workers]

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    started: list[Child] = []
    try:
        deadline = time.monotonic() + args.startup_timeout_s
        for child in workers:
            child.start(env)
            started.append(child)
        # While starting, a child that exits fails `up` with its exit code and log tail.
        if not await _until_stopped(stop, asyncio.gather(*(wait_serving(w, deadline) for w in workers))):
            return 0
        router.start(env)
        started.append(router)
        if not await _until_stopped(stop, wait_serving(router, deadline)):
            return 0
        print(f"ready http={HOST}:{args.http_port} grpc={HOST}:{args.grpc_port}", flush=True)
        policy = RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window_s)
        await _until_stopped(stop, Supervisor(started, env, policy, args.startup_timeout_s).run())
        return 0
    except ChildFailed as exc:
        say(f"error: {exc}")
        code = exc.child.exit_code()
        return code if code else 1
    finally:  # the router drains first (it stops taking requests), then the workers
        await asyncio.to_thread(stop_children, [c for c in started if c is router], args.drain_grace_s)
        await asyncio.to_thread(stop_children, [c for c in started if c is not router],
                                args.drain_grace_s)


async def _until_stopped(stop: asyncio.Event, work: Awaitable[object]) -> bool:
    """Run ``work``; False (and ``work`` cancelled) if ``stop`` is set first."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # raises ChildFailed
            return True
        return False
    finally:
        for pending in (task, stopper):
            if not pending.done():
                pending.cancel()
        await asyncio.gather(task, return_exceptions=True)  # a cancelled supervisor has let go


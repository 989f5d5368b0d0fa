"""``pdserve up``: the local cluster — N prefill + M decode workers, the node's kvstore and a
router, one process each.

    pdserve up [--prefill N] [--decode M] [--colocated] [--transfer nixl|grpc] [--model PATH]
               [--http-port 8000] [--grpc-port 50051] [--pin-cores] [--kvstore-gib 1.0]
               [engine flags] ...
               (each also PDSERVE_*)

Workers and the kvstore start first (on free loopback ports), then the router pointed at the
workers (or, with ``--colocated``, the router alone with its own engine). The engine flags
(``--num-kv-blocks``, ``--spec-method``, ...: services/common/engine_flags.py) and ``--model``
go to every engine child: each worker's engine, or the colocated router's; a router in front of workers reads only
``--model`` and ``--max-model-len`` of them. When every service reports SERVING
on grpc.health.v1 (and the router's ``/health`` answers 200), exactly one line goes to stdout::

    ready http=127.0.0.1:8000 grpc=127.0.0.1:50051

Children write to ``<log dir>/<name>.log``. A child that exits early fails ``up`` with its
exit code and the tail of its log. SIGINT / SIGTERM drain the router first, then the workers
(SIGTERM, ``--drain-grace-s``), then kill what is left. Children get SIGTERM from the kernel
if ``up`` itself dies (Linux ``PR_SET_PDEATHSIG``), so nothing is orphaned.

``--transfer nixl`` (the default) falls back to grpc, with a warning, when NIXL cannot create
a UCX agent here. UCX is pinned to loopback (``UCX_NET_DEVICES=lo``) unless already set.

Security: ``up`` makes a random internal token per launch (``secrets.token_urlsafe``) and hands
it to every child in ``PDSERVE_INTERNAL_TOKEN`` (never in argv, which ps shows), so only its own
processes reach the workers and the kvstore (it is also written, mode 0600, to
``<log dir>/internal-token`` for operator tools); ``--tls-cert/--tls-key/--tls-ca`` add mutual TLS
(the paths go to the children as ``PDSERVE_TLS_*``). ``--api-key`` / ``PDSERVE_API_KEY`` /
``--api-key-file`` / ``--metrics-auth`` go to the router (keys through its environment).

Cores: by default every worker may use every core (``SHARED_CORES_SPIN_COUNT`` says why and
what it measured); ``--pin-cores`` gives the prefill workers one part of the CPUs and the decode
workers the rest, so a prefill never takes a decode step's core (tail ITL isolation, at the
price of throughput on a small machine).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.common.auth import add_api_key_arguments, api_key_argv, api_key_env, api_keys_from
from services.common.engine_flags import add_engine_arguments, engine_args_from, engine_argv
from services.common.grpc_server import DEFAULT_GRACE_S
from services.common.health import SERVING, check_health
from services.common.internal_auth import TOKEN_ENV, add_internal_auth_arguments, install_from_args
from services.common.ports import free_port
from services.common.settings import add_env_argument
from services.index.redis_server import EmbeddedRedis
from services.index.settings import add_redis_url_argument

HOST = "127.0.0.1"
TOKEN_FILE = "internal-token"  # in the log dir: the launch's internal token, mode 0600
REPO_ROOT = Path(__file__).resolve().parents[1]
# Run in each child before exec: die with the launcher (the setting survives execv).
_DEATHSIG_SHIM = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
                  "os.getppid() == int(sys.argv[1]) or sys.exit(70); "
                  "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])")
_NIXL_PROBE = ("from nixl import _api; "
               "_api.nixl_agent('pdserve-probe', _api.nixl_agent_config(backends=['UCX']))")


# Unpinned workers share every core, each with an OpenMP pool as wide as the machine: a
# decode step then gets every core while prefill is idle (most of the time) and they split
# the cores while both work. After a parallel region libgomp spins 300,000 iterations before
# it sleeps, so two pools spin against each other's work; a short spin still covers the
# microseconds between the regions of one step. Measured on 2 cores, 1 prefill + 1 decode, the
# 196/128-token load at concurrency 16: 147 output tok/s with libgomp's default spin, 221 with
# this one, 166 with each worker pinned to its own core (--pin-cores), 279 colocated; at
# concurrency 1, 39.6 tok/s shared against 24.4 pinned.
SHARED_CORES_SPIN_COUNT = "20000"


class ChildFailed(RuntimeError):
    def __init__(self, child: Child, message: str) -> None:
        super().__init__(message)
        self.child = child


@dataclass
class Child:
    name: str
    argv: list[str]
    grpc_address: str
    log_path: Path
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)  # on top of the launcher's (e.g. API keys)

    def start(self, env: dict[str, str]) -> None:
        env = {**env, **self.env}
        with open(self.log_path, "ab") as log:
            if sys.platform == "linux":
                argv = [sys.executable, "-c", _DEATHSIG_SHIM, str(os.getpid()), *self.argv]
            else:
                argv = [sys.executable, *self.argv]
            # Own session: a terminal's Ctrl-C reaches only `up`, which stops the children in
            # order (router first); PDEATHSIG still ties them to `up`.
            self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def log_tail(self, num_lines: int = 25) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-num_lines:])

    def failure(self) -> ChildFailed | None:
        code = self.proc.poll() if self.proc else None
        if code is None:
            return None
        return ChildFailed(self, f"{self.name} exited with code {code}; last lines of "
                                 f"{self.log_path}:\n{self.log_tail()}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve up", description=__doc__.split("\n\n")[0])
    add = add_env_argument
    add(parser, "--prefill", type=int, default=1, help="number of prefill workers")
    add(parser, "--decode", type=int, default=1, help="number of decode workers")
    add(parser, "--colocated", action="store_true",
        help="one router process with its own engine (prefill and decode together)")
    add(parser, "--transfer", choices=["nixl", "grpc"], default="nixl", help="KV transport")
    add(parser, "--http-port", type=int, default=8000, help="router OpenAI HTTP port")
    add(parser, "--grpc-port", type=int, default=50051, help="router gRPC port")
    add(parser, "--pin-cores", action="store_true",
        help="split this process's CPUs: prefill workers on one half, decode workers on the other")
    add(parser, "--worker-args", default="",
        help="extra flags for every worker (after the engine flags, so they win), "
             "e.g. '--reservation-lease-ms 30000'")
    add(parser, "--kvstore-gib", type=float, default=1.0,
        help="capacity of the node's kvstore (one `pdserve serve kvstore` child); 0: none")
    add(parser, "--log-dir", default="", help="children's logs (default: a new temp dir)")
    add(parser, "--startup-timeout-s", type=float, default=300.0, help="wait this long for SERVING")
    add(parser, "--drain-grace-s", type=float, default=DEFAULT_GRACE_S,
        help="on SIGINT/SIGTERM, seconds in-flight requests may still run")
    add_redis_url_argument(parser, "Redis of the prefix index, e.g. redis://10.0.0.5:6379/0 (default: "
                                   "start an embedded redis-server on a free loopback port)")
    add_api_key_arguments(parser)
    add_internal_auth_arguments(parser)
    add_engine_arguments(parser)
    return parser


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


def cpu_split(num_prefill: int, num_decode: int) -> tuple[list[int], list[int]] | None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    half = max(1, len(cpus) * num_prefill // (num_prefill + num_decode))
    half = min(half, len(cpus) - 1)
    return cpus[:half], cpus[half:]


def plan(args: argparse.Namespace, log_dir: Path, kvstore_address: str = "") -> tuple[list[Child], Child]:
    """The worker processes and the router process to start. Each gets ``--model`` and every
    engine flag whose value in ``args`` differs from its default (the user's, from the command
    line or ``PDSERVE_*``); the workers' ``--num-threads`` from the core split comes before
    them, so one the user gave wins, and ``--worker-args`` come last. ``args.redis_url``
    (when set) goes to every worker and the router, ``kvstore_address`` (the node's kvstore,
    when one runs) to every worker."""
    workers: list[Child] = []
    extra = args.worker_args.split()
    index_argv = ["--redis-url", args.redis_url] if getattr(args, "redis_url", "") else []
    kvstore_argv = ["--kvstore-address", kvstore_address] if kvstore_address else []
    engine = [*(["--model", args.model] if args.model else []), *engine_argv(engine_args_from(args))]
    split = cpu_split(args.prefill, args.decode) if args.pin_cores else None
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
                workers.append(Child(name, [
                    "-m", "services.cli", "serve", role, "--host", HOST, "--port", str(port),
                    "--worker-id", name, "--transfer", args.transfer,
                    "--drain-grace-s", str(args.drain_grace_s), *cpu_args, *index_argv, *kvstore_argv, *engine, *extra],
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
    router = Child("router", router_argv, f"{HOST}:{args.grpc_port}", log_dir / "router.log",
                   env=api_key_env(args, os.environ))
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


async def wait_serving(child: Child, deadline: float, http_port: int | None = None) -> None:
    """Until ``child`` is SERVING (and its HTTP /health is 200); ChildFailed if it exits."""
    last = "no answer"
    while time.monotonic() < deadline:
        failure = child.failure()
        if failure is not None:
            raise failure
        try:
            is_internal = http_port is None  # the router's gRPC port is its public one
            if await check_health(child.grpc_address, timeout_s=1.0, is_internal=is_internal) == SERVING:
                if http_port is None or await asyncio.to_thread(_http_ok, http_port):
                    return
                last = "gRPC SERVING, HTTP /health not yet 200"
            else:
                last = "NOT_SERVING"
        except Exception as exc:  # noqa: BLE001 - not up yet
            last = f"{type(exc).__name__}"
        await asyncio.sleep(0.2)
    raise ChildFailed(child, f"{child.name} not ready after the startup timeout ({last}); last "
                             f"lines of {child.log_path}:\n{child.log_tail()}")


def _http_ok(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=1.0) as reply:
            return reply.status == 200
    except OSError:
        return False


def stop_children(children: Sequence[Child], grace_s: float) -> None:
    """SIGTERM all of ``children``, wait up to ``grace_s`` + 5 s, then SIGKILL the rest."""
    for child in children:
        if child.proc is not None and child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s + 5
    for child in children:
        if child.proc is None:
            continue
        try:
            child.proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()


async def run(args: argparse.Namespace) -> int:
    env = {**os.environ, **internal_auth_env(args)}
    env.setdefault("UCX_NET_DEVICES", "lo")
    if not args.colocated and not args.pin_cores:
        env.setdefault("GOMP_SPINCOUNT", SHARED_CORES_SPIN_COUNT)
    if args.transfer == "nixl" and not args.colocated:
        reason = nixl_usable(env)
        if reason is not None:
            print(f"pdserve up: warning: NIXL is not usable here ({reason}); using --transfer grpc",
                  file=sys.stderr, flush=True)
            args.transfer = "grpc"
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"pdserve up: logs in {log_dir}", file=sys.stderr, flush=True)
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


def prepare_auth(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Check the API keys (a bad one fails ``up`` before anything starts), set
    ``args.internal_token`` to the user's token or a new random one (one per launch) and install
    it in this process, which probes its children with it. Errors are ``parser.error``."""
    try:
        api_keys_from(args)
    except ValueError as error:
        parser.error(f"API keys: {error}")
    auth = install_from_args(args, parser)
    args.internal_token = auth.token or secrets.token_urlsafe(32)
    args.internal_token_file = ""
    install_from_args(args, parser)


def write_token_file(path: Path, token: str) -> None:
    """The launch's internal token, readable by its user only, for operator tools
    (``pdserve health --internal-token-file``, a script reading GetStats)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode otherwise
    with os.fdopen(fd, "w") as file:
        file.write(token + "\n")


def internal_auth_env(args: argparse.Namespace) -> dict[str, str]:
    """The children's internal credentials: ``args.internal_token`` (what ``--internal-token``,
    its file or env gave, as installed in this process) or a new random token, and absolute
    ``--tls-*`` paths. Environment only: argv shows in ps."""
    env = {TOKEN_ENV: args.internal_token}
    for flag in ("tls_cert", "tls_key", "tls_ca"):
        if getattr(args, flag):
            env[f"PDSERVE_{flag.upper()}"] = str(Path(getattr(args, flag)).resolve())
    return env


def start_redis() -> EmbeddedRedis | None:
    """The embedded index server, or None (with a warning: routing is then by load only)."""
    try:
        server = EmbeddedRedis.start()
    except (FileNotFoundError, RuntimeError, OSError) as exc:
        print(f"pdserve up: warning: no prefix index ({exc}); routing by load only",
              file=sys.stderr, flush=True)
        return None
    print(f"pdserve up: prefix index at {server.url}", file=sys.stderr, flush=True)
    return server


async def _run_children(args: argparse.Namespace, env: dict[str, str], log_dir: Path) -> int:
    kvstore = plan_kvstore(args, log_dir)
    workers, router = plan(args, log_dir, kvstore.grpc_address if kvstore is not None else "")
    if kvstore is not None:
        print(f"pdserve up: kvstore at {kvstore.grpc_address}", file=sys.stderr, flush=True)
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
        if not await _until_stopped(stop, asyncio.gather(*(wait_serving(w, deadline) for w in workers))):
            return 0
        router.start(env)
        started.append(router)
        if not await _until_stopped(stop, wait_serving(router, deadline, args.http_port)):
            return 0
        print(f"ready http={HOST}:{args.http_port} grpc={HOST}:{args.grpc_port}", flush=True)
        while not stop.is_set():
            for child in started:
                failure = child.failure()
                if failure is not None:
                    raise failure
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
        return 0
    except ChildFailed as exc:
        print(f"pdserve up: error: {exc}", file=sys.stderr, flush=True)
        code = exc.child.proc.poll() if exc.child.proc else None
        return code if code else 1
    finally:  # the router drains first (it stops taking requests), then the workers
        await asyncio.to_thread(stop_children, [c for c in started if c is router], args.drain_grace_s)
        await asyncio.to_thread(stop_children, [c for c in started if c is not router],
                                args.drain_grace_s)


async def _until_stopped(stop: asyncio.Event, work) -> bool:
    """Run ``work``; False (and ``work`` cancelled) if ``stop`` is set first."""
    work = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({work, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            work.result()  # raises ChildFailed
            return True
        return False
    finally:
        for task in (work, stopper):
            if not task.done():
                task.cancel()


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    prepare_auth(args, parser)
    if args.prefill < 1 or args.decode < 1:
        build_parser().error("--prefill and --decode must be >= 1")
    if args.kvstore_gib < 0:
        build_parser().error(f"--kvstore-gib must be >= 0 (0: no kvstore), got {args.kvstore_gib}")
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()

"""``pdserve up``: the local cluster — N prefill + M decode workers, the node's kvstore and a
router, one process each.

    pdserve up [--prefill N] [--decode M] [--colocated] [--transfer nixl|grpc] [--model PATH]
               [--http-port 8000] [--grpc-port 50051] [--pin-cores] [--kvstore-gib 1.0]
               [--max-restarts 5] [--restart-window-s 60] [engine flags] ...
               (each also PDSERVE_*)

Workers and the kvstore start first (on free loopback ports), then the router pointed at the
workers (or, with ``--colocated``, the router alone with its own engine). The engine flags
(``--num-kv-blocks``, ``--spec-method``, ...: services/common/engine_flags.py) and ``--model``
go to every engine child: each worker's engine, or the colocated router's; a router in front of workers reads only
``--model`` and ``--max-model-len`` of them. When every service reports SERVING
on grpc.health.v1 (and the router's ``/health`` answers 200), exactly one line goes to stdout::

    ready http=127.0.0.1:8000 grpc=127.0.0.1:50051

Children write to ``<log dir>/<name>.log``. A child that exits before ``ready`` fails ``up``
with its exit code and the tail of its log. After ``ready`` a child that dies is restarted on
the same port(s) with backoff, at most ``--max-restarts`` times within ``--restart-window-s``
(supervisor.py), while the survivors serve; one line on stderr per death and per restart; ``up``
exits when a child's restarts run out. SIGINT / SIGTERM drain the router first, then the
workers (SIGTERM, ``--drain-grace-s``), then kill what is left. Children get SIGTERM from the kernel
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

Files: plan.py (flags, each child's command line), child.py (one process), credentials.py,
supervisor.py (restarts), lifecycle.py (start, ready, stop).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from services.common.ports import free_port
from services.launcher.child import DEATHSIG_SHIM, HOST, REPO_ROOT, Child, ChildFailed
from services.launcher.credentials import TOKEN_FILE, internal_auth_env, prepare_auth, write_token_file
from services.launcher.lifecycle import run
from services.launcher.plan import build_parser, cpu_split, gpu_share, plan, plan_kvstore
from services.launcher.supervisor import RestartPolicy, Supervisor

__all__ = ["DEATHSIG_SHIM", "HOST", "REPO_ROOT", "TOKEN_FILE", "Child", "ChildFailed", "RestartPolicy",
           "Supervisor", "build_parser", "cpu_split", "free_port", "gpu_share", "internal_auth_env", "main", "plan",
           "plan_kvstore", "prepare_auth", "run", "write_token_file"]


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    prepare_auth(args, parser)
    if args.prefill < 1 or args.decode < 1:
        parser.error("--prefill and --decode must be >= 1")
    if args.kvstore_gib < 0:
        parser.error(f"--kvstore-gib must be >= 0 (0: no kvstore), got {args.kvstore_gib}")
    if args.max_restarts < 0 or args.restart_window_s <= 0:
        parser.error(f"--max-restarts must be >= 0 and --restart-window-s > 0, got "
                     f"{args.max_restarts} and {args.restart_window_s}")
    sys.exit(asyncio.run(run(args)))

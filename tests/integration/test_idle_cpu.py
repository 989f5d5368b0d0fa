"""Nothing spins at rest: every service, idle, uses under 2% of one core.

Real processes, started the way ``pdserve up`` starts them: a router with one prefill and one
decode worker for each transfer (NIXL over UCX, and gRPC), a kvstore (with NIXL), and a
colocated router with its own engine (on two threads, so its OpenMP pool exists). Once all
are SERVING and have settled, each process's CPU time (user + system, every thread) is read
from ``/proc/<pid>/stat`` over ``WINDOW_S`` seconds. A busy-polling thread (NIXL's progress thread, an asyncio loop that
sleeps 0, an OpenMP pool told to spin) shows up as tens of percent; the periodic work a service
does at rest (health and stats polls, lease housekeeping) is a fraction of one percent.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtests.cluster import cpu_seconds
from loadtests.cluster import thread_cpu_seconds as thread_cpu_seconds_by_id
from tests.integration.cluster_fixtures import (
    REPO,
    WorkerProcess,
    free_port,
    start_kvstore,
    start_router,
    start_worker,
    stop_all,
    wait_serving,
)

pytestmark = pytest.mark.slow

WINDOW_S = 10.0
SETTLE_S = 3.0  # after SERVING: first health/stats polls, lazy imports, the model's first touch
MAX_CORE_FRACTION = 0.02


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """{'<tid> <name>': CPU seconds} for the failure message: which thread spins."""
    return {f"{tid} {name}": seconds for (tid, name), seconds in thread_cpu_seconds_by_id(pid).items()}


def start_colocated(log_dir: Path) -> WorkerProcess:
    grpc_port, http_port = free_port(), free_port()
    log_path = log_dir / f"colocated-{grpc_port}.log"
    argv = [sys.executable, "-m", "services.cli", "serve", "router", "--colocated",
            "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--drain-grace-s", "2"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    return WorkerProcess("colocated", f"127.0.0.1:{grpc_port}", log_path, proc, argv)


@pytest.fixture(scope="module")
def idle_services(tmp_path_factory):
    """{name: process} for every service kind, all SERVING."""
    log_dir = tmp_path_factory.mktemp("idle")
    services: dict[str, WorkerProcess] = {}
    try:
        for transfer in ("nixl", "grpc"):
            services[f"{transfer} prefill"] = start_worker("prefill", log_dir, transfer=transfer)
            services[f"{transfer} decode"] = start_worker("decode", log_dir, transfer=transfer)
        services["colocated"] = start_colocated(log_dir)
        services["kvstore"] = start_kvstore(log_dir, "--kvstore-gib", "0.05")
        wait_serving(list(services.values()))
        for transfer in ("nixl", "grpc"):
            services[f"{transfer} router"] = start_router(
                log_dir, [services[f"{transfer} prefill"]], [services[f"{transfer} decode"]], transfer)
        wait_serving([services["nixl router"], services["grpc router"]])
        yield services
    finally:
        stop_all(list(services.values()))


def test_every_idle_service_uses_under_two_percent_of_a_core(idle_services):
    time.sleep(SETTLE_S)
    pids = {name: service.proc.pid for name, service in idle_services.items()}
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    threads_before = {name: thread_cpu_seconds(pid) for name, pid in pids.items()}
    started = time.monotonic()
    time.sleep(WINDOW_S)
    elapsed = time.monotonic() - started
    usage = {name: (cpu_seconds(pid) - before[name]) / elapsed for name, pid in pids.items()}
    busy = {name: fraction for name, fraction in usage.items() if fraction >= MAX_CORE_FRACTION}
    if busy:
        detail = []
        for name in busy:
            after = thread_cpu_seconds(pids[name])
            spent = sorted(((after[t] - threads_before[name].get(t, 0.0)) / elapsed, t) for t in after)
            detail.append(f"{name}: " + ", ".join(f"{t} {f:.1%}" for f, t in spent[-3:][::-1]))
        pytest.fail("idle services use CPU: "
                    + ", ".join(f"{name} {fraction:.1%}" for name, fraction in sorted(usage.items()))
                    + "\nbusiest threads: " + "; ".join(detail))
    for service in idle_services.values():
        assert service.proc.poll() is None, f"{service.role} exited:\n{service.log_tail()}"

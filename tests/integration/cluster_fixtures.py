"""Real worker (and router) processes on loopback for the cluster tests: start, wait for
SERVING, stats, kill.

Each worker is ``python -m services.cli serve prefill|decode`` on a free port, logging to a
file under the test's tmp dir (its tail is shown when it fails to start). NIXL runs over
UCX on loopback (``UCX_NET_DEVICES=lo``). The test process never imports NIXL.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from services.common.health import SERVING, check_health
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.common.ports import free_port

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread inside: the offline oracle shares the cores with worker processes,
    and torch's spinning thread pool slows to a crawl when it has to wait for them."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def oracle_llm(*args: Any, **kwargs: Any) -> Iterator[Any]:
    """Body of a module fixture: the offline engine ``LLM(*args, **kwargs)``, on one thread."""
    from engine import LLM

    with one_thread():
        yield LLM(*args, **kwargs)


@dataclass
class WorkerProcess:
    role: str
    address: str
    log_path: Path
    proc: subprocess.Popen
    args: list[str] = field(default_factory=list)

    def stats(self, timeout_s: float = 2.0) -> worker_pb2.WorkerStats:
        with grpc.insecure_channel(self.address) as channel:
            return worker_pb2_grpc.WorkerServiceStub(channel).GetStats(
                worker_pb2.GetStatsRequest(), timeout=timeout_s)

    def log_tail(self, num_lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def restart(process: WorkerProcess, env: dict[str, str] | None = None) -> WorkerProcess:
    """The same command on the same port, once ``process`` has exited (its log appended; the
    environment is this test's plus ``env``, so faults it was started with are gone)."""
    assert process.proc.poll() is not None, f"{process.address} is still running"
    full_env = {**os.environ, "UCX_NET_DEVICES": "lo", "PYTHONPATH": str(REPO), **(env or {})}
    with open(process.log_path, "ab") as log:
        proc = subprocess.Popen(process.args, cwd=REPO, env=full_env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT)
    return WorkerProcess(process.role, process.address, process.log_path, proc, process.args)


def stop_all(processes: list[WorkerProcess]) -> None:
    """SIGTERM every process at once, then wait for each (SIGKILL after 15 s)."""
    for process in processes:
        if process.proc.poll() is None:
            process.proc.send_signal(signal.SIGTERM)
    for process in processes:
        process.stop()


def start_worker(role: str, log_dir: Path, *args: str, transfer: str = "nixl",
                 env: dict[str, str] | None = None) -> WorkerProcess:
    """``env``: extra environment variables (e.g. PDSERVE_FAULTS) for this process only."""
    port = free_port()
    log_path = log_dir / f"{role}-{port}.log"
    env = {**os.environ, "UCX_NET_DEVICES": "lo", "PYTHONPATH": str(REPO), **(env or {})}
    argv = [sys.executable, "-m", "services.cli", "serve", role, "--port", str(port),
            "--worker-id", f"{role}-{port}", "--transfer", transfer, "--num-threads", "1",
            "--drain-grace-s", "2", *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)
    return WorkerProcess(role, f"127.0.0.1:{port}", log_path, proc, argv)


def start_kvstore(log_dir: Path, *args: str, transfer: str = "nixl",
                  port: int | None = None, env: dict[str, str] | None = None) -> WorkerProcess:
    """``pdserve serve kvstore`` on a free (or the given) port; ``wait_serving`` it next.
    ``env``: extra environment variables (e.g. PDSERVE_FAULTS) for this process only."""
    port = port or free_port()
    log_path = log_dir / f"kvstore-{port}.log"
    env = {**os.environ, "UCX_NET_DEVICES": "lo", "PYTHONPATH": str(REPO), **(env or {})}
    argv = [sys.executable, "-m", "services.cli", "serve", "kvstore", "--port", str(port),
            "--transfer", transfer, "--drain-grace-s", "2", *args]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)
    return WorkerProcess("kvstore", f"127.0.0.1:{port}", log_path, proc, argv)


def start_router(log_dir: Path, prefill: list[WorkerProcess], decode: list[WorkerProcess],
                 transfer: str, *extra: str) -> WorkerProcess:
    """``pdserve serve router`` over the given workers (``extra``: more flags); its ``address``
    is the gRPC one."""
    grpc_port, http_port = free_port(), free_port()
    log_path = log_dir / f"router-{transfer}-{grpc_port}.log"
    argv = [sys.executable, "-m", "services.cli", "serve", "router",
            "--grpc-port", str(grpc_port), "--http-port", str(http_port),
            "--prefill", ",".join(w.address for w in prefill),
            "--decode", ",".join(w.address for w in decode), "--transfer", transfer,
            "--drain-grace-s", "2", *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    return WorkerProcess("router", f"127.0.0.1:{grpc_port}", log_path, proc, argv)


def wait_serving(workers: list[WorkerProcess], timeout_s: float = 180.0) -> None:
    """Until every worker is SERVING; fails with the log tail of one that exited or hangs."""
    async def wait_one(worker: WorkerProcess) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if worker.proc.poll() is not None:
                raise RuntimeError(f"{worker.role} worker exited with {worker.proc.returncode}:\n"
                                   f"{worker.log_tail()}")
            try:
                if await check_health(worker.address, timeout_s=1.0) == SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.2)
        raise TimeoutError(f"{worker.role} worker {worker.address} not SERVING after "
                           f"{timeout_s} s:\n{worker.log_tail()}")

    async def wait_all() -> None:
        await asyncio.gather(*(wait_one(w) for w in workers))

    asyncio.run(wait_all())


def wait_all_blocks_free(workers: list[WorkerProcess], timeout_s: float = 2.0) -> dict[str, tuple[int, int]]:
    """Poll GetStats until every worker has all its blocks free; returns the last
    {address: (free, total)} (the caller asserts on it, so a leak shows the numbers)."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = {w.address: (s.num_free_blocks, s.num_total_blocks)
                for w in workers for s in [w.stats()]}
        if all(free == total for free, total in seen.values()) or time.monotonic() > deadline:
            return seen
        time.sleep(0.05)


def prefill_into_receiver(prefill_address: str, request_id: str, prompt: list[int], model_name: str,
                          kv_cache: Any) -> grpc.aio.AioRpcError:
    """Ask the prefill worker at ``prefill_address`` to push ``prompt``'s KV (greedy, gRPC transport)
    to a KVTransferService of this process whose receiver has ``model_name`` and ``kv_cache``; the
    error the Prefill stream ends with (AssertionError if it ends without one)."""
    from engine.sampling_params import SamplingParams
    from services.common.grpc_server import start_grpc_server
    from services.common.pb import kv_pb2_grpc
    from services.common.wire import params_to_proto
    from services.decode.kv_grpc_receiver import KVTransferServicer
    from services.decode.receivers import make_receivers

    async def scenario() -> grpc.aio.AioRpcError:
        (receiver,) = make_receivers("grpc", model_name, kv_cache)
        server = await start_grpc_server(
            [(kv_pb2_grpc.add_KVTransferServiceServicer_to_server, KVTransferServicer(receiver))])
        try:
            async with grpc.aio.insecure_channel(prefill_address) as channel:
                call = worker_pb2_grpc.PrefillServiceStub(channel).Prefill(
                    worker_pb2.PrefillRequest(
                        request_id=request_id, prompt_token_ids=prompt,
                        sampling_params=params_to_proto(SamplingParams(temperature=0.0, max_tokens=8)),
                        decode=worker_pb2.DecodeTarget(address=server.address),
                        transfer_method=worker_pb2.KV_TRANSFER_METHOD_GRPC), timeout=30)
                try:
                    await call.read()
                except grpc.aio.AioRpcError as error:
                    return error
                raise AssertionError("the Prefill stream ended without an error")
        finally:
            await server.stop(0)
            receiver.close()

    return asyncio.run(scenario())

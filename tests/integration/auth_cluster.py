"""A ``pdserve up`` cluster for the authentication tests, and the checks they share.

``up_cluster`` runs 1 prefill + 1 decode worker, the kvstore and the router (``--transfer grpc``,
so KV moves over the gRPC transport) with the given flags, waits for the ready line and reads
each service's gRPC address from its log. The test process itself holds no internal token:
whatever it sends to an internal port is what a stranger on the network could send.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.common.pb import kv_pb2, kv_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.integration.cluster_fixtures import free_port

REPO = Path(__file__).resolve().parents[2]
CLEAN_ENV = {k: v for k, v in os.environ.items()
             if not k.startswith(("PDSERVE_INTERNAL_TOKEN", "PDSERVE_TLS_", "PDSERVE_API_KEY"))}
LISTENING = re.compile(r"listening (?:on|prefill \S+|decode \S+) (127\.0\.0\.1:\d+)")


@dataclass
class UpCluster:
    http: str  # host:port of the router's OpenAI HTTP server
    grpc: str  # host:port of the router's public gRPC API
    internal: dict[str, str]  # "prefill" / "decode" / "kvstore" -> its gRPC address
    log_dir: Path
    proc: subprocess.Popen


def up_cluster(log_dir: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[UpCluster]:
    """Yields the running cluster; SIGTERM (drain) and a bounded wait afterwards."""
    http_port, grpc_port = free_port(), free_port()
    argv = [sys.executable, "-m", "services.cli", "up", "--prefill", "1", "--decode", "1",
            "--transfer", "grpc", "--kvstore-gib", "0.05", "--http-port", str(http_port),
            "--grpc-port", str(grpc_port), "--num-kv-blocks", "64", "--num-threads", "1",
            "--drain-grace-s", "1", "--log-dir", str(log_dir), *flags]
    proc = subprocess.Popen(argv, cwd=REPO, env={**CLEAN_ENV, "PYTHONPATH": str(REPO), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready "), proc.stderr.read() if proc.poll() is not None else line
        internal = {}
        for name in ("prefill-0", "decode-0", "kvstore"):
            match = LISTENING.search((log_dir / f"{name}.log").read_text())
            assert match, (log_dir / f"{name}.log").read_text()
            internal[name.split("-")[0]] = match[1]
        yield UpCluster(f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", internal, log_dir, proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def internal_calls(channel: grpc.Channel) -> dict[str, object]:
    """One non-health call per internal service kind, by name -> a zero-arg callable."""
    stats = worker_pb2_grpc.WorkerServiceStub(channel)
    return {
        "WorkerService.GetStats": lambda: stats.GetStats(worker_pb2.GetStatsRequest(), timeout=10),
        "PrefillService.Prefill": lambda: list(worker_pb2_grpc.PrefillServiceStub(channel).Prefill(
            worker_pb2.PrefillRequest(request_id="x"), timeout=10)),
        "DecodeService.Decode": lambda: list(worker_pb2_grpc.DecodeServiceStub(channel).Decode(
            worker_pb2.DecodeRequest(request_id="x"), timeout=10)),
        "KVTransferService.Handshake": lambda: kv_pb2_grpc.KVTransferServiceStub(channel).Handshake(
            kv_pb2.KVHandshake(), timeout=10),
        "KVTransferService.PushBlocks": lambda: kv_pb2_grpc.KVTransferServiceStub(channel).PushBlocks(
            iter([kv_pb2.PushBlocksChunk(header=kv_pb2.PushBlocksHeader(request_id="x"))]), timeout=10),
        "KVStoreService.Lookup": lambda: kvstore_pb2_grpc.KVStoreServiceStub(channel).Lookup(
            kvstore_pb2.KVStoreLookupRequest(), timeout=10),
    }


SERVICE_OF = {"prefill": ("WorkerService.GetStats", "PrefillService.Prefill"),
              "decode": ("WorkerService.GetStats", "DecodeService.Decode",
                         "KVTransferService.Handshake", "KVTransferService.PushBlocks"),
              "kvstore": ("KVStoreService.Lookup",)}


def refusals(channel_for: dict[str, grpc.Channel]) -> dict[str, str]:
    """``{"role method": status name}`` for every internal call through the given channels."""
    seen = {}
    for role, methods in SERVICE_OF.items():
        calls = internal_calls(channel_for[role])
        for method in methods:
            started = time.monotonic()
            try:
                calls[method]()
                seen[f"{role} {method}"] = "OK"
            except grpc.RpcError as error:
                seen[f"{role} {method}"] = error.code().name
            assert time.monotonic() - started < 10
    return seen

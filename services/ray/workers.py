"""The prefill, decode and kvstore deployments: each replica runs one unchanged
``pdserve serve <role>`` process and publishes its gRPC address in the AddressBook.

Serve's health check is the service's own grpc.health.v1 status, so a worker that stops
SERVING (or exits) is replaced by Serve. KV never passes through these replicas: prefill
workers write to decode workers directly (NIXL or gRPC), as the router tells them.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import ray
from ray import serve

from services.ray.args import PdserveServingArgs
from services.ray.process import ServiceProcess


def publish_host(host: str) -> str:
    """The address other replicas dial: the bind address, or this node's IP for 0.0.0.0."""
    if host != "0.0.0.0":
        return host
    node_ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]  # ray: unannotated
    return node_ip


def role_argv(role: str, args: PdserveServingArgs, replica_id: str) -> list[str]:
    """``pdserve serve <role>`` flags (host and port are added by ServiceProcess)."""
    if role == "kvstore":
        extra = args.kvstore.args if args.kvstore is not None else ()
        return ["kvstore", "--kvstore-gib", str(args.kvstore_gib), "--transfer", args.transfer,
                "--drain-grace-s", str(args.drain_grace_s), *extra]
    config = args.prefill if role == "prefill" else args.decode
    return [role, "--worker-id", replica_id, "--transfer", args.transfer,
            "--drain-grace-s", str(args.drain_grace_s),
            *(["--model", args.model] if args.model else []), *config.args]


class ServiceReplica:
    """Base of the worker and kvstore replicas: start, wait for SERVING, publish, and stop."""

    role = ""

    def __init__(self, args: PdserveServingArgs, address_book: Any) -> None:
        self.replica_id = f"{self.role}-{serve.get_replica_context().replica_tag}"
        self.args = args
        self.address_book = address_book
        log_dir = Path(args.log_dir or tempfile.gettempdir()) / "pdserve-ray"
        env = {"PDSERVE_REDIS_URL": args.redis_url} if args.redis_url else {}
        self.service = ServiceProcess(self.replica_id, role_argv(self.role, args, self.replica_id),
                                      ("--port",), args.host, publish_host(args.host), log_dir,
                                      env)
        self.metadata = {"grpc": self.service.address, "node": ray.get_runtime_context().get_node_id(),
                         "pid": os.getpid()}
        self.is_published = False

    async def _start(self) -> None:
        await self.service.wait_serving(self.args.startup_timeout_s)
        await self.address_book.publish.remote(self.role, self.replica_id, self.metadata)
        self.is_published = True

    async def address(self) -> str:
        return self.service.address

    async def check_health(self) -> None:
        """Serve's health check: raises unless the service answers SERVING."""
        if not await self.service.is_serving():
            raise RuntimeError(self.service.failure() or f"{self.replica_id} is not SERVING")

    def __del__(self) -> None:
        """Withdraw the address (not awaited: the book may already be gone at shutdown), then
        stop the service; idempotent (Serve and then the garbage collector both call it)."""
        if self.is_published:
            self.is_published = False
            try:
                self.address_book.withdraw.remote(self.role, self.replica_id)
            except Exception:  # noqa: BLE001 - best effort
                pass
        if hasattr(self, "service"):
            self.service.stop(self.args.drain_grace_s)


class PrefillReplica(ServiceReplica):
    role = "prefill"

    async def __init__(self, args: PdserveServingArgs, address_book: Any) -> None:  # type: ignore[misc]  # Serve awaits it
        super().__init__(args, address_book)
        await self._start()


class DecodeReplica(ServiceReplica):
    role = "decode"

    async def __init__(self, args: PdserveServingArgs, address_book: Any) -> None:  # type: ignore[misc]  # Serve awaits it
        super().__init__(args, address_book)
        await self._start()


class KVStoreReplica(ServiceReplica):
    role = "kvstore"

    async def __init__(self, args: PdserveServingArgs, address_book: Any) -> None:  # type: ignore[misc]  # Serve awaits it
        super().__init__(args, address_book)
        await self._start()

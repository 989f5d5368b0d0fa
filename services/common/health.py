"""``grpc.health.v1`` for every service: a reporter on the server side, checks on the client side.

The overall status (service name ``""``) and each registered service name move together:
NOT_SERVING until the service says it is ready (model loaded, cache allocated), SERVING
while it takes traffic, NOT_SERVING again for good once a graceful stop begins.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from services.common.channels import internal_channel, public_aio_channel
from services.common.internal_auth import InternalAuth

SERVING: int = health_pb2.HealthCheckResponse.SERVING  # typed here: grpc_health is untyped to mypy
NOT_SERVING: int = health_pb2.HealthCheckResponse.NOT_SERVING

# The service name a client checks to mean "the whole server".
OVERALL = ""


class HealthReporter:
    """Owns the health servicer of one grpc.aio server."""

    def __init__(self, service_names: Iterable[str] = ()) -> None:
        self.servicer = HealthServicer()
        self.service_names = (OVERALL, *service_names)
        self.is_serving = False

    def add_to_server(self, server: grpc.aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def set_serving(self, is_serving: bool) -> None:
        self.is_serving = is_serving
        status = SERVING if is_serving else NOT_SERVING
        for name in self.service_names:
            await self.servicer.set(name, status)

    async def enter_graceful_shutdown(self) -> None:
        """NOT_SERVING for every name, permanently (later set_serving calls are ignored)."""
        self.is_serving = False
        await self.servicer.enter_graceful_shutdown()


async def check_health(address: str, service: str = OVERALL, timeout_s: float = 1.0,
                       is_internal: bool = True, auth: InternalAuth | None = None) -> int:
    """One Health.Check; returns the ServingStatus enum value. Raises grpc.aio.AioRpcError.

    ``is_internal``: over an internal channel (mutual TLS when configured; ``auth``, default
    the process's); False for a router's public port, which is plaintext."""
    channel = internal_channel(address, auth=auth) if is_internal else public_aio_channel(address)
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        status: int = reply.status
        return status


async def wait_until_serving(address: str, timeout_s: float = 30.0, service: str = OVERALL) -> None:
    """Poll until ``address`` reports SERVING; raise TimeoutError with the last status seen."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            status = await check_health(address, service, timeout_s=1.0)
            if status == SERVING:
                return
            last = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        except grpc.aio.AioRpcError as exc:
            last = f"{exc.code().name}: {exc.details()}"
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{address} (service {service!r}) not SERVING after {timeout_s}s; "
                       f"last: {last}")

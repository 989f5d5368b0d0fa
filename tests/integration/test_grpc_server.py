"""The service bootstrap (services/common/grpc_server.py): bind, health, graceful drain on signals.

A real server runs in a subprocess with one test method, ``/test.Slow/Wait`` (sleeps for
the number of milliseconds in its request, then echoes it); this process talks to it over
loopback gRPC.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import start_grpc_server
from services.common.health import NOT_SERVING, SERVING, check_health, wait_until_serving

REPO = Path(__file__).resolve().parents[2]
SERVER = """
import asyncio, sys, grpc
from services.common.grpc_server import start_grpc_server

async def wait(request: bytes, context) -> bytes:
    await asyncio.sleep(int(request) / 1000)
    return request

def add(handler, server):
    server.add_generic_rpc_handlers((handler,))

async def main(grace_s):
    handler = grpc.method_handlers_generic_handler(
        "test.Slow", {"Wait": grpc.unary_unary_rpc_method_handler(wait)})
    server = await start_grpc_server([(add, handler)], service_names=["test.Slow"])
    print(server.port, flush=True)
    await server.serve_until_signal(grace_s=grace_s)
    print("stopped", flush=True)

asyncio.run(main(float(sys.argv[1])))
"""


def _start(grace_s: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(grace_s)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    port = proc.stdout.readline().strip()
    assert port.isdigit(), proc.stderr.read()
    return proc, f"127.0.0.1:{port}"


def _slow_wait(channel: grpc.aio.Channel, ms: int) -> grpc.aio.UnaryUnaryCall:
    return channel.unary_unary("/test.Slow/Wait")(str(ms).encode(), timeout=30)


async def _drain_scenario(address: str, proc: subprocess.Popen) -> None:
    await wait_until_serving(address, service="test.Slow")
    async with grpc.aio.insecure_channel(address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        assert (await watch.read()).status == SERVING
        in_flight = asyncio.ensure_future(_slow_wait(channel, 1500))
        await asyncio.sleep(0.3)  # the server has started the call

        proc.send_signal(signal.SIGTERM)
        assert (await watch.read()).status == NOT_SERVING  # routers watching see it at once
        watch.cancel()
        with pytest.raises(grpc.aio.AioRpcError):  # new calls are refused while draining
            await check_health(address, timeout_s=2)
        assert await in_flight == b"1500"  # the in-flight call finishes inside the grace period


def test_sigterm_drains_in_flight_calls_then_exits():
    proc, address = _start(grace_s=20)
    try:
        started = time.monotonic()
        asyncio.run(_drain_scenario(address, proc))
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - started < 15  # did not sit out the whole grace period
        assert proc.stdout.read().strip() == "stopped"
    finally:
        proc.kill()


async def _second_signal_scenario(proc: subprocess.Popen, address: str) -> grpc.StatusCode:
    await wait_until_serving(address)
    async with grpc.aio.insecure_channel(address) as channel:
        in_flight = asyncio.ensure_future(_slow_wait(channel, 60_000))
        await asyncio.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await in_flight
        return err.value.code()


def test_second_signal_cancels_in_flight_calls():
    proc, address = _start(grace_s=60)
    try:
        started = time.monotonic()
        code = asyncio.run(_second_signal_scenario(proc, address))
        assert code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - started < 20
    finally:
        proc.kill()


async def _bind_scenario() -> None:
    server = await start_grpc_server([], service_names=["test.Slow"], is_serving=False)
    try:
        assert server.port > 0 and server.address == f"127.0.0.1:{server.port}"
        assert await check_health(server.address) == NOT_SERVING
        await server.health.set_serving(True)
        assert await check_health(server.address, "test.Slow") == SERVING
        with pytest.raises(OSError, match=f"cannot bind gRPC server to 127.0.0.1:{server.port}"):
            await start_grpc_server([], port=server.port)
    finally:
        await server.stop(0)


def test_port_zero_reports_the_bound_port_and_a_taken_port_fails():
    asyncio.run(_bind_scenario())

"""The grpc.aio server skeleton every pdserve service runs.

    server = await start_grpc_server(
        [(kv_pb2_grpc.add_KVTransferServiceServicer_to_server, KVTransferServicer(...))],
        port=args.grpc_port, service_names=[KV_SERVICE_NAME])
    print(f"listening on {server.address}")          # port 0 -> the port actually bound
    await server.serve_until_signal(grace_s=args.drain_grace_s)

Stopping (SIGTERM / SIGINT, or ``await server.stop()``): health turns NOT_SERVING for
good, so routers stop picking this server; the server refuses new RPCs and lets in-flight
ones finish for up to ``grace_s`` seconds, then cancels the rest. A second signal during
the drain cancels at once.

Access: an internal server (the default) takes the process's internal auth
(services/common/internal_auth.py): mutual TLS when certificates are configured, the internal
token checked on every call when one is; ``grpc.health.v1`` stays open to token-less probes.
The router's public server passes ``public_api_keys`` instead: plaintext, and with keys every
call but health needs ``authorization: Bearer <key>``.

Errors: every servicer method may raise a ServiceError (services/common/errors.py); the
server's ``ServiceErrorInterceptor`` ends the call with its status (grpc_errors.py).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from services.common import internal_auth
from services.common.auth import KeySet, bearer_token
from services.common.channels import server_credentials
from services.common.grpc_auth import SecretInterceptor
from services.common.grpc_errors import ServiceErrorInterceptor
from services.common.health import HealthReporter
from services.common.internal_auth import TOKEN_METADATA

DEFAULT_HOST = "127.0.0.1"
DEFAULT_GRACE_S = 10.0
CHUNK_BYTES = 4 * 1024 * 1024  # payload of one streamed KV message (pushes, kvstore Put / Get)
MAX_MESSAGE_BYTES = 4 * CHUNK_BYTES  # a chunk plus its header, with room

# Channels to a peer that may restart on the same address (a worker after a crash or a rolling
# restart): gRPC's default reconnect backoff grows to 120 s, and calls fail fast meanwhile, so a
# worker back on its port would stay unreachable for minutes. Cap it at one second.
PEER_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)

AddServicer = tuple[Callable[[Any, grpc.aio.Server], None], Any]


@dataclass
class GrpcServer:
    """A started grpc.aio server. ``port`` is the bound port, even when 0 was asked for."""

    server: grpc.aio.Server
    host: str
    port: int
    health: HealthReporter

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def stop(self, grace_s: float = DEFAULT_GRACE_S) -> None:
        """Drain: NOT_SERVING, refuse new RPCs, wait up to ``grace_s`` for running ones."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)

    async def serve_until_signal(self, grace_s: float = DEFAULT_GRACE_S,
                                 signals: Sequence[signal.Signals] = (signal.SIGTERM,
                                                                     signal.SIGINT)) -> None:
        """Serve until one of ``signals`` arrives (or the server stops), then drain."""
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()
        cancel_tasks: list[asyncio.Task[None]] = []  # keep references until done

        def on_signal() -> None:
            if stop_requested.is_set():  # second signal: cancel in-flight RPCs now
                cancel_tasks.append(loop.create_task(self.server.stop(None)))
            stop_requested.set()

        for sig in signals:
            loop.add_signal_handler(sig, on_signal)
        terminated = loop.create_task(self.server.wait_for_termination())
        requested = loop.create_task(stop_requested.wait())
        try:
            await asyncio.wait({terminated, requested}, return_when=asyncio.FIRST_COMPLETED)
            if not terminated.done():
                await self.stop(grace_s)
                await terminated
        finally:
            requested.cancel()
            terminated.cancel()
            for sig in signals:
                loop.remove_signal_handler(sig)


async def start_grpc_server(servicers: Sequence[AddServicer], *, port: int = 0,
                            host: str = DEFAULT_HOST, service_names: Sequence[str] = (),
                            is_serving: bool = True,
                            options: Sequence[tuple[str, Any]] = (),
                            public_api_keys: KeySet | None = None) -> GrpcServer:
    """Create, bind and start a grpc.aio server with ``grpc.health.v1`` registered.

    ``servicers`` are ``(add_XServicer_to_server, servicer)`` pairs from the generated
    ``*_pb2_grpc`` modules; ``service_names`` (e.g. ``"pdserve.v1.DecodeService"``) get
    their own health entries. Pass ``is_serving=False`` if the service must finish loading
    first, then ``await server.health.set_serving(True)``. ``public_api_keys`` makes this a
    public server (see the module docstring). Raises OSError if the address cannot be bound.
    """
    credentials, interceptors = _access(public_api_keys)
    server = grpc.aio.server(interceptors=[*interceptors, ServiceErrorInterceptor()], options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),  # a taken port must fail, not be silently shared
        *options,
    ])
    for add, servicer in servicers:
        add(servicer, server)
    health = HealthReporter(service_names)
    health.add_to_server(server)
    try:
        bound = (server.add_insecure_port(f"{host}:{port}") if credentials is None
                 else server.add_secure_port(f"{host}:{port}", credentials))
    except RuntimeError as exc:
        raise OSError(f"cannot bind gRPC server to {host}:{port} ({exc}); is the port in use?") from exc
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}; is the port in use?")
    await server.start()
    await health.set_serving(is_serving)
    return GrpcServer(server=server, host=host, port=bound, health=health)


def _access(public_api_keys: KeySet | None) -> tuple[grpc.ServerCredentials | None,
                                                     list[grpc.aio.ServerInterceptor]]:
    if public_api_keys is not None:
        if not public_api_keys.is_enabled:
            return None, []
        return None, [SecretInterceptor(public_api_keys, "authorization", bearer_token, "API key")]
    auth = internal_auth.current()
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if auth.token:
        interceptors.append(SecretInterceptor(auth.accepted, TOKEN_METADATA, what="internal token"))
    return server_credentials(auth), interceptors

"""gRPC interceptors that check a secret on the server and attach one on the client.

Server side, ``SecretInterceptor`` (grpc.aio): every method except ``grpc.health.v1.Health/*``
needs a metadata value that ``KeySet.matches``; otherwise the call ends with UNAUTHENTICATED
before its handler runs (nothing is allocated, no request message is parsed). Two uses:

    SecretInterceptor(keys, "authorization", bearer_token)      # the router's public API key
    SecretInterceptor(auth.accepted, TOKEN_METADATA)            # the internal token

Client side, ``token_interceptors`` / ``SyncTokenInterceptor`` add one metadata pair to every
call of a channel (services/common/channels.py installs them).

A refusal is an ``Unauthenticated`` error mapped like any other (services/common/grpc_errors.py):
a refused client stream is read to its end first, or grpc.aio's client may report INTERNAL.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from services.common.auth import KeySet
from services.common.errors import Unauthenticated
from services.common.grpc_errors import maps_service_errors

HEALTH_PREFIX = "/grpc.health.v1.Health/"


class SecretInterceptor(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) any non-health call whose ``key`` metadata does not match."""

    def __init__(self, keys: KeySet, key: str, parse: Callable[[str | None], str | None] = lambda v: v,
                 what: str = "credentials") -> None:
        self.keys, self.key, self.parse, self.what = keys, key, parse, what

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        value = next((v for k, v in details.invocation_metadata or () if k == self.key), None)
        if isinstance(value, bytes):
            value = None  # a binary header is never a key
        if self.keys.matches(self.parse(value)):
            return handler
        message = f"missing or invalid {self.what} (metadata {self.key!r})"
        return _refusal(handler, message)


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as ``handler`` that raises Unauthenticated."""
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise Unauthenticated(message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        raise Unauthenticated(message)
        yield  # unreachable; makes this an async generator like the handler it replaces

    def refuse(behavior: Any) -> Any:
        return maps_service_errors(behavior, request_streaming=handler.request_streaming)

    # No request deserializer: a drained request stays bytes, a refused call parses nothing.
    codec = {"request_deserializer": None, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse(streaming), **codec)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse(unary), **codec)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse(streaming), **codec)
    return grpc.unary_unary_rpc_method_handler(refuse(unary), **codec)


def _with_metadata(details: Any, pair: tuple[str, str]) -> Any:
    return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), pair))


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, pair: tuple[str, str]) -> None:
        self.pair = pair

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_metadata(details, self.pair), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, pair: tuple[str, str]) -> None:
        self.pair = pair

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_metadata(details, self.pair), request)


class _AioStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, pair: tuple[str, str]) -> None:
        self.pair = pair

    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_with_metadata(details, self.pair), requests)


class _AioStreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, pair: tuple[str, str]) -> None:
        self.pair = pair

    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_with_metadata(details, self.pair), requests)


def token_interceptors(key: str, value: str) -> list[grpc.aio.ClientInterceptor]:
    """grpc.aio client interceptors sending ``(key, value)`` on every kind of call (aio files
    each interceptor under one kind, so there are four)."""
    pair = (key, value)
    return [_AioUnaryUnary(pair), _AioUnaryStream(pair), _AioStreamUnary(pair), _AioStreamStream(pair)]


class SyncTokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                           grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """The same for a blocking channel (``grpc.intercept_channel``)."""

    def __init__(self, key: str, value: str) -> None:
        self.pair = (key, value)

    def _details(self, details: Any) -> Any:
        return _SyncDetails(details.method, details.timeout, [*(details.metadata or ()), self.pair],
                            details.credentials, getattr(details, "wait_for_ready", None),
                            getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class _SyncDetails(grpc.ClientCallDetails):
    def __init__(self, method: str, timeout: float | None, metadata: list[tuple[str, str]],
                 credentials: grpc.CallCredentials | None, wait_for_ready: bool | None,
                 compression: grpc.Compression | None) -> None:
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression

"""The one place a ServiceError (services/common/errors.py) becomes a gRPC status.

Every pdserve gRPC server gets ``ServiceErrorInterceptor`` from ``start_grpc_server``: a
servicer method, unary or streaming, coroutine or async generator, raises a ServiceError and
the call ends with its status code (``STATUS_OF``), its message as the details, and trailing
metadata for what the caller acts on:

    failed_peer="decode"     pdserve-failed-peer: decode   (the router retries another one)
    ResourceExhausted(kv_full=True)   pdserve-kv-full: 1
    ResourceExhausted(retry_after_s=2.5)   retry-after: 3 (whole seconds, >= 1)
    InvalidArgument(param="guided_regex")   pdserve-invalid-param: guided_regex

A request-streaming call's client is first read to its end (``drain``: its messages are
dropped, for at most ``DRAIN_LIMIT_S``), and only then told. grpc.aio's client writes its
request iterator from a task, and a write that fails because the server already ended the
call *replaces* the status it received with INTERNAL ("Internal error from Core"): a call
ended while its client still wrote was seen as INTERNAL now and then (the token refusal of
grpc_auth.py, 1 call in 60, before this).

A servicer outside ``start_grpc_server`` (the router's gRPC frontend, once it raises typed
errors, or a test server) decorates its methods instead::

    class Frontend(GenerateServiceServicer):
        @maps_service_errors
        async def Generate(self, request, context): ...

``service_error_of(rpc_error)`` goes the other way: a peer's failure passed on as the same
kind (the prefill worker hands a decode worker's RESOURCE_EXHAUSTED to the router).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from services.common.errors import (
    Aborted,
    AlreadyExists,
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
    Unauthenticated,
    Unavailable,
)
from services.common.wire import FAILED_PEER_KEY, INVALID_PARAM_KEY, KV_FULL_KEY, RETRY_AFTER_KEY

STATUS_OF: dict[type[ServiceError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    Aborted: grpc.StatusCode.ABORTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    Cancelled: grpc.StatusCode.CANCELLED,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    DataLoss: grpc.StatusCode.DATA_LOSS,
    Internal: grpc.StatusCode.INTERNAL,
}
ERROR_OF: dict[grpc.StatusCode, type[ServiceError]] = {code: kind for kind, code in STATUS_OF.items()}
F = TypeVar("F", bound=Callable[..., Any])
DRAIN_LIMIT_S = 2.0  # a failed client stream is read (and dropped) this long at most


def status_of(error: ServiceError) -> grpc.StatusCode:
    """The status code of ``error``'s kind (its nearest mapped base class)."""
    for kind in type(error).__mro__:
        if kind in STATUS_OF:
            return STATUS_OF[kind]
    return grpc.StatusCode.UNKNOWN


def trailing_metadata_of(error: ServiceError) -> tuple[tuple[str, str], ...]:
    metadata: tuple[tuple[str, str], ...] = ()
    if error.failed_peer:
        metadata += ((FAILED_PEER_KEY, error.failed_peer),)
    if isinstance(error, ResourceExhausted) and error.kv_full:
        metadata += ((KV_FULL_KEY, "1"),)
    if isinstance(error, ResourceExhausted) and error.retry_after_s > 0:
        metadata += ((RETRY_AFTER_KEY, str(max(math.ceil(error.retry_after_s), 1))),)
    if isinstance(error, InvalidArgument) and error.param:
        metadata += ((INVALID_PARAM_KEY, error.param),)
    return metadata


def invalid_param(error: grpc.aio.AioRpcError) -> str:
    """The request field an INVALID_ARGUMENT names (``INVALID_PARAM_KEY``), or ""."""
    return next((str(value) for key, value in error.trailing_metadata() or () if key == INVALID_PARAM_KEY), "")


def service_error_of(error: grpc.aio.AioRpcError, message: str, failed_peer: str = "") -> ServiceError:
    """A peer's failed call as the ServiceError of the same code (``kv_full`` and the invalid
    ``param`` kept)."""
    kind = ERROR_OF.get(error.code(), Unavailable)
    if kind is ResourceExhausted:
        kv_full = any(key == KV_FULL_KEY for key, _ in error.trailing_metadata() or ())
        return ResourceExhausted(message, failed_peer=failed_peer, kv_full=kv_full)
    if kind is InvalidArgument:
        return InvalidArgument(message, failed_peer=failed_peer, param=invalid_param(error))
    return kind(message, failed_peer=failed_peer)


async def drain(requests: AsyncIterator[Any], limit_s: float = DRAIN_LIMIT_S) -> None:
    """Read and drop a client's request stream until it half-closes (or ``limit_s`` passed),
    so a status sent next reaches a client that no longer writes (module docstring)."""
    async def read_all() -> None:
        async for _ in requests:
            pass

    with contextlib.suppress(asyncio.TimeoutError, grpc.RpcError):
        await asyncio.wait_for(read_all(), limit_s)


async def abort_with(context: grpc.aio.ServicerContext, error: ServiceError) -> None:
    """End the call with ``error``'s status, message and trailing metadata (raises)."""
    metadata = trailing_metadata_of(error)
    if metadata:
        context.set_trailing_metadata(metadata)
    await context.abort(status_of(error), error.message)


def maps_service_errors(behavior: F, request_streaming: bool = False) -> F:
    """``behavior`` (a servicer method, bound or not: coroutine or async generator function)
    with every ServiceError it raises ended as its gRPC status (module docstring); pass
    ``request_streaming`` for a client-streaming method (its requests are drained first).
    Anything else (sync functions) is returned as it is."""
    if inspect.isasyncgenfunction(behavior):
        @functools.wraps(behavior)
        async def streaming(*args: Any) -> AsyncIterator[Any]:
            try:
                async for response in behavior(*args):
                    yield response
            except ServiceError as error:
                await _fail(args, error, request_streaming)
        return streaming  # type: ignore[return-value]  # behavior's signature (functools.wraps)
    if inspect.iscoroutinefunction(behavior):
        @functools.wraps(behavior)
        async def unary(*args: Any) -> Any:
            try:
                return await behavior(*args)
            except ServiceError as error:
                await _fail(args, error, request_streaming)
        return unary  # type: ignore[return-value]  # behavior's signature (functools.wraps)
    return behavior


async def _fail(args: tuple[Any, ...], error: ServiceError, request_streaming: bool) -> None:
    """``args`` end with (request or request iterator, context), after ``self`` if a method."""
    *_, request, context = args
    if request_streaming:
        await drain(request)
    await abort_with(context, error)


class ServiceErrorInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every method handler of a server with ``maps_service_errors``."""

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        codec = {"request_deserializer": handler.request_deserializer,
                 "response_serializer": handler.response_serializer}
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(
                maps_service_errors(handler.stream_stream, True), **codec)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(
                maps_service_errors(handler.stream_unary, True), **codec)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                maps_service_errors(handler.unary_stream), **codec)
        return grpc.unary_unary_rpc_method_handler(maps_service_errors(handler.unary_unary), **codec)


@contextlib.asynccontextmanager
async def status_first(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Send a ServiceError's status as soon as it is raised, before the cleanup that follows
    in the handler's ``finally`` (a caller waiting to retry elsewhere should not wait for a
    slow release)::

        try:
            async with status_first(context):
                ...                       # raises Unavailable(...)
        finally:
            await cleanup()               # runs after the caller got UNAVAILABLE
    """
    try:
        yield
    except ServiceError as error:
        await abort_with(context, error)

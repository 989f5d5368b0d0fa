"""services/common/grpc_errors.py: a ServiceError raised by any kind of servicer method ends the
call with its status, message and trailing metadata, over a real grpc.aio server on loopback."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from services.common.errors import (
    Aborted,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)
from services.common.grpc_errors import (
    ERROR_OF,
    STATUS_OF,
    maps_service_errors,
    service_error_of,
    status_first,
    status_of,
    trailing_metadata_of,
)
from services.common.grpc_server import start_grpc_server
from services.common.wire import FAILED_PEER_KEY, INVALID_PARAM_KEY, KV_FULL_KEY


class Servicer:
    """One method of each kind; each raises the error named by its request (b"ok": none)."""

    def __init__(self) -> None:
        self.cleaned_up = threading.Event()

    @staticmethod
    def error(request: bytes) -> ServiceError | None:
        return {b"ok": None, b"full": ResourceExhausted("no free KV blocks", kv_full=True,
                                                         failed_peer="decode"),
                b"bad": InvalidArgument("n must be 1"), b"bug": None}.get(request, NotFound("?"))

    async def unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if request == b"bug":
            raise RuntimeError("a bug")
        error = self.error(request)
        if error is not None:
            raise error
        return request

    async def server_stream(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        yield b"first"
        error = self.error(request)
        if error is not None:
            raise error
        yield b"last"

    async def writer(self, request: bytes, context: grpc.aio.ServicerContext) -> None:
        """Writes with context.write and cleans up after the status went out."""
        try:
            async with status_first(context):
                await context.write(b"first")
                error = self.error(request)
                if error is not None:
                    raise error
        finally:
            await asyncio.sleep(0.2)
            self.cleaned_up.set()

    async def client_stream(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        async for request in requests:  # fails on the first message, the client writes on
            raise InvalidArgument(f"client_stream: refused a {len(request)}-byte message")
        return b""


def _add(servicer: Servicer, server: grpc.aio.Server) -> None:
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Errors", {
        "Unary": grpc.unary_unary_rpc_method_handler(servicer.unary),
        "ServerStream": grpc.unary_stream_rpc_method_handler(servicer.server_stream),
        "Writer": grpc.unary_stream_rpc_method_handler(servicer.writer),
        "ClientStream": grpc.stream_unary_rpc_method_handler(servicer.client_stream),
    }),))


def _run(scenario: Any) -> Any:
    """``scenario(channel, servicer)`` against a server on its own thread and event loop, as
    a server in another process would be (the client-stream race needs that)."""
    servicer = Servicer()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(start_grpc_server([(_add, servicer)]), loop).result(10)

    async def main() -> Any:
        async with grpc.aio.insecure_channel(server.address) as channel:
            return await scenario(channel, servicer)
    try:
        return asyncio.run(main())
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


async def _fails(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        result = call()
        if hasattr(result, "__aiter__"):
            _ = [r async for r in result]
        else:
            await result
    return error.value


def test_every_kind_maps_its_error_with_message_and_metadata() -> None:
    async def scenario(channel: grpc.aio.Channel, servicer: Servicer) -> None:
        unary = channel.unary_unary("/test.Errors/Unary")
        assert await unary(b"ok", timeout=5) == b"ok"
        error = await _fails(lambda: unary(b"full", timeout=5))
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.details() == "no free KV blocks"
        assert dict(error.trailing_metadata()) == {FAILED_PEER_KEY: "decode", KV_FULL_KEY: "1"}
        error = await _fails(lambda: unary(b"bug", timeout=5))  # a bug stays a bug
        assert error.code() is grpc.StatusCode.UNKNOWN

        stream = channel.unary_stream("/test.Errors/ServerStream")
        assert [r async for r in stream(b"ok", timeout=5)] == [b"first", b"last"]
        error = await _fails(lambda: stream(b"bad", timeout=5))
        assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "n must be 1")
        assert not dict(error.trailing_metadata())

        writer = channel.unary_stream("/test.Errors/Writer")
        call = writer(b"other", timeout=5)
        assert await call.read() == b"first"
        error = await _fails(lambda: call.read())
        assert error.code() is grpc.StatusCode.NOT_FOUND
        assert not servicer.cleaned_up.is_set()  # status_first: the status came before cleanup
        assert await asyncio.to_thread(servicer.cleaned_up.wait, 5)

    _run(scenario)


def test_a_refused_client_stream_always_sees_the_error_not_internal() -> None:
    """The client still writes when the handler fails: drained first, it gets the status
    (without the drain, some of these saw INTERNAL)."""
    async def scenario(channel: grpc.aio.Channel, servicer: Servicer) -> list[grpc.StatusCode]:
        client_stream = channel.stream_unary("/test.Errors/ClientStream")
        codes = []
        for size in [1, 1 << 16] * 50:  # short streams, and long ones flow control holds up
            messages = [b"x" * size] * 8
            error = await _fails(lambda: client_stream(iter(messages), timeout=5))  # noqa: B023
            codes.append(error.code())
        return codes

    assert set(_run(scenario)) == {grpc.StatusCode.INVALID_ARGUMENT}


def test_a_decorated_method_maps_without_the_interceptor() -> None:
    class Frontend:
        @maps_service_errors
        async def Generate(self, request: bytes, context: Any) -> bytes:
            raise Unavailable("engine stopped", failed_peer="prefill")

    class Context:
        async def abort(self, code: grpc.StatusCode, details: str) -> None:
            self.status = (code, details)
            raise RuntimeError("aborted")

        def set_trailing_metadata(self, metadata: Any) -> None:
            self.metadata = metadata

    context = Context()
    with pytest.raises(RuntimeError, match="aborted"):
        asyncio.run(Frontend().Generate(b"", context))
    assert context.status == (grpc.StatusCode.UNAVAILABLE, "engine stopped")
    assert context.metadata == ((FAILED_PEER_KEY, "prefill"),)


def test_status_table_round_trips_and_subclasses_map_to_their_base() -> None:
    for kind, code in STATUS_OF.items():
        assert ERROR_OF[code] is kind
        assert status_of(kind("x")) is code

    class Refused(Aborted):
        pass

    assert status_of(Refused("x")) is grpc.StatusCode.ABORTED


def test_a_peers_error_is_passed_on_as_the_same_kind() -> None:
    class PeerError(grpc.aio.AioRpcError):
        def __init__(self, code: grpc.StatusCode, trailing: tuple[tuple[str, str], ...]) -> None:
            super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), "peer says")

    full = service_error_of(PeerError(grpc.StatusCode.RESOURCE_EXHAUSTED, ((KV_FULL_KEY, "1"),)),
                            "decode worker d: peer says", failed_peer="decode")
    assert isinstance(full, ResourceExhausted) and full.kv_full and full.failed_peer == "decode"
    gone = service_error_of(PeerError(grpc.StatusCode.UNAVAILABLE, ()), "m")
    assert type(gone) is Unavailable and gone.message == "m"
    refused = service_error_of(PeerError(grpc.StatusCode.INVALID_ARGUMENT, ((INVALID_PARAM_KEY, "guided_json"),)),
                               "decode worker d: peer says")
    assert isinstance(refused, InvalidArgument) and refused.param == "guided_json"


def test_an_invalid_argument_names_its_field_in_trailing_metadata() -> None:
    assert trailing_metadata_of(InvalidArgument("Generate: n=2")) == ()
    assert trailing_metadata_of(InvalidArgument("Prefill: guided_regex: does not compile", param="guided_regex")) == (
        (INVALID_PARAM_KEY, "guided_regex"),)


def test_a_workers_refused_constraint_names_its_field() -> None:
    from engine.structured.errors import StructuredOutputError
    from services.worker.request_params import invalid_argument

    refused = invalid_argument("Prefill", StructuredOutputError("guided_regex", "does not compile: ["))
    assert (refused.message, refused.param) == ("Prefill: guided_regex: does not compile: [", "guided_regex")
    assert trailing_metadata_of(refused) == ((INVALID_PARAM_KEY, "guided_regex"),)
    plain = invalid_argument("Generate", ValueError("max_tokens must be >= 1"))
    assert (plain.message, plain.param) == ("Generate: max_tokens must be >= 1", "")

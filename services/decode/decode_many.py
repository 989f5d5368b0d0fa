"""DecodeService.DecodeMany: many Decode and Generate calls on one stream, one message per batch
of outputs.

A router keeps one such stream per decode worker. Each ``start`` runs exactly what a Decode
call runs (``DecodeWorker.decode``: claim the reservation, wait for the KV, stream the outputs),
each ``generate`` what a Generate call runs (``DecodeWorker.generate``: the whole request here,
the router's local path or a migrated request's resume), in a task of its own, writing into the
stream's ``Outbox`` instead of a call of its own; a ``cancel_request_id`` cancels that task (the
request is aborted, as when its call is cancelled). The outbox's pump sends everything queued
since its last write as one ``DecodeManyResponse``: while a write is in flight the next step's
outputs of every request gather behind it, so a step of N requests costs one message, not N (a
grpc.aio message costs ~30 us of CPU on the event loop of a 2-core EPYC; a step of 64 requests
on a GPU takes a few ms).

Each call ends with a ``DecodeCallEnd`` after its outputs: OK after the finished one, else the
status its own call would have ended with (a ServiceError's code, message and trailing
metadata, ``grpc_errors.py``; anything else UNKNOWN). A cancelled call gets no end. When the
stream ends (the router went away, the server stops) every call on it is cancelled.

A cancelled call's writes fail, as a cancelled gRPC call's do: each call writes through a
``CallWriter`` that raises CancelledError once the call is cancelled, so a call whose
CancelledError was lost still ends at its next write and aborts its request. (Python 3.11's
``asyncio.wait_for`` drops a cancel that lands as its inner future completes; that is how
``DecodeWorker._wait_landed`` lost one as the KV landed, which now waits with
``asyncio.timeout``: before either fix a cancel just after the first token left the request
running for all its tokens, tests/integration/test_cancel_frees_blocks.py.)
Backpressure: a task waits while ``MAX_QUEUED`` outputs are unsent.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from services.common.errors import ServiceError
from services.common.grpc_errors import status_of, trailing_metadata_of
from services.common.pb import worker_pb2

log = logging.getLogger(__name__)
MAX_QUEUED = 4096  # unsent outputs of one stream before its calls wait

DecodeFn = Callable[[worker_pb2.DecodeRequest, "CallWriter"], Awaitable[None]]
GenerateFn = Callable[[worker_pb2.GenerateLocalRequest, "CallWriter"], Awaitable[None]]


class Outbox:
    """What a stream's calls produced and the pump has not sent yet; ``write`` is the
    OutputStream writer of each call."""

    def __init__(self) -> None:
        self._outputs: list[worker_pb2.DecodeResponse] = []
        self._ends: list[worker_pb2.DecodeCallEnd] = []
        self._ready = asyncio.Event()
        self._sent = asyncio.Event()
        self._closing = False

    async def write(self, response: worker_pb2.DecodeResponse) -> None:
        self.write_nowait(response)
        while len(self._outputs) >= MAX_QUEUED:
            self._sent.clear()
            await self._sent.wait()

    def has_room(self) -> bool:
        """A ``write_nowait`` now leaves the outbox below ``MAX_QUEUED`` (nothing to wait for)."""
        return len(self._outputs) + 1 < MAX_QUEUED

    def write_nowait(self, response: worker_pb2.DecodeResponse) -> None:
        self._outputs.append(response)
        self._ready.set()

    def end(self, request_id: str, code: grpc.StatusCode = grpc.StatusCode.OK, details: str = "",
            metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self._ends.append(worker_pb2.DecodeCallEnd(request_id=request_id, code=code.value[0],
                                                   details=details, trailing_metadata=dict(metadata)))
        self._ready.set()

    def close(self) -> None:
        """No more calls: ``pump`` returns once what is queued is sent."""
        self._closing = True
        self._ready.set()

    async def pump(self, context: grpc.aio.ServicerContext) -> None:
        """Send what is queued, one message per wake-up, until closed (or cancelled)."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            if self._outputs or self._ends:
                outputs, self._outputs = self._outputs, []
                ends, self._ends = self._ends, []
                self._sent.set()
                await context.write(worker_pb2.DecodeManyResponse(outputs=outputs, ends=ends))
            elif self._closing:
                return


class CallWriter:
    """One call on the stream: its task, and its writer into the outbox; after ``cancel`` every
    write raises CancelledError (module docstring)."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        self.cancelled = False
        self.task: asyncio.Task[None] | None = None

    def cancel(self) -> None:
        self.cancelled = True
        if self.task is not None:
            self.task.cancel()

    async def write(self, response: worker_pb2.DecodeResponse) -> None:
        if self.cancelled:
            raise asyncio.CancelledError()
        await self.outbox.write(response)

    def can_write_now(self) -> bool:
        """``write_nowait`` may run: not cancelled, and the outbox has room (OutputStream's sink)."""
        return not self.cancelled and self.outbox.has_room()

    def write_nowait(self, response: worker_pb2.DecodeResponse) -> None:
        self.outbox.write_nowait(response)


async def serve_decode_many(requests: AsyncIterator[worker_pb2.DecodeManyRequest],
                            context: grpc.aio.ServicerContext, decode: DecodeFn,
                            generate: GenerateFn) -> None:
    """The DecodeMany handler's body (module docstring); ``decode`` runs one Decode call,
    ``generate`` one Generate call."""
    outbox = Outbox()
    calls: dict[str, CallWriter] = {}
    pump = asyncio.ensure_future(outbox.pump(context))

    async def run(request: worker_pb2.DecodeRequest | worker_pb2.GenerateLocalRequest,
                  writer: CallWriter) -> None:
        request_id = request.request_id
        try:
            if isinstance(request, worker_pb2.DecodeRequest):
                await decode(request, writer)
            else:
                await generate(request, writer)
        except ServiceError as error:
            outbox.end(request_id, status_of(error), error.message, trailing_metadata_of(error))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug in one call must not end the others
            log.exception("DecodeMany: %s failed", request_id)
            outbox.end(request_id, grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}")
        else:
            outbox.end(request_id)

    def forget(request_id: str, _: asyncio.Task[None]) -> None:
        calls.pop(request_id, None)

    def tasks() -> list[asyncio.Task[None]]:
        return [call.task for call in calls.values() if call.task is not None]

    try:
        async for message in requests:
            op = message.WhichOneof("op")
            if op in ("start", "generate"):
                request = message.start if op == "start" else message.generate
                request_id = request.request_id
                if request_id in calls:
                    outbox.end(request_id, grpc.StatusCode.ALREADY_EXISTS,
                               f"DecodeMany: {request_id!r} is already running on this stream")
                    continue
                call = calls[request_id] = CallWriter(outbox)
                call.task = asyncio.ensure_future(run(request, call))
                # not a finally in run(): a task cancelled before it ran never runs its body
                call.task.add_done_callback(functools.partial(forget, request_id))
            elif op == "cancel_request_id" and message.cancel_request_id in calls:
                calls[message.cancel_request_id].cancel()
        # the router half-closed: let the calls finish and their ends go out
        while calls:
            await asyncio.wait(tasks())
        outbox.close()
        await pump
    finally:  # the stream ended (the router went away, the server stops): cancel every call
        running = tasks()
        for call in list(calls.values()):
            call.cancel()
        if running:
            await asyncio.wait(running)
        pump.cancel()

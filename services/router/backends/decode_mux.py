"""The router's end of DecodeService.DecodeMany: one stream per decode worker, many Decode and
Generate calls.

    call = muxes.start(worker, DecodeRequest(...), timeout_s)   # a MuxCall; or a
                                                                # GenerateLocalRequest
    response = await call.read()     # a DecodeResponse, grpc.aio.EOF after the finished one,
                                     # or raises the call's grpc.aio.AioRpcError
    call.cancel(); call.done()

A ``MuxCall`` reads like the ``grpc.aio.UnaryStreamCall`` of a Decode or Generate call
(DecodeStream takes either): its errors are ``AioRpcError``s with the code, details and trailing metadata the worker
sent in the call's ``DecodeCallEnd`` (services/decode/decode_many.py), so worker_errors.py maps
them as before. Its deadline is a timer here (DEADLINE_EXCEEDED, and the worker is told to
cancel); ``cancel`` tells the worker too. One reader task per stream hands each message's
outputs to their calls' queues; when the stream fails (the worker died or stopped) every call on
it fails with the stream's status, as each Decode call would have, and the next ``start`` opens a
new stream. Writes to the stream (starts and cancels) go out in order from one task.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

import grpc

from services.common.pb import worker_pb2
from services.router.routing.worker_pool import Worker

log = logging.getLogger(__name__)
_EOF: Any = grpc.aio.EOF
Request = worker_pb2.DecodeRequest | worker_pb2.GenerateLocalRequest  # what a call starts with


def _error(code: grpc.StatusCode, details: str,
           metadata: tuple[tuple[str, str], ...] = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*metadata), details)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class MuxCall:
    """One Decode call on a DecodeMany stream (module docstring)."""

    def __init__(self, stream: DecodeMuxStream, request_id: str, timeout_s: float) -> None:
        self.stream = stream
        self.request_id = request_id
        # one reader (the call's DecodeStream): items, and its future while it waits for one
        self._items: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._done = False
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._timer = loop.call_later(timeout_s, self._expire)

    async def read(self) -> Any:
        if not self._items:
            if self._waiter is not None:
                raise RuntimeError(f"{self.request_id!r}: two readers of one call")
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, grpc.aio.AioRpcError):
            raise item
        return item

    def _put(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        if not self._done:
            self._finish(_error(grpc.StatusCode.CANCELLED, "Locally cancelled by application!"))
            self.stream.send_cancel(self.request_id)

    # ---- from the stream ----------------------------------------------------------------

    def deliver(self, response: worker_pb2.DecodeResponse) -> None:
        if not self._done:
            self._put(response)

    def end(self, item: Any) -> None:
        """The call ended: ``item`` is EOF (OK) or its AioRpcError."""
        if not self._done:
            self._finish(item)

    def _finish(self, item: Any) -> None:
        self._done = True
        self._timer.cancel()
        self.stream.forget(self.request_id)
        self._put(item)

    def _expire(self) -> None:
        if not self._done:
            self._finish(_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            self.stream.send_cancel(self.request_id)


class DecodeMuxStream:
    """One open DecodeMany stream to one decode worker."""

    def __init__(self, worker: Worker, on_closed: Any) -> None:
        self.worker = worker
        self.calls: dict[str, MuxCall] = {}
        self._on_closed = on_closed
        self._outgoing: asyncio.Queue[worker_pb2.DecodeManyRequest | None] = asyncio.Queue()
        self._call = worker.decode.DecodeMany(self._requests())
        self._reader = asyncio.ensure_future(self._read_all())
        self.closed = False
        self.num_messages = 0  # read so far (each carries outputs of many calls)

    def start(self, request: Request, timeout_s: float) -> MuxCall:
        if request.request_id in self.calls:
            raise ValueError(f"{request.request_id!r} is already decoding on {self.worker.address}")
        call = MuxCall(self, request.request_id, timeout_s)
        self.calls[request.request_id] = call
        self._outgoing.put_nowait(worker_pb2.DecodeManyRequest(start=request)
                                  if isinstance(request, worker_pb2.DecodeRequest)
                                  else worker_pb2.DecodeManyRequest(generate=request))
        return call

    def send_cancel(self, request_id: str) -> None:
        if not self.closed:
            self._outgoing.put_nowait(worker_pb2.DecodeManyRequest(cancel_request_id=request_id))

    def forget(self, request_id: str) -> None:
        self.calls.pop(request_id, None)

    async def close(self) -> None:
        self._fail(_error(grpc.StatusCode.CANCELLED, "the router is closing"))
        self._call.cancel()
        self._reader.cancel()

    async def _requests(self) -> Any:
        while True:
            message = await self._outgoing.get()
            if message is None:
                return
            yield message

    async def _read_all(self) -> None:
        error: grpc.aio.AioRpcError
        try:
            while True:
                message = await self._call.read()
                if message is _EOF:
                    error = _error(grpc.StatusCode.UNAVAILABLE,
                                   f"decode worker {self.worker.address} ended its DecodeMany stream")
                    break
                self.num_messages += 1
                for response in message.outputs:
                    call = self.calls.get(response.request_id)
                    if call is not None:
                        call.deliver(response)
                for end in message.ends:
                    call = self.calls.get(end.request_id)
                    if call is not None:
                        code = _CODES.get(end.code, grpc.StatusCode.UNKNOWN)
                        call.end(_EOF if code is grpc.StatusCode.OK else
                                 _error(code, end.details, tuple(end.trailing_metadata.items())))
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every call on the stream must hear of it
            log.exception("DecodeMany stream to %s failed", self.worker.address)
            error = _error(grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}")
        self._fail(error)

    def _fail(self, error: grpc.aio.AioRpcError) -> None:
        """Every call on the stream ends with ``error``; the next start opens a new stream."""
        if self.closed:
            return
        self.closed = True
        self._on_closed(self)
        self._outgoing.put_nowait(None)
        for call in list(self.calls.values()):
            call.end(error)
        self.calls.clear()


class DecodeMuxes:
    """A router's DecodeMany streams, one per decode worker, opened on first use."""

    def __init__(self) -> None:
        self._streams: dict[str, DecodeMuxStream] = {}

    def start(self, worker: Worker, request: Request, timeout_s: float) -> MuxCall:
        """A Decode call (``DecodeRequest``) or a Generate call (``GenerateLocalRequest``) on
        ``worker``'s stream, opened now if it has none."""
        stream = self._streams.get(worker.address)
        if stream is None or stream.closed:
            stream = self._streams[worker.address] = DecodeMuxStream(worker, self._closed)
        return stream.start(request, timeout_s)

    def _closed(self, stream: DecodeMuxStream) -> None:
        if self._streams.get(stream.worker.address) is stream:
            del self._streams[stream.worker.address]

    async def close(self) -> None:
        for stream in list(self._streams.values()):
            await stream.close()
        self._streams.clear()

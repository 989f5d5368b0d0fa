"""The one reader of a decode worker's token stream: ``Decode`` (remote path), ``Generate``
(local path, and a migration's resume), each a stream of ``DecodeResponse``.

    stream = DecodeStream(call, decode, sample, in_flight)
    first = await stream.open()        # the first response; a gRPC error before it is raised
                                       # as is (grpc.aio.AioRpcError): the path decides
    async for event in stream.events():   # TokenEvents from the first response on, until one
        ...                               # finishes; errors mapped by worker_errors.py
    await stream.close()               # always (a finally): cancels the call unless it
                                       # finished, and ends the worker's in-flight share

After the first response every error means the sample had started (``worker_error(...,
is_started=True)``): a lost worker is WorkerLost, and so is a stream that ends without a
finish reason. ``alongside`` (the remote path's prefill call, still pushing KV) is watched
while waiting: if it fails first, its error is raised here. Closing the stream before it
finished (a stop string, the client gone) cancels the call, which aborts the request on the
worker and frees its blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, cast

import grpc

from services.common.pb import generate_pb2, worker_pb2
from services.common.wire import finish_from_proto, logprobs_list_from_proto
from services.router.backends.backend import TokenEvent
from services.router.backends.decode_mux import MuxCall
from services.router.backends.sample import Sample
from services.router.backends.worker_errors import WorkerLost, worker_error
from services.router.routing.worker_pool import InFlight, Worker

if TYPE_CHECKING:  # engine.sampling.logprobs imports torch; the router must not at import
    from engine.sampling.logprobs import PositionLogprobs

_UNFINISHED = generate_pb2.FINISH_REASON_UNSPECIFIED


class DecodeStream:
    def __init__(self, call: grpc.aio.UnaryStreamCall | MuxCall, worker: Worker, sample: Sample,
                 in_flight: InFlight, alongside: asyncio.Future[None] | None = None) -> None:
        self.call = call
        self.worker = worker
        self.sample = sample
        self.in_flight = in_flight  # ends its prefill share at the first response, all at close
        self.alongside = alongside
        self.is_finished = False
        self._first: worker_pb2.DecodeResponse | None = None

    async def open(self) -> worker_pb2.DecodeResponse:
        """The first response (read once). Raises the call's AioRpcError as is."""
        if self._first is None:
            self._first = await self._read()
            self.in_flight.end_prefill()
        return self._first

    async def events(self) -> AsyncIterator[TokenEvent]:
        """The sample's events until one carries a finish reason (``is_finished`` turns true
        before that one is yielded). The owner closes the stream, finished or not."""
        index = self.sample.index
        read = self.open  # the first response (read once), then the next ones
        while True:
            try:
                response = await read()
            except grpc.aio.AioRpcError as exc:
                raise worker_error(self.worker, exc, is_started=True) from exc
            read = self._read
            # per token: the common response (tokens, no logprobs, not the last) costs no more
            # than the TokenEvent it becomes
            finish = (None if response.finish_reason == _UNFINISHED
                      else finish_from_proto(response.finish_reason))
            self.is_finished = finish is not None
            # cast: a generated token's logprobs always carry it (sampled), so no entry is None
            logprobs = (cast("list[PositionLogprobs] | None", logprobs_list_from_proto(response.logprobs))
                        if response.logprobs else None)
            stop_token_id = (response.stop_token_id if finish is not None and response.HasField("stop_token_id")
                             else None)
            yield TokenEvent(index=index, token_ids=list(response.token_ids), logprobs=logprobs,
                             finish_reason=finish, stop_token_id=stop_token_id)
            if self.is_finished:
                return

    async def close(self) -> None:
        """Cancel the call unless it finished, and end the worker's in-flight share (idempotent)."""
        if not self.is_finished and not self.call.done():
            self.call.cancel()
        self.in_flight.end()

    async def _read(self) -> worker_pb2.DecodeResponse:
        """The next response, failing early if ``alongside`` fails meanwhile."""
        alongside = self.alongside
        if alongside is None or alongside.done():  # the common case: no task per token
            _raise_if_failed(alongside)
            return self._checked(await self.call.read())
        read = asyncio.ensure_future(self.call.read())
        try:
            await asyncio.wait({read, alongside}, return_when=asyncio.FIRST_COMPLETED)
            _raise_if_failed(alongside)
            response = await read
        finally:
            if not read.done():
                read.cancel()
        return self._checked(response)

    def _checked(self, response: object) -> worker_pb2.DecodeResponse:
        if response is grpc.aio.EOF:
            raise WorkerLost(self.worker, f"it ended {self.sample.request_id!r} without a finish reason")
        return cast("worker_pb2.DecodeResponse", response)


def _raise_if_failed(alongside: asyncio.Future[None] | None) -> None:
    if alongside is not None and alongside.done() and not alongside.cancelled():
        error = alongside.exception()
        if error is not None:
            raise error

"""One engine request's outputs written to a gRPC call as DecodeResponses, until the finished
one: the loop that DecodeService's Decode (after a remote prefill) and Generate (the whole
request here) share.

    stream = OutputStream(engine, request_id, queue, num_streamed=1)
    try:
        await stream.write_all(context, on_output)   # on_output(output, response) before each write
    finally:
        if not stream.finished: ...abort the engine request...

``finished`` turns true when the finished output is taken from the queue (before its write: a
client gone then leaves nothing to abort). Each write counts the tokens streamed for the fault
injector (``PDSERVE_FAULTS=kill:decode:after_tokens=N``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from services.common.async_engine import AsyncEngine, OutputQueue
from services.common.faults import faults
from services.common.pb import worker_pb2
from services.common.wire import decode_response

if TYPE_CHECKING:
    from engine.scheduler.output import RequestOutput


class Writer(Protocol):
    """Where responses go: a call's ``grpc.aio.ServicerContext``, or a DecodeMany stream's
    outbox (decode_many.py)."""

    async def write(self, message: worker_pb2.DecodeResponse) -> None: ...


@runtime_checkable
class NowaitWriter(Writer, Protocol):
    """A writer that can also take a response at once, without awaiting (an outbox with room)."""

    def can_write_now(self) -> bool: ...

    def write_nowait(self, message: worker_pb2.DecodeResponse) -> None: ...


class OutputStream:
    def __init__(self, engine: AsyncEngine, request_id: str, queue: OutputQueue, num_streamed: int = 0) -> None:
        self.engine = engine
        self.request_id = request_id
        self.queue = queue
        self.num_streamed = num_streamed  # tokens the client has (a prefill worker may have sent the first)
        self.finished = False

    async def write_all(self, context: Writer,
                        on_output: Callable[[RequestOutput, worker_pb2.DecodeResponse], None]) -> None:
        """Until the finished output is written. A ``NowaitWriter`` takes the outputs before
        the last straight from the engine's dispatch (the queue's ``sink``), as this loop would
        and in order: the task wakes for the finished one (or one the sink refused) only."""
        if isinstance(context, NowaitWriter):
            self.queue.sink = functools.partial(self._take, context, on_output)
        try:
            while not self.finished:
                output = await self.engine.next_output(self.queue)
                self.finished = output.finished
                response = decode_response(self.request_id, output)
                on_output(output, response)
                await context.write(response)
                self.num_streamed += len(output.new_token_ids)
                faults().after_decode_tokens(self.num_streamed)  # PDSERVE_FAULTS only
        finally:
            self.queue.sink = None

    def _take(self, context: NowaitWriter,
              on_output: Callable[[RequestOutput, worker_pb2.DecodeResponse], None],
              output: RequestOutput) -> bool:
        """The queue's sink (on the event loop, inside the dispatch). False leaves ``output``
        to the loop above, which fails this call alone if converting it fails here too."""
        if not context.can_write_now():
            return False
        try:
            response = decode_response(self.request_id, output)
            on_output(output, response)
        except Exception:  # noqa: BLE001 - see the docstring
            return False
        context.write_nowait(response)
        self.num_streamed += len(output.new_token_ids)
        faults().after_decode_tokens(self.num_streamed)
        return True

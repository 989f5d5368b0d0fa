"""KVTransferService for a decode worker: gRPC pushes may only write into live reservations.

The plain servicer (kv_grpc_receiver.py) writes wherever a header points.
Here the header is checked against the reservation table first, and the push is counted
while it runs, so released blocks are never written and a release waits for pushes in progress.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from engine.kv_transfer.base import KVReceiver
from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.pb import kv_pb2
from services.decode.kv_grpc_receiver import GrpcKVReceiver, KVTransferServicer
from services.decode.reservations import ReservationTable


class GuardedKVTransferServicer(KVTransferServicer):
    def __init__(self, receiver: GrpcKVReceiver, handshake_source: KVReceiver,
                 reservations: ReservationTable) -> None:
        super().__init__(receiver, handshake_source)
        self.reservations = reservations

    async def PushBlocks(self, request_iterator: AsyncIterator[kv_pb2.PushBlocksChunk],
                         context: grpc.aio.ServicerContext) -> kv_pb2.PushBlocksAck:
        chunks = request_iterator.__aiter__()
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            raise InvalidArgument("PushBlocks: empty stream") from None
        if not first.HasField("header"):  # the shared servicer rejects it with its message
            return await super().PushBlocks(_chain(first, chunks), context)
        header = first.header
        refusal = self.reservations.begin_push(header.request_id, list(header.dst_block_ids))
        if refusal is not None:
            raise FailedPrecondition(f"PushBlocks: {refusal}")
        try:
            return await super().PushBlocks(_chain(first, chunks), context)
        finally:
            self.reservations.end_push(header.request_id)


async def _chain(first: kv_pb2.PushBlocksChunk,
                 rest: AsyncIterator[kv_pb2.PushBlocksChunk]) -> AsyncIterator[kv_pb2.PushBlocksChunk]:
    yield first
    async for chunk in rest:
        yield chunk

"""Decode side of the gRPC KV transport: the receiver and ``KVTransferService``'s servicer.

``PushBlocks`` takes a client stream of a header, then the packed bytes (packing.py) in
chunks, written straight into the reserved blocks as they arrive, each on a worker thread
(engine/kv_transfer/ingest.py: on CUDA through pinned staging on a side stream); the receiver
queues one notification per finished push for the decode handler to drain. A sender on this
host sends the header alone, naming its shared-memory segment (``shm_name``,
services/worker/kv_shm.py): the payload is copied from there, once, in the same way; the
``Handshake`` reply carries the probe that tells a sender whether it may.

Errors (services/common/errors.py): FailedPrecondition when the peers are incompatible (the
message names each differing field, both sides' values), InvalidArgument for bad block ids or
a malformed stream or shared-memory range, FailedPrecondition for a segment that is not on
this host, DataLoss for a payload whose crc32 differs; DEADLINE_EXCEEDED / CANCELLED as gRPC
reports them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import numpy as np

from engine.kv_transfer.base import KVHandshake, KVNotification, KVReceiver, KVTransferError
from engine.kv_transfer.ingest import ChunkWriter
from services.common.errors import DataLoss, FailedPrecondition, InvalidArgument
from services.common.grpc_server import CHUNK_BYTES
from services.common.pb import kv_pb2, kv_pb2_grpc
from services.common.wire import handshake_from_proto, handshake_to_proto
from services.worker.kv_grpc import GrpcEndpoint
from services.worker.kv_shm import SHM_DIR, ShmProbe, ShmReader

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class GrpcKVReceiver(GrpcEndpoint, KVReceiver):
    """Decode side of the gRPC transport. The servicer writes; the engine drains notifications."""

    def __init__(self, model_name: str, shared_memory: bool = True, shm_dir: Path = SHM_DIR) -> None:
        super().__init__(model_name, "decode")
        self._landed: collections.deque[KVNotification] = collections.deque()  # thread-safe
        self.shm_reader = ShmReader(shm_dir)
        self._probe: ShmProbe | None = None
        if shared_memory:
            try:
                self._probe = ShmProbe(shm_dir)
            except OSError as exc:  # no /dev/shm here: every push comes as bytes
                log.warning("KV pushes from this host come as gRPC bytes: no probe in %s (%s)",
                            shm_dir, exc)

    @property
    def shm_probe(self) -> str:
        """The handshake's probe ("" when pushes must come as bytes)."""
        return self._probe.advert if self._probe is not None else ""

    def close(self) -> None:
        if self._probe is not None:
            self._probe.close()
        super().close()

    def completed_requests(self) -> list[KVNotification]:
        drained = []
        while self._landed:
            drained.append(self._landed.popleft())
        return drained

    def deliver(self, notification: KVNotification) -> None:
        self._landed.append(notification)


class KVTransferServicer(kv_pb2_grpc.KVTransferServiceServicer):
    """Serves Handshake for ``handshake_source`` (default: the gRPC receiver) and PushBlocks."""

    def __init__(self, receiver: GrpcKVReceiver, handshake_source: KVReceiver | None = None) -> None:
        self.receiver = receiver
        self._chunk_writer: ChunkWriter | None = None
        self.handshake_source = handshake_source or receiver

    async def Handshake(self, request: kv_pb2.KVHandshake,
                        context: grpc.aio.ServicerContext) -> kv_pb2.KVHandshake:
        local = self.handshake_source.handshake_info()
        try:
            local.check_compatible(handshake_from_proto(request), sides=("receiver", "sender"))
        except KVTransferError as exc:
            raise FailedPrecondition(str(exc)) from exc
        reply = handshake_to_proto(local)
        reply.shm_probe = self.receiver.shm_probe  # PushBlocks is this servicer's, whoever answers
        return reply

    async def PushBlocks(self, request_iterator: AsyncIterator[kv_pb2.PushBlocksChunk],
                         context: grpc.aio.ServicerContext) -> kv_pb2.PushBlocksAck:
        local = self.receiver.handshake_info()
        kv_cache = self.receiver.kv_cache
        assert kv_cache is not None  # handshake_info() above raised unless registered
        header: kv_pb2.PushBlocksHeader | None = None
        dst_block_ids: list[int] = []
        received = 0
        crc: int | None = 0
        async for chunk in request_iterator:
            if header is None:
                if not chunk.HasField("header"):
                    raise InvalidArgument("PushBlocks: the first chunk must carry the header")
                header = chunk.header
                check_header(header, local)
                dst_block_ids = list(header.dst_block_ids)
            elif chunk.HasField("header"):
                raise InvalidArgument("PushBlocks: only the first chunk may carry a header")
            if header.shm_name:
                if chunk.data:
                    raise InvalidArgument("PushBlocks: a push through shared memory "
                                          f"({header.shm_name!r}) carries no data chunks")
                continue
            if not chunk.data:
                continue
            if chunk.offset != received or received + len(chunk.data) > header.total_bytes:
                raise InvalidArgument(f"PushBlocks: chunk at offset {chunk.offset} with "
                                      f"{len(chunk.data)} bytes; expected offset {received} and "
                                      f"at most {header.total_bytes} bytes in all")
            crc = await self._write(kv_cache, dst_block_ids, received, chunk.data, crc)
            received += len(chunk.data)
        if header is None:
            raise InvalidArgument("PushBlocks: empty stream")
        if header.shm_name:
            received = await self._write_shared(kv_cache, dst_block_ids, header)
        if received != header.total_bytes:
            raise InvalidArgument(f"PushBlocks: stream ended after {received} of "
                                  f"{header.total_bytes} bytes")
        if header.HasField("crc32") and crc != header.crc32:
            # the blocks stay reserved and undelivered: the sender sees the push fail
            raise DataLoss(f"PushBlocks: payload crc32 {crc:#010x} != header crc32 "
                           f"{header.crc32:#010x}: the KV of {header.request_id!r} was "
                           "corrupted in transit")
        self.receiver.deliver(KVNotification(header.request_id, tuple(dst_block_ids),
                                             sender=header.sender_agent_name or context.peer()))
        return kv_pb2.PushBlocksAck(request_id=header.request_id, num_blocks=len(dst_block_ids),
                                    num_bytes=received)


    async def _write_shared(self, kv_cache: torch.Tensor, dst_block_ids: list[int],
                            header: kv_pb2.PushBlocksHeader) -> int:
        """The payload from the sender's shared-memory segment into the cache; returns its size."""
        try:
            payload = self.receiver.shm_reader.view(header.shm_name, header.shm_offset,
                                                    header.total_bytes)
        except ValueError as exc:
            raise InvalidArgument(f"PushBlocks: {exc}") from exc
        except OSError as exc:
            raise FailedPrecondition(f"PushBlocks: shared-memory segment {header.shm_name!r} is "
                                     f"not readable here ({exc}); push the bytes") from exc
        await self._write(kv_cache, dst_block_ids, 0, payload, None)
        return payload.size

    async def _write(self, kv_cache: torch.Tensor, dst_block_ids: list[int], offset: int,
                     data: bytes | np.ndarray, crc: int | None) -> int | None:
        """One chunk into the cache on a worker thread, off the event loop that serves every
        stream of this worker (ingest.py); returns the crc32 so far (None: not computed). A
        cancelled push still waits for the chunk in flight: its blocks are released only after
        the last write."""
        if self._chunk_writer is None or self._chunk_writer.kv_cache is not kv_cache:
            self._chunk_writer = ChunkWriter(kv_cache, CHUNK_BYTES)
        written = asyncio.get_running_loop().run_in_executor(
            None, self._chunk_writer.write, dst_block_ids, offset, data, crc)
        try:
            return await asyncio.shield(written)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await written
            raise


def check_header(header: kv_pb2.PushBlocksHeader, local: KVHandshake) -> None:
    """Raise the ServiceError to fail a PushBlocks with; return if the header is acceptable."""
    compat = local.compat
    if header.compat_hash != compat.hash:
        raise FailedPrecondition(
            f"PushBlocks: compat hash {header.compat_hash[:12]} (sender dtype={header.dtype}, "
            f"block_shape={list(header.block_shape)}) != receiver {compat.hash[:12]} "
            f"(dtype={compat.dtype}, block_shape={list(compat.block_shape)}); "
            "call Handshake first to see which fields differ")
    ids = list(header.dst_block_ids)
    num_blocks = local.region.num_blocks
    if not ids:
        raise InvalidArgument("PushBlocks: no dst_block_ids")
    bad = [b for b in ids if b >= num_blocks]
    if bad:
        raise InvalidArgument(f"PushBlocks: dst block ids {bad[:8]} out of range [0, {num_blocks})")
    if len(set(ids)) != len(ids):
        raise InvalidArgument(f"PushBlocks: dst block ids repeat: {ids[:16]}")
    expected = len(ids) * local.region.block_bytes
    if header.total_bytes != expected:
        raise InvalidArgument(f"PushBlocks: total_bytes={header.total_bytes}, but {len(ids)} "
                              f"blocks of {local.region.block_bytes} bytes are {expected}")

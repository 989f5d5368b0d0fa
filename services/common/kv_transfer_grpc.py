"""KV transfer over gRPC: ``KVTransferService`` (kv.proto) and the connectors that use it.

The decode worker serves :class:`KVTransferServicer`. ``Handshake`` answers with the
receiver's :class:`KVHandshake` (NIXL metadata included when the worker runs NIXL), so the
prefill side calls it whichever transport moves the bytes. ``PushBlocks`` is the fallback
transport: a client stream of a header, then the packed bytes in chunks of at most
``max_chunk_bytes``, written straight into the reserved blocks as they arrive.

Status codes: FAILED_PRECONDITION when the peers are incompatible (the message names each
differing field, both sides' values), INVALID_ARGUMENT for bad block ids or a malformed
stream, DEADLINE_EXCEEDED / CANCELLED as gRPC reports them. Nothing is pickled.
"""

from __future__ import annotations

import collections
import os
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator, Sequence

import grpc
import torch

from engine.kv_transfer.base import (
    KVCompat,
    KVHandshake,
    KVNotification,
    KVReceiver,
    KVRegion,
    KVSender,
    KVTransferError,
    RemoteInfo,
    TransferHandle,
    TransferState,
    check_send_args,
)
from engine.kv_transfer.grpc import iter_chunks, pack_blocks, write_packed_range
from services.common.grpc_server import MAX_MESSAGE_BYTES
from services.common.pb import kv_pb2, kv_pb2_grpc
from services.common.wire import handshake_from_proto, handshake_to_proto

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024  # payload per message; the header travels alone
DEFAULT_PUSH_TIMEOUT_S = 60.0
DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0


def _local_handshake(model_name: str, kv_cache: torch.Tensor, agent_name: str) -> KVHandshake:
    return KVHandshake(compat=KVCompat.from_kv_cache(model_name, kv_cache),
                       agent_name=agent_name, region=KVRegion.of(kv_cache))


def _agent_name(role: str) -> str:
    return f"pdserve-{role}-grpc-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class _GrpcEndpoint:
    """What both ends of the gRPC transport share: the registered cache and its handshake."""

    def __init__(self, model_name: str, role: str) -> None:
        self.model_name = model_name
        self.agent_name = _agent_name(role)
        self.kv_cache: torch.Tensor | None = None
        self._handshake: KVHandshake | None = None

    def register(self, kv_cache: torch.Tensor) -> None:
        self._handshake = _local_handshake(self.model_name, kv_cache, self.agent_name)
        self.kv_cache = kv_cache

    def handshake_info(self) -> KVHandshake:
        if self._handshake is None:
            raise KVTransferError("call register(kv_cache) before handshake_info()")
        return self._handshake


class GrpcKVReceiver(_GrpcEndpoint, KVReceiver):
    """Decode side of the gRPC transport. The servicer writes; the engine drains notifications."""

    def __init__(self, model_name: str) -> None:
        super().__init__(model_name, "decode")
        self._landed: collections.deque[KVNotification] = collections.deque()  # thread-safe

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
        self.handshake_source = handshake_source or receiver

    async def Handshake(self, request: kv_pb2.KVHandshake,
                        context: grpc.aio.ServicerContext) -> kv_pb2.KVHandshake:
        local = self.handshake_source.handshake_info()
        try:
            local.check_compatible(handshake_from_proto(request), sides=("receiver", "sender"))
        except KVTransferError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return handshake_to_proto(local)

    async def PushBlocks(self, request_iterator, context: grpc.aio.ServicerContext) -> kv_pb2.PushBlocksAck:
        local = self.receiver.handshake_info()
        kv_cache = self.receiver.kv_cache
        header: kv_pb2.PushBlocksHeader | None = None
        dst_block_ids: list[int] = []
        received = 0
        async for chunk in request_iterator:
            if header is None:
                if not chunk.HasField("header"):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        "PushBlocks: the first chunk must carry the header")
                header = chunk.header
                error = _check_header(header, local)
                if error is not None:
                    await context.abort(*error)
                dst_block_ids = list(header.dst_block_ids)
            elif chunk.HasField("header"):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    "PushBlocks: only the first chunk may carry a header")
            if not chunk.data:
                continue
            if chunk.offset != received or received + len(chunk.data) > header.total_bytes:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"PushBlocks: chunk at offset {chunk.offset} with "
                                    f"{len(chunk.data)} bytes; expected offset {received} and "
                                    f"at most {header.total_bytes} bytes in all")
            write_packed_range(kv_cache, dst_block_ids, received, chunk.data)
            received += len(chunk.data)
        if header is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "PushBlocks: empty stream")
        if received != header.total_bytes:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"PushBlocks: stream ended after {received} of "
                                f"{header.total_bytes} bytes")
        self.receiver.deliver(KVNotification(header.request_id, tuple(dst_block_ids),
                                             sender=header.sender_agent_name or context.peer()))
        return kv_pb2.PushBlocksAck(request_id=header.request_id, num_blocks=len(dst_block_ids),
                                    num_bytes=received)


def _check_header(header: kv_pb2.PushBlocksHeader,
                  local: KVHandshake) -> tuple[grpc.StatusCode, str] | None:
    """The status to fail a PushBlocks with, or None if the header is acceptable."""
    compat = local.compat
    if header.compat_hash != compat.hash:
        return (grpc.StatusCode.FAILED_PRECONDITION,
                f"PushBlocks: compat hash {header.compat_hash[:12]} (sender dtype={header.dtype}, "
                f"block_shape={list(header.block_shape)}) != receiver {compat.hash[:12]} "
                f"(dtype={compat.dtype}, block_shape={list(compat.block_shape)}); "
                "call Handshake first to see which fields differ")
    ids = list(header.dst_block_ids)
    num_blocks = local.region.num_blocks
    if not ids:
        return grpc.StatusCode.INVALID_ARGUMENT, "PushBlocks: no dst_block_ids"
    bad = [b for b in ids if b >= num_blocks]
    if bad:
        return (grpc.StatusCode.INVALID_ARGUMENT,
                f"PushBlocks: dst block ids {bad[:8]} out of range [0, {num_blocks})")
    if len(set(ids)) != len(ids):
        return grpc.StatusCode.INVALID_ARGUMENT, f"PushBlocks: dst block ids repeat: {ids[:16]}"
    expected = len(ids) * local.region.block_bytes
    if header.total_bytes != expected:
        return (grpc.StatusCode.INVALID_ARGUMENT,
                f"PushBlocks: total_bytes={header.total_bytes}, but {len(ids)} blocks of "
                f"{local.region.block_bytes} bytes are {expected}")
    return None


def fetch_remote_handshake(address: str, local: KVHandshake,
                           timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S) -> KVHandshake:
    """Exchange handshakes with the KVTransferService at ``address`` (blocking).

    Raises KVTransferError carrying the receiver's message (e.g. the differing fields).
    """
    with grpc.insecure_channel(address) as channel:
        try:
            reply = kv_pb2_grpc.KVTransferServiceStub(channel).Handshake(
                handshake_to_proto(local), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise KVTransferError(f"KV handshake with {address} failed: "
                                  f"{exc.code().name}: {exc.details()}") from exc
    return handshake_from_proto(reply)


class GrpcKVSender(_GrpcEndpoint, KVSender):
    """Prefill side of the gRPC transport: PushBlocks streams on a small thread pool.

    ``send_blocks`` gathers the source blocks at once (so they may be reused as soon as it
    returns) and streams them in the background; ``poll`` reports the result.
    """

    def __init__(self, model_name: str, *, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 timeout_s: float = DEFAULT_PUSH_TIMEOUT_S, max_concurrent_pushes: int = 4) -> None:
        if not 0 < max_chunk_bytes <= MAX_MESSAGE_BYTES // 2:
            raise ValueError(f"max_chunk_bytes must be in (0, {MAX_MESSAGE_BYTES // 2}], "
                             f"got {max_chunk_bytes}")
        super().__init__(model_name, "prefill")
        self.max_chunk_bytes = max_chunk_bytes
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_concurrent_pushes, thread_name_prefix="kv-push")
        self._channels: dict[str, grpc.Channel] = {}
        self._channels_lock = threading.Lock()
        self._pushes: dict[int, Future[kv_pb2.PushBlocksAck]] = {}

    def connect(self, remote: KVHandshake, address: str = "") -> RemoteInfo:
        if not address:
            raise KVTransferError("the gRPC transport needs the receiver's address (host:port)")
        self.handshake_info().check_compatible(remote, sides=("sender", "receiver"))
        return RemoteInfo(handshake=remote, address=address, peer_name=remote.agent_name)

    def send_blocks(self, request_id: str, src_block_ids: Sequence[int], remote: RemoteInfo,
                    dst_block_ids: Sequence[int]) -> TransferHandle:
        local = self.handshake_info()
        check_send_args(src_block_ids, dst_block_ids, local.region.num_blocks, remote.handshake)
        assert self.kv_cache is not None
        packed = pack_blocks(self.kv_cache, src_block_ids)  # uint8 [n * block_bytes], on CPU
        header = kv_pb2.PushBlocksHeader(
            request_id=request_id, dst_block_ids=list(dst_block_ids),
            compat_hash=local.compat.hash, dtype=local.compat.dtype,
            block_shape=list(local.compat.block_shape), total_bytes=packed.numel(),
            sender_agent_name=self.agent_name)
        handle = TransferHandle(request_id=request_id, num_blocks=len(src_block_ids))
        self._pushes[handle.transfer_id] = self._pool.submit(
            self._push, remote.address, header, packed)
        return handle

    def poll(self, handle: TransferHandle) -> TransferState:
        future = self._pushes.get(handle.transfer_id)
        if future is None or not future.done():
            return handle.state
        del self._pushes[handle.transfer_id]
        exc = future.exception()
        if exc is None:
            handle.state = TransferState.DONE
        else:
            handle.state = TransferState.FAILED
            handle.error = (f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError)
                            else f"{type(exc).__name__}: {exc}")
        return handle.state

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._channels_lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()

    def _channel(self, address: str) -> grpc.Channel:
        with self._channels_lock:
            if address not in self._channels:
                self._channels[address] = grpc.insecure_channel(address, options=[
                    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
            return self._channels[address]

    def _push(self, address: str, header: kv_pb2.PushBlocksHeader,
              packed: torch.Tensor) -> kv_pb2.PushBlocksAck:
        def chunks() -> Iterator[kv_pb2.PushBlocksChunk]:
            yield kv_pb2.PushBlocksChunk(header=header)
            for offset, data in iter_chunks(packed, self.max_chunk_bytes):
                yield kv_pb2.PushBlocksChunk(offset=offset, data=data)

        stub = kv_pb2_grpc.KVTransferServiceStub(self._channel(address))
        return stub.PushBlocks(chunks(), timeout=self.timeout_s)

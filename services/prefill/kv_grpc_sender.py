"""Prefill side of the gRPC KV transport: push blocks into a decode worker's
``KVTransferService`` (services/decode/kv_grpc_receiver.py), and its handshake.

Raises KVTransferError for incompatible peers or bad block ids; a failed push is reported by
``poll`` (state FAILED, the gRPC status in the handle's error). Nothing is pickled.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import torch

from engine.kv_transfer.base import (
    KVHandshake,
    KVSender,
    KVTransferError,
    RemoteInfo,
    TransferHandle,
    TransferState,
    check_send_args,
)
from engine.kv_transfer.packing import PackedBlocks, gather_blocks, iter_chunks
from services.common.channels import internal_sync_channel
from services.common.faults import faults
from services.common.grpc_server import MAX_MESSAGE_BYTES, PEER_CHANNEL_OPTIONS
from services.common.pb import kv_pb2, kv_pb2_grpc
from services.common.wire import handshake_from_proto, handshake_to_proto
from services.worker.kv_grpc import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_HANDSHAKE_TIMEOUT_S,
    DEFAULT_PUSH_TIMEOUT_S,
    GrpcEndpoint,
)


def fetch_remote_handshake(address: str, local: KVHandshake,
                           timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S) -> KVHandshake:
    """Exchange handshakes with the KVTransferService at ``address`` (blocking).

    Raises KVTransferError carrying the receiver's message (e.g. the differing fields).
    """
    with internal_sync_channel(address) as channel:
        try:
            reply = kv_pb2_grpc.KVTransferServiceStub(channel).Handshake(
                handshake_to_proto(local), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise KVTransferError(f"KV handshake with {address} failed: "
                                  f"{exc.code().name}: {exc.details()}") from exc
    return handshake_from_proto(reply)


class GrpcKVSender(GrpcEndpoint, KVSender):
    """Prefill side of the gRPC transport: PushBlocks streams on a small thread pool.

    ``send_blocks`` starts gathering the source blocks into host memory (on CUDA on a side
    stream, into pinned memory: the sender's thread waits neither for the device nor for the
    copy) and streams them in the background, where a push thread waits for the copy and
    checksums the payload; ``poll`` reports the result. The source blocks must stay allocated
    until then (``KVPusher.send``).
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
        self._stream: torch.cuda.Stream | None = None  # CUDA: where payloads are gathered

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
        if self.kv_cache.is_cuda and self._stream is None:
            self._stream = torch.cuda.Stream(self.kv_cache.device)  # type: ignore[no-untyped-call]
        # uint8 [n * block_bytes] in host memory; on CUDA still being copied when this returns
        packed = gather_blocks(self.kv_cache, src_block_ids, self._stream)
        header = kv_pb2.PushBlocksHeader(
            request_id=request_id, dst_block_ids=list(dst_block_ids),
            compat_hash=local.compat.hash, dtype=local.compat.dtype,
            block_shape=list(local.compat.block_shape), total_bytes=packed.nbytes,
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
                self._channels[address] = internal_sync_channel(address, options=[
                    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES), *PEER_CHANNEL_OPTIONS])
            return self._channels[address]

    def _push(self, address: str, header: kv_pb2.PushBlocksHeader,
              packed: PackedBlocks) -> kv_pb2.PushBlocksAck:
        """On a push thread: wait for the payload's copy, checksum it, stream it."""
        payload = packed.host()
        # numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12 (mypy checks as 3.10)
        header.crc32 = zlib.crc32(payload.numpy())  # type: ignore[arg-type]  # see above

        def chunks() -> Iterator[kv_pb2.PushBlocksChunk]:
            yield kv_pb2.PushBlocksChunk(header=header)
            for offset, data in iter_chunks(payload, self.max_chunk_bytes):
                yield kv_pb2.PushBlocksChunk(offset=offset, data=faults().kv_corrupted(data))

        stub = kv_pb2_grpc.KVTransferServiceStub(self._channel(address))
        ack: kv_pb2.PushBlocksAck = stub.PushBlocks(chunks(), timeout=self.timeout_s)
        return ack

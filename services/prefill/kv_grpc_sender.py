"""Prefill side of the gRPC KV transport: push blocks into a decode worker's
``KVTransferService`` (services/decode/kv_grpc_receiver.py), and its handshake.

Raises KVTransferError for incompatible peers or bad block ids; a failed push is reported by
``poll`` (state FAILED, the gRPC status in the handle's error). Nothing is pickled.
"""

from __future__ import annotations

import logging
import threading
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

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
from engine.kv_transfer.packing import PackedBlocks, gather_blocks, iter_chunks, pack_blocks
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
from services.worker.kv_shm import SHM_DIR, Segment, ShmArena, ShmUnavailable, probe_visible

log = logging.getLogger(__name__)

# How long past its deadline a push may go unanswered before the push thread cancels it.
DEADLINE_GUARD_S = 1.0
# How long close() waits for its channels: gRPC's close waits for the calls still writing
# to a receiver that has stopped reading, which can be forever.
CLOSE_WAIT_S = 2.0


class PushTimedOut(KVTransferError):
    """A push that outlived its deadline by DEADLINE_GUARD_S without gRPC ending it."""


def call_push_blocks(stub: kv_pb2_grpc.KVTransferServiceStub,
                     chunks: Iterator[kv_pb2.PushBlocksChunk], timeout_s: float,
                     guard_s: float = DEADLINE_GUARD_S) -> kv_pb2.PushBlocksAck:
    """PushBlocks, on its deadline whatever the receiver does.

    Through the future API: grpcio's blocking stream-unary call (seen with 1.85) never ends
    when a message larger than the flow-control window waits on a receiver that has stopped
    reading (a frozen process); its deadline passes and the calling thread waits forever. The
    future's call honours it. Should one still be unanswered ``guard_s`` past the deadline,
    it is cancelled and PushTimedOut raised, so a push thread and its source blocks are never
    held longer than that.
    """
    call = stub.PushBlocks.future(chunks, timeout=timeout_s)
    try:
        ack: kv_pb2.PushBlocksAck = call.result(timeout=timeout_s + guard_s)
    except grpc.FutureTimeoutError:
        call.cancel()
        raise PushTimedOut(f"no answer {timeout_s + guard_s:g} s after the push began "
                           f"(deadline {timeout_s:g} s); cancelled") from None
    return ack


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


def push_error(exc: BaseException) -> str:
    """A failed push's error for its handle: the gRPC status first (``CODE: details``)."""
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, PushTimedOut):
        return f"DEADLINE_EXCEEDED: {exc}"
    return f"{type(exc).__name__}: {exc}"


class GrpcKVSender(GrpcEndpoint, KVSender):
    """Prefill side of the gRPC transport: PushBlocks streams on a small thread pool.

    ``send_blocks`` starts gathering the source blocks into host memory (on CUDA on a side
    stream, into pinned memory: the sender's thread waits neither for the device nor for the
    copy) and streams them in the background, where a push thread waits for the copy and
    checksums the payload; ``poll`` reports the result. The source blocks must stay allocated
    until then (``KVPusher.send``).

    To a receiver whose shared-memory probe this process can read (same host, ``connect``), the
    push thread copies the payload into a segment of its own instead and sends the header
    alone (services/worker/kv_shm.py); ``shared_memory=False`` always pushes bytes.
    """

    def __init__(self, model_name: str, *, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 timeout_s: float = DEFAULT_PUSH_TIMEOUT_S, max_concurrent_pushes: int = 4,
                 shared_memory: bool = True, shm_dir: Path = SHM_DIR) -> None:
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
        self.shm_dir = shm_dir
        self._arena = ShmArena(shm_dir, max_free=max_concurrent_pushes) if shared_memory else None
        self._shared: dict[str, bool] = {}  # receiver address -> push through shared memory
        self._warned_shm = False

    def connect(self, remote: KVHandshake, address: str = "") -> RemoteInfo:
        if not address:
            raise KVTransferError("the gRPC transport needs the receiver's address (host:port)")
        self.handshake_info().check_compatible(remote, sides=("sender", "receiver"))
        self._shared[address] = (self._arena is not None and bool(remote.shm_probe)
                                 and probe_visible(remote.shm_probe, self.shm_dir))
        return RemoteInfo(handshake=remote, address=address, peer_name=remote.agent_name)

    def is_shared(self, address: str) -> bool:
        """Whether pushes to ``address`` go through shared memory (decided by ``connect``)."""
        return self._shared.get(address, False)

    def send_blocks(self, request_id: str, src_block_ids: Sequence[int], remote: RemoteInfo,
                    dst_block_ids: Sequence[int]) -> TransferHandle:
        local = self.handshake_info()
        check_send_args(src_block_ids, dst_block_ids, local.region.num_blocks, remote.handshake)
        assert self.kv_cache is not None
        if self.kv_cache.is_cuda and self._stream is None:
            self._stream = torch.cuda.Stream(self.kv_cache.device)  # type: ignore[no-untyped-call]
        nbytes = len(src_block_ids) * local.region.block_bytes
        segment = self._segment(remote.address, nbytes)
        if segment is not None and not self.kv_cache.is_cuda:  # gathered straight into it
            packed = PackedBlocks(pack_blocks(self.kv_cache, src_block_ids, segment.array[:nbytes]))
            in_segment = True
        else:  # uint8 [nbytes] in host memory; on CUDA still being copied when this returns
            packed = gather_blocks(self.kv_cache, src_block_ids, self._stream)
            in_segment = False
        header = kv_pb2.PushBlocksHeader(
            request_id=request_id, dst_block_ids=list(dst_block_ids),
            compat_hash=local.compat.hash, dtype=local.compat.dtype,
            block_shape=list(local.compat.block_shape), total_bytes=packed.nbytes,
            sender_agent_name=self.agent_name)
        handle = TransferHandle(request_id=request_id, num_blocks=len(src_block_ids))
        self._pushes[handle.transfer_id] = self._pool.submit(
            self._push, remote.address, header, packed, segment, in_segment)
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
            handle.error = push_error(exc)
        return handle.state

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._arena is not None:
            self._arena.close()
        with self._channels_lock:
            channels = list(self._channels.values())
            self._channels.clear()
        closer = threading.Thread(target=lambda: [c.close() for c in channels],
                                  name="kv-push-close", daemon=True)
        closer.start()
        closer.join(CLOSE_WAIT_S)
        if closer.is_alive():
            log.warning("KV push channels still closing after %g s (a receiver has stopped "
                        "reading); not waiting for them", CLOSE_WAIT_S)

    def _channel(self, address: str) -> grpc.Channel:
        with self._channels_lock:
            if address not in self._channels:
                self._channels[address] = internal_sync_channel(address, options=[
                    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES), *PEER_CHANNEL_OPTIONS])
            return self._channels[address]

    def _push(self, address: str, header: kv_pb2.PushBlocksHeader, packed: PackedBlocks,
              segment: Segment | None, in_segment: bool) -> kv_pb2.PushBlocksAck:
        """On a push thread: wait for the payload's copy, then hand it over through shared
        memory (``segment``: copied there unless ``in_segment``), or checksum it and stream it."""
        payload = packed.host()
        stub = kv_pb2_grpc.KVTransferServiceStub(self._channel(address))
        if segment is not None:
            assert self._arena is not None  # _segment gives none without one
            if not in_segment:
                segment.array[:payload.numel()] = payload.numpy()
            header.shm_name, header.shm_offset = segment.name, 0
            try:
                shared_ack = call_push_blocks(
                    stub, iter([kv_pb2.PushBlocksChunk(header=header)]), self.timeout_s)
            except BaseException:
                self._arena.release(segment, reuse=False)  # the receiver may still read it
                raise
            self._arena.release(segment, reuse=True)
            return shared_ack
        # numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12 (mypy checks as 3.10)
        header.crc32 = zlib.crc32(payload.numpy())  # type: ignore[arg-type]  # see above

        def chunks() -> Iterator[kv_pb2.PushBlocksChunk]:
            yield kv_pb2.PushBlocksChunk(header=header)
            for offset, data in iter_chunks(payload, self.max_chunk_bytes):
                yield kv_pb2.PushBlocksChunk(offset=offset, data=faults().kv_corrupted(data))

        return call_push_blocks(stub, chunks(), self.timeout_s)

    def _segment(self, address: str, nbytes: int) -> Segment | None:
        """A shared-memory segment for a push to ``address``, or None: push bytes."""
        if self._arena is None or not self.is_shared(address):
            return None
        try:
            return self._arena.acquire(nbytes)
        except ShmUnavailable as exc:  # /dev/shm full: this push goes as bytes
            if not self._warned_shm:
                log.warning("KV push as gRPC bytes: %s", exc)
                self._warned_shm = True
            return None

"""The worker's kvstore client: never raises into the engine; any failure is a miss.

    client = KVStoreClient("127.0.0.1:50081", compat)        # compat: the worker's KVCompat
    num_cached = await client.lookup(hashes)                  # 0 when the store is down
    held = await client.lookup_present(hashes)                # per hash; [] when it is down
    await client.offer_and_put(hashes, parent, token_ids, blocks)   # blocks: [n, *block_shape]
    num_landed = await client.get_into(hashes, dst_blocks)    # gRPC path, bytes copied in order
    num_landed = await client.read_into(reader, hashes, dst_block_ids)  # NIXL path

``get_into`` and ``read_into`` return how many leading blocks hold the store's bytes: all of
them, or fewer (0 on the NIXL path) when the store died, a block was evicted, a lease ran out
or a deadline passed; the caller recomputes from there. Every RPC has a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence

import grpc
import numpy as np
import torch

from engine.kv_cache.hashing import BlockHash
from engine.kv_transfer.base import KVCompat, KVHandshake, KVRegion, KVTransferError, TransferState
from services.common.channels import internal_channel
from services.common.grpc_server import CHUNK_BYTES, MAX_MESSAGE_BYTES
from services.common.pb import kvstore_pb2, kvstore_pb2_grpc
from services.common.wire import handshake_from_proto, handshake_to_proto
from services.kvstore.nixl_reader import NixlBlockReader
from services.kvstore.region import block_bytes_of

log = logging.getLogger(__name__)
RECONNECT_BACKOFF_MAX_MS = 1000


class KVStoreClient:
    def __init__(self, address: str, compat: KVCompat, timeout_s: float = 5.0,
                 lease_ms: int = 5000) -> None:
        self.address = address
        self.compat = compat
        self.timeout_s = timeout_s
        self.lease_ms = lease_ms
        self.block_bytes = block_bytes_of(compat)
        self.num_failures = 0
        self._channel = internal_channel(address, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),  # 4 MiB chunks + framing
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # A restarted store is used again within a second (gRPC's default backoff grows
            # to 2 minutes, all of it misses).
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS)])
        self._stub = kvstore_pb2_grpc.KVStoreServiceStub(self._channel)
        self._store: KVHandshake | None = None

    async def close(self) -> None:
        await self._channel.close(None)

    async def handshake(self) -> KVHandshake | None:
        """The store's handshake for our compat (once per client), or None if unreachable."""
        if self._store is None:
            mine = KVHandshake(compat=self.compat, agent_name="kvstore-client",
                               region=KVRegion("DRAM", 0, 0, 0, self.block_bytes))
            try:
                reply = await self._stub.Handshake(handshake_to_proto(mine), timeout=self.timeout_s)
            except grpc.aio.AioRpcError as error:
                self._failed("Handshake", error)
                return None
            self._store = handshake_from_proto(reply)
        return self._store

    async def lookup(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading ``hashes`` the store holds (0 on any failure)."""
        reply = await self._lookup(hashes)
        return 0 if reply is None else int(reply.num_prefix_hits)

    async def lookup_present(self, hashes: Sequence[BlockHash]) -> list[bool]:
        """Whether the store holds each of ``hashes`` ([] on any failure: read it as none)."""
        reply = await self._lookup(hashes)
        return [] if reply is None else list(reply.present)

    async def _lookup(self, hashes: Sequence[BlockHash]) -> kvstore_pb2.KVStoreLookupReply | None:
        if not hashes or await self.handshake() is None:
            return None
        try:
            reply: kvstore_pb2.KVStoreLookupReply = await self._stub.Lookup(kvstore_pb2.KVStoreLookupRequest(
                compat_hash=self.compat.hash, hashes=list(hashes)), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as error:
            self._failed("Lookup", error)
            return None
        return reply

    async def offer_and_put(self, hashes: Sequence[BlockHash], parent_hash: BlockHash | None,
                            token_ids: Sequence[int], blocks: torch.Tensor) -> int:
        """Send the blocks the store lacks; returns how many it stored (0 on failure).

        ``blocks``: [len(hashes), num_layers, 2, block_size, num_kv_heads, head_dim] in the
        compat's dtype (e.g. ``kv_cache[block_ids]``); ``token_ids``: len(hashes) * block_size.
        """
        n, size = len(hashes), self.compat.block_size
        if tuple(blocks.shape) != (n, *self.compat.block_shape) or blocks.nbytes != n * self.block_bytes:
            raise ValueError(f"blocks must be [{n}, *{self.compat.block_shape}] in "
                             f"{self.compat.dtype}, got {tuple(blocks.shape)} {blocks.dtype}")
        if len(token_ids) != n * size:
            raise ValueError(f"{n} blocks of {size} tokens need {n * size} token ids, "
                             f"got {len(token_ids)}")
        if not hashes or await self.handshake() is None:
            return 0
        try:
            offer = await self._stub.Offer(kvstore_pb2.KVStoreOfferRequest(
                compat_hash=self.compat.hash, hashes=list(hashes)), timeout=self.timeout_s)
            wanted = set(offer.accepted)
            keep = [i for i, h in enumerate(hashes) if h in wanted]
            if not keep:
                return 0
            # The store's chain must be contiguous: send from the first missing block on.
            start = keep[0]
            packed = blocks[start:].contiguous().view(torch.uint8).numpy().reshape(-1)
            header = kvstore_pb2.KVStorePutHeader(
                compat_hash=self.compat.hash, hashes=list(hashes[start:]),
                parent_hash=(hashes[start - 1] if start else parent_hash) or b"",
                token_ids=list(token_ids[start * size:]), total_bytes=packed.nbytes)
            reply = await self._stub.Put(_put_chunks(header, packed), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as error:
            self._failed("Put", error)
            return 0
        return int(reply.num_stored)

    async def get_into(self, hashes: Sequence[BlockHash], dst_blocks: Sequence[torch.Tensor]) -> int:
        """Copy the blocks' bytes into ``dst_blocks[i]`` (each one contiguous block view);
        returns how many leading blocks were filled."""
        if len(hashes) != len(dst_blocks) or not hashes or await self.handshake() is None:
            return 0
        dst = [d.view(torch.uint8).numpy().reshape(-1) for d in dst_blocks]
        if any(d.nbytes != self.block_bytes for d in dst):
            raise ValueError(f"every destination must be one block of {self.block_bytes} bytes")
        filled, offset = 0, 0
        try:
            stream = self._stub.Get(kvstore_pb2.KVStoreGetRequest(
                compat_hash=self.compat.hash, hashes=list(hashes), lease_ms=self.lease_ms),
                timeout=self.timeout_s)
            async for chunk in stream:
                data = np.frombuffer(chunk.data, dtype=np.uint8)
                if offset + data.size > len(dst) * self.block_bytes:
                    self._failed("Get", RuntimeError("the store sent more bytes than asked for"))
                    break
                while data.size:  # chunks need not align with blocks
                    i, within = divmod(offset, self.block_bytes)
                    take = min(self.block_bytes - within, data.size)
                    dst[i][within:within + take] = data[:take]
                    data, offset = data[take:], offset + take
                filled = offset // self.block_bytes
        except grpc.aio.AioRpcError as error:
            self._failed("Get", error)
        return filled

    async def serves_nixl(self) -> bool | None:
        """Whether the store serves NIXL reads (its handshake carries agent metadata); None
        when it is unreachable."""
        store = await self.handshake()
        return None if store is None else bool(store.agent_metadata)

    async def read_into(self, reader: NixlBlockReader, hashes: Sequence[BlockHash],
                        dst_block_ids: Sequence[int], deadline: float | None = None) -> int:
        """NIXL READ of the blocks into the reader's registered cache at ``dst_block_ids``;
        returns len(hashes) when every byte landed under a live lease, else 0 (the blocks'
        contents are then undefined). The caller owns ``dst_block_ids`` throughout.

        ``deadline`` (``time.monotonic()`` seconds; default ``timeout_s`` from now) bounds the
        whole call, like the lease does. The lease is released whatever happens, cancellation
        included. A READ still in progress at the deadline is abandoned
        (``reader.num_abandoned`` counts it): UCX may still write its destination blocks later,
        so the caller must never hand those blocks to anyone else."""
        deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
        store = await self.handshake()
        if store is None or not hashes or len(hashes) != len(dst_block_ids) or time.monotonic() >= deadline:
            return 0
        try:
            name = reader.connect(store)
            lease = await self._stub.PrepareRead(kvstore_pb2.KVStoreReadRequest(
                compat_hash=self.compat.hash, hashes=list(hashes), lease_ms=self.lease_ms),
                timeout=max(0.001, deadline - time.monotonic()))
        except (grpc.aio.AioRpcError, KVTransferError) as error:
            self._failed("PrepareRead", error)
            return 0
        state = TransferState.FAILED
        try:
            state = await self._read(reader, name, lease, dst_block_ids,
                                     min(deadline, time.monotonic() + lease.expires_in_ms / 1000))
        finally:  # also on cancellation: the lease goes back at once, not when it expires
            released = await self._release(lease.lease_id)
        if state is not TransferState.DONE or not released:  # expired: may be stale
            return 0
        return len(hashes)

    async def _read(self, reader: NixlBlockReader, name: str, lease: kvstore_pb2.KVStorePrepareReadReply,
                    dst_block_ids: Sequence[int], deadline: float) -> TransferState:
        """Post the READ of ``lease``'s slots and poll it until DONE, FAILED or ``deadline``
        (then, or on cancellation, the READ is abandoned)."""
        if time.monotonic() >= deadline:
            return TransferState.FAILED
        try:
            xfer = reader.start_read(name, lease.slot_ids, dst_block_ids)
        except KVTransferError as error:
            self._failed("NIXL READ", error)
            return TransferState.FAILED
        state = TransferState.IN_PROGRESS
        try:
            state = reader.poll(xfer)
            while state is TransferState.IN_PROGRESS and time.monotonic() < deadline:
                await asyncio.sleep(0.0005)
                state = reader.poll(xfer)
            if state is TransferState.FAILED:
                self._failed("NIXL READ", KVTransferError("the transfer failed (the store died?)"))
        finally:
            if state is TransferState.IN_PROGRESS:
                reader.abandon(xfer)
                self._failed("NIXL READ", TimeoutError("no completion before the deadline"))
        return state

    async def _release(self, lease_id: int) -> bool:
        """Release a read lease; False when the store did not hold it (expired) or is gone."""
        try:
            reply = await self._stub.Release(kvstore_pb2.KVStoreReleaseRequest(lease_id=lease_id),
                                             timeout=self.timeout_s)
        except grpc.aio.AioRpcError as error:
            self._failed("Release", error)
            return False
        return bool(reply.released)

    def _failed(self, what: str, error: Exception) -> None:
        self.num_failures += 1
        if not (isinstance(error, grpc.aio.AioRpcError)
                and error.code() == grpc.StatusCode.NOT_FOUND):
            self._store = None  # Handshake again next time: a restarted store forgot our compat
        log.warning("kvstore %s %s failed (a miss): %s", self.address, what, error)


async def _put_chunks(header: kvstore_pb2.KVStorePutHeader,
                      packed: np.ndarray) -> AsyncIterator[kvstore_pb2.KVStorePutChunk]:
    yield kvstore_pb2.KVStorePutChunk(header=header)
    for offset in range(0, packed.nbytes, CHUNK_BYTES):
        yield kvstore_pb2.KVStorePutChunk(offset=offset,
                                          data=packed[offset:offset + CHUNK_BYTES].tobytes())

"""KVStoreService: the gRPC edge of the node's block store (protos/pdserve/v1/kvstore.proto).

Protobuf stops here: requests become (compat hash, block hashes, bytes) calls on
:class:`BlockStore`, which runs on the event loop's thread (every call is short: a dict walk or
a memcpy of the blocks). Bad input raises InvalidArgument (unknown compat, malformed hashes or
sizes) or NotFound (a Get / PrepareRead for a block not held) with a message naming what was
wrong (services/common/errors.py; the server maps them to gRPC status); the store is left as it
was and the service keeps serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TypeVar

import grpc

from engine.kv_cache.hashing import BlockHash
from engine.kv_transfer.base import KV_WIRE_VERSION, KVHandshake, KVRegion
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.common.faults import faults
from services.common.grpc_server import CHUNK_BYTES
from services.common.pb import kv_pb2, kvstore_pb2, kvstore_pb2_grpc
from services.common.wire import handshake_from_proto, handshake_to_proto
from services.kvstore.index_publisher import KVStoreIndexPublisher
from services.kvstore.leases import Lease
from services.kvstore.nixl_host import NixlHost
from services.kvstore.store import BlockStore, MissingBlocksError

KVSTORE_SERVICE_NAME = kvstore_pb2.DESCRIPTOR.services_by_name["KVStoreService"].full_name
PROGRESS_INTERVAL_S = 0.002  # UCX progress while a NIXL read lease is live, never otherwise
T = TypeVar("T")


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServiceServicer):
    def __init__(self, store: BlockStore, nixl: NixlHost | None = None,
                 agent_name: str = "kvstore-grpc") -> None:
        self.store = store
        self.nixl = nixl
        self.agent_name = agent_name
        self._nixl_leases: set[int] = set()
        self._progress_task: asyncio.Task[None] | None = None
        self.index: KVStoreIndexPublisher | None = None  # the prefix index (--redis-url)

    async def Handshake(self, request: kv_pb2.KVHandshake,
                        context: grpc.aio.ServicerContext) -> kv_pb2.KVHandshake:
        remote = handshake_from_proto(request)
        if remote.wire_version != KV_WIRE_VERSION:
            raise FailedPrecondition(f"KV wire version differs: kvstore={KV_WIRE_VERSION} "
                                     f"client={remote.wire_version}; upgrade the older side")
        if request.compat_hash != remote.compat.hash:
            raise InvalidArgument(f"compat_hash {request.compat_hash[:16]!r} is not the hash of "
                                  f"the compat sent ({remote.compat.hash[:16]!r})")
        region = _checked("Handshake", self.store.register, remote.compat)
        if self.index is not None:
            await self.index.on_register(region.compat)
        if self.nixl is not None:
            return handshake_to_proto(self.nixl.handshake(region))
        return handshake_to_proto(KVHandshake(compat=region.compat, agent_name=self.agent_name,
                                              region=KVRegion.of(region.tensor)))

    async def Lookup(self, request: kvstore_pb2.KVStoreLookupRequest,
                     context: grpc.aio.ServicerContext) -> kvstore_pb2.KVStoreLookupReply:
        num_hits, present = _checked("Lookup", self.store.lookup, request.compat_hash,
                                     _hashes(request.hashes))
        return kvstore_pb2.KVStoreLookupReply(num_prefix_hits=num_hits, present=present)

    async def Offer(self, request: kvstore_pb2.KVStoreOfferRequest,
                    context: grpc.aio.ServicerContext) -> kvstore_pb2.KVStoreOfferReply:
        wanted = _checked("Offer", self.store.offer, request.compat_hash, _hashes(request.hashes))
        return kvstore_pb2.KVStoreOfferReply(accepted=wanted)

    async def Put(self, request_iterator: AsyncIterator[kvstore_pb2.KVStorePutChunk],
                  context: grpc.aio.ServicerContext) -> kvstore_pb2.KVStorePutReply:
        header: kvstore_pb2.KVStorePutHeader | None = None
        payload = bytearray()
        async for chunk in request_iterator:
            if header is None:
                if not chunk.HasField("header"):
                    raise InvalidArgument("Put: the first chunk must carry the header")
                header = chunk.header
                error = self._check_put_header(header)
                if error:
                    raise InvalidArgument(f"Put: {error}")
            if chunk.offset != len(payload):
                raise InvalidArgument(f"Put: chunk at offset {chunk.offset}, expected "
                                      f"{len(payload)} (chunks must come in order)")
            if len(payload) + len(chunk.data) > header.total_bytes:
                raise InvalidArgument(f"Put: more than the {header.total_bytes} bytes the header says")
            payload += chunk.data
        if header is None:
            raise InvalidArgument("Put: empty stream")
        if len(payload) != header.total_bytes:
            raise InvalidArgument(f"Put: got {len(payload)} bytes, the header says {header.total_bytes}")
        hashes = _hashes(header.hashes)
        num_stored = _checked("Put", self.store.put, header.compat_hash, hashes,
                              BlockHash(header.parent_hash) if header.parent_hash else None,
                              list(header.token_ids), payload)
        if self.index is not None:
            self.index.flush()
        else:
            self.store.take_events()  # nobody reads them: do not let them pile up
        return kvstore_pb2.KVStorePutReply(num_stored=num_stored,
                                           num_skipped=len(hashes) - num_stored)

    def _check_put_header(self, header: kvstore_pb2.KVStorePutHeader) -> str:
        """An error message, or "" when the sizes match the compat's block bytes."""
        try:
            region = self.store.region(header.compat_hash)
        except ValueError as error:
            return str(error)
        expected = len(header.hashes) * region.block_bytes
        if expected > self.store.config.capacity_bytes:
            return (f"{len(header.hashes)} blocks ({expected} bytes) exceed the store's capacity "
                    f"of {self.store.config.capacity_bytes} bytes; put fewer at a time")
        if header.total_bytes != expected:
            return (f"{len(header.hashes)} blocks of {region.block_bytes} bytes are {expected} "
                    f"bytes, the header says total_bytes={header.total_bytes}")
        return ""

    async def Get(self, request: kvstore_pb2.KVStoreGetRequest,
                  context: grpc.aio.ServicerContext) -> AsyncIterator[kvstore_pb2.KVStoreGetChunk]:
        lease = self._acquire("Get", request)
        try:
            region = self.store.region(request.compat_hash)
            total = len(lease.slot_ids) * region.block_bytes
            yield kvstore_pb2.KVStoreGetChunk(total_bytes=total)
            offset, pending = 0, bytearray()
            for i, slot_id in enumerate(lease.slot_ids):
                pending += region.read(slot_id)
                is_last = i == len(lease.slot_ids) - 1
                while len(pending) >= CHUNK_BYTES or (is_last and pending):  # blocks span chunks
                    data = bytes(pending[:CHUNK_BYTES])
                    del pending[:CHUNK_BYTES]
                    yield kvstore_pb2.KVStoreGetChunk(offset=offset, data=data)
                    offset += len(data)
        finally:
            self.store.release(lease.lease_id)

    async def PrepareRead(self, request: kvstore_pb2.KVStoreReadRequest,
                          context: grpc.aio.ServicerContext) -> kvstore_pb2.KVStorePrepareReadReply:
        if self.nixl is None:
            raise FailedPrecondition("PrepareRead: this kvstore runs without NIXL; use Get")
        lease = self._acquire("PrepareRead", request)
        region = self.store.region(request.compat_hash)
        self._nixl_leases.add(lease.lease_id)
        if self._progress_task is None or self._progress_task.done():
            self._progress_task = asyncio.get_running_loop().create_task(self._progress())
        r = KVRegion.of(region.tensor)
        return kvstore_pb2.KVStorePrepareReadReply(
            lease_id=lease.lease_id, slot_ids=lease.slot_ids,
            expires_in_ms=int(request.lease_ms or self.store.config.default_lease_s * 1000),
            agent_name=self.nixl.agent_name(request.compat_hash),
            region=kv_pb2.KVRegion(mem_type=kv_pb2.MEMORY_TYPE_DRAM, base_addr=r.base_addr,
                                   device_id=r.device_id, num_blocks=r.num_blocks,
                                   block_bytes=r.block_bytes))

    async def Release(self, request: kvstore_pb2.KVStoreReleaseRequest,
                      context: grpc.aio.ServicerContext) -> kvstore_pb2.KVStoreReleaseReply:
        faults().at_kvstore_release()  # PDSERVE_FAULTS only
        self._nixl_leases.discard(request.lease_id)
        return kvstore_pb2.KVStoreReleaseReply(released=self.store.release(request.lease_id))

    async def GetStats(self, request: kvstore_pb2.KVStoreStatsRequest,
                       context: grpc.aio.ServicerContext) -> kvstore_pb2.KVStoreStats:
        s = self.store.stats()
        return kvstore_pb2.KVStoreStats(
            num_hits=s.num_hits, num_misses=s.num_misses, num_stored=s.num_stored,
            num_evicted=s.num_evicted, bytes_in=s.bytes_in, bytes_out=s.bytes_out,
            num_leases=s.num_leases, num_leases_granted=s.num_leases_granted,
            num_leases_expired=s.num_leases_expired, num_blocks=s.num_blocks,
            used_bytes=s.used_bytes, capacity_bytes=s.capacity_bytes,
            has_nixl=self.nixl is not None)

    def _acquire(self, what: str,
                 request: kvstore_pb2.KVStoreGetRequest | kvstore_pb2.KVStoreReadRequest) -> Lease:
        lease_s = request.lease_ms / 1000 if request.lease_ms else None
        try:
            return _checked(what, self.store.acquire, request.compat_hash, _hashes(request.hashes),
                            lease_s)
        except MissingBlocksError as error:
            raise NotFound(f"{what}: {error.args[0]}") from error

    async def _progress(self) -> None:
        """Drive UCX while NIXL read leases are live (released or expired ends it)."""
        assert self.nixl is not None
        delay_s = faults().plan.kvstore_progress_delay_ms / 1000  # PDSERVE_FAULTS only
        if delay_s:
            await asyncio.sleep(delay_s)
        while self._nixl_leases:
            self.nixl.progress()
            await asyncio.sleep(PROGRESS_INTERVAL_S)
            self._nixl_leases = {i for i in self._nixl_leases if self.store.is_leased(i)}


def _checked(what: str, call: Callable[..., T], *args: object) -> T:
    """``call(*args)``; the store's ValueError (bad input: unknown compat, malformed hashes
    or sizes) as InvalidArgument naming the RPC. MissingBlocksError passes through."""
    try:
        return call(*args)
    except MissingBlocksError:
        raise
    except ValueError as error:
        raise InvalidArgument(f"{what}: {error}") from error


def _hashes(raw: Iterable[bytes]) -> list[BlockHash]:
    return [BlockHash(bytes(h)) for h in raw]

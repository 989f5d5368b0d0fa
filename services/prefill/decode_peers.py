"""The decode workers a prefill worker has talked to: one channel and one handshake each.

The KV handshake (KVTransferService.Handshake, compatibility hash checked on both sides) runs
once per (decode worker, transfer method) and is cached. A failed push drops the cached
connection, so a decode worker restarted at the same address is handshaken again.
"""

from __future__ import annotations

import asyncio

import grpc

from engine.kv_transfer.base import KVTransferError, RemoteInfo
from services.common.channels import internal_channel
from services.common.grpc_server import MAX_MESSAGE_BYTES, PEER_CHANNEL_OPTIONS
from services.common.pb import kv_pb2_grpc, worker_pb2_grpc
from services.common.wire import handshake_from_proto, handshake_to_proto
from services.prefill.pusher import KVPusher

HANDSHAKE_TIMEOUT_S = 5.0


class DecodePeer:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = internal_channel(address, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), *PEER_CHANNEL_OPTIONS])
        self.decode = worker_pb2_grpc.DecodeServiceStub(self.channel)
        self._kv = kv_pb2_grpc.KVTransferServiceStub(self.channel)
        self._remotes: dict[int, RemoteInfo] = {}
        self._locks: dict[int, asyncio.Lock] = {}

    async def remote(self, method: int, pusher: KVPusher) -> RemoteInfo:
        """The connected receiver for ``method``, handshaking first if needed.

        Raises KVTransferError (incompatible peers: the message lists the differing fields)
        or grpc.aio.AioRpcError (the peer is unreachable).
        """
        lock = self._locks.setdefault(method, asyncio.Lock())
        async with lock:
            if method not in self._remotes:
                try:
                    reply = await self._kv.Handshake(handshake_to_proto(pusher.handshake_info()),
                                                     timeout=HANDSHAKE_TIMEOUT_S)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() is grpc.StatusCode.FAILED_PRECONDITION:
                        raise KVTransferError(f"KV handshake with decode worker {self.address} "
                                              f"failed: {exc.details()}") from exc
                    raise
                self._remotes[method] = await pusher.connect(handshake_from_proto(reply), self.address)
            return self._remotes[method]

    def forget(self, method: int) -> None:
        self._remotes.pop(method, None)

    async def close(self) -> None:
        await self.channel.close()


class DecodePeers:
    def __init__(self) -> None:
        self._peers: dict[str, DecodePeer] = {}

    def get(self, address: str) -> DecodePeer:
        if address not in self._peers:
            self._peers[address] = DecodePeer(address)
        return self._peers[address]

    async def close(self) -> None:
        for peer in self._peers.values():
            await peer.close()
        self._peers.clear()

"""KV-transfer setup for the workers, and the prefill side's sender driven from asyncio.

Which connectors a worker runs (``--transfer``):

    nixl: decode serves NixlKVReceiver (its handshake carries NIXL metadata) and the gRPC
          PushBlocks receiver; prefill runs NixlKVSender and GrpcKVSender. A request names
          the method it wants (PrefillRequest.transfer_method).
    grpc: gRPC only, on both sides.

A ``KVSender`` must be called from one thread. :class:`KVPusher` gives it a thread of its
own: connectors are created, registered, connected, sent on and polled there, and one
asyncio task polls every in-flight transfer and resolves its future. The engine thread is
never blocked by a transfer, and a transfer never waits for an engine step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.kv_transfer.base import (
    KVHandshake,
    KVReceiver,
    KVSender,
    RemoteInfo,
    TransferHandle,
    TransferState,
)
from services.common.pb import worker_pb2

log = logging.getLogger(__name__)
NIXL = worker_pb2.KV_TRANSFER_METHOD_NIXL
GRPC = worker_pb2.KV_TRANSFER_METHOD_GRPC
METHOD_NAMES = {NIXL: "nixl", GRPC: "grpc"}
POLL_INTERVAL_S = 0.001


def transfer_methods(transfer: str) -> list[int]:
    """The methods a worker started with ``--transfer`` serves, preferred first."""
    return [NIXL, GRPC] if transfer == "nixl" else [GRPC]


def make_receivers(transfer: str, model_name: str, kv_cache: torch.Tensor) -> tuple[KVReceiver, ...]:
    """Decode side: (gRPC receiver, NIXL receiver?) registered on ``kv_cache``. Raises
    KVTransferError (saying to use --transfer grpc) when NIXL is asked for but unusable."""
    from services.common.kv_transfer_grpc import GrpcKVReceiver

    receivers: list[KVReceiver] = [GrpcKVReceiver(model_name)]
    if transfer == "nixl":
        from engine.kv_transfer.nixl import NixlKVReceiver
        receivers.append(NixlKVReceiver(model_name))
    for receiver in receivers:
        receiver.register(kv_cache)
    return tuple(receivers)


def sender_factories(transfer: str, model_name: str) -> dict[int, Callable[[], KVSender]]:
    from services.common.kv_transfer_grpc import GrpcKVSender

    factories: dict[int, Callable[[], KVSender]] = {GRPC: lambda: GrpcKVSender(model_name)}
    if transfer == "nixl":
        from engine.kv_transfer.nixl import NixlKVSender
        factories[NIXL] = lambda: NixlKVSender(model_name)
    return factories


class KVPusher:
    """A KVSender on its own thread; ``send`` returns a future resolved when the transfer ends."""

    def __init__(self, sender: KVSender, executor: ThreadPoolExecutor) -> None:
        self.sender = sender
        self._executor = executor
        self._pending: dict[int, tuple[TransferHandle, asyncio.Future[TransferHandle]]] = {}
        self._wake = asyncio.Event()
        self._poller = asyncio.get_running_loop().create_task(self._poll_loop())

    @classmethod
    async def create(cls, factory: Callable[[], KVSender], kv_cache: torch.Tensor) -> KVPusher:
        """Create and register the sender on a fresh thread. Raises KVTransferError."""
        executor = ThreadPoolExecutor(1, thread_name_prefix="kv-sender")

        def build() -> KVSender:
            sender = factory()
            sender.register(kv_cache)
            return sender

        try:
            sender = await asyncio.get_running_loop().run_in_executor(executor, build)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(sender, executor)

    def handshake_info(self) -> KVHandshake:
        return self.sender.handshake_info()

    async def connect(self, remote: KVHandshake, address: str) -> RemoteInfo:
        return await self._run(self.sender.connect, remote, address)

    async def send(self, request_id: str, src_block_ids: Sequence[int], remote: RemoteInfo,
                   dst_block_ids: Sequence[int]) -> asyncio.Future[TransferHandle]:
        """Start a transfer (KVTransferError for bad ids); the future gets the finished handle
        (state DONE or FAILED). The source blocks must stay allocated until it resolves."""
        handle = await self._run(self.sender.send_blocks, request_id, list(src_block_ids),
                                 remote, list(dst_block_ids))
        future: asyncio.Future[TransferHandle] = asyncio.get_running_loop().create_future()
        if handle.state is not TransferState.IN_PROGRESS:
            future.set_result(handle)
        else:
            self._pending[handle.transfer_id] = (handle, future)
            self._wake.set()
        return future

    async def close(self) -> None:
        self._poller.cancel()
        for handle, future in self._pending.values():
            handle.state, handle.error = TransferState.FAILED, "the sender was closed"
            if not future.done():
                future.set_result(handle)
        self._pending.clear()
        try:
            await self._run(self.sender.close)
        finally:
            self._executor.shutdown(wait=False)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _poll_all(self, handles: list[TransferHandle]) -> list[TransferHandle]:
        return [h for h in handles if self.sender.poll(h) is not TransferState.IN_PROGRESS]

    async def _poll_loop(self) -> None:
        while True:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
            handles = [handle for handle, _ in self._pending.values()]
            try:
                finished = await self._run(self._poll_all, handles)
            except Exception as exc:  # noqa: BLE001 - a broken transport fails its transfers
                log.exception("polling KV transfers failed")
                for handle in handles:
                    handle.state, handle.error = TransferState.FAILED, f"poll failed: {exc!r}"
                finished = handles
            for handle in finished:
                _, future = self._pending.pop(handle.transfer_id, (None, None))
                if future is not None and not future.done():
                    future.set_result(handle)
            await asyncio.sleep(POLL_INTERVAL_S)

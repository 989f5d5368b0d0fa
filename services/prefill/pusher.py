"""The prefill worker's KV senders (by ``--transfer``), each driven from asyncio by a KVPusher.

    nixl: NixlKVSender and GrpcKVSender (a request names the method it wants).
    grpc: GrpcKVSender only.

A ``KVSender`` must be called from one thread. :class:`KVPusher` gives it a thread of its
own: the connector is created, registered, connected, sent on and polled there, and each
transfer's asyncio future is resolved when the poll sees it end. The engine thread is never
blocked by a transfer, and a transfer never waits for an engine step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from engine.kv_transfer.base import (
    KVHandshake,
    KVSender,
    RemoteInfo,
    TransferHandle,
    TransferState,
)
from services.common.faults import faults
from services.common.wire import GRPC, NIXL

log = logging.getLogger(__name__)
POLL_INTERVAL_S = 0.001  # between polls while transfers are in flight


def sender_factories(transfer: str, model_name: str,
                     shared_memory: bool = True) -> dict[int, Callable[[], KVSender]]:
    from services.prefill.kv_grpc_sender import GrpcKVSender

    factories: dict[int, Callable[[], KVSender]] = {
        GRPC: lambda: GrpcKVSender(model_name, shared_memory=shared_memory)}
    if transfer == "nixl":
        from engine.kv_transfer.nixl import NixlKVSender
        factories[NIXL] = lambda: NixlKVSender(model_name)
    return factories


T = TypeVar("T")
# a command for the sender thread: fn, its arguments, the future that gets its result
_Command = tuple[Callable[..., Any], tuple[object, ...], asyncio.Future[Any]]


class KVPusher:
    """A KVSender on its own thread; ``send`` returns a future resolved when the transfer ends.

    The thread runs commands (create, connect, send) in order and, while transfers are in
    flight, polls them about every ``POLL_INTERVAL_S``; results go back to the event loop
    with ``call_soon_threadsafe``.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()  # None: stop
        self._pending: dict[int, tuple[TransferHandle, asyncio.Future[TransferHandle]]] = {}
        self.sender: KVSender | None = None
        self._handshake: KVHandshake | None = None  # taken on the sender thread
        self._thread = threading.Thread(target=self._run, name="kv-sender", daemon=True)
        self._thread.start()

    @classmethod
    async def create(cls, factory: Callable[[], KVSender], kv_cache: torch.Tensor) -> KVPusher:
        """Create and register the sender on a fresh thread. Raises KVTransferError."""
        pusher = cls(asyncio.get_running_loop())

        def build() -> KVSender:
            sender = factory()
            sender.register(kv_cache)
            pusher.sender, pusher._handshake = sender, sender.handshake_info()
            return sender

        try:
            await pusher._call(build)
        except BaseException:
            pusher._commands.put(None)
            raise
        return pusher

    @property
    def _live_sender(self) -> KVSender:
        """The sender ``create`` built; a KVPusher is only handed out after that."""
        assert self.sender is not None, "KVPusher used before create() finished"
        return self.sender

    def handshake_info(self) -> KVHandshake:
        assert self._handshake is not None, "KVPusher used before create() finished"
        return self._handshake

    async def connect(self, remote: KVHandshake, address: str) -> RemoteInfo:
        return await self._call(self._live_sender.connect, remote, address)

    async def send(self, request_id: str, src_block_ids: Sequence[int], remote: RemoteInfo,
                   dst_block_ids: Sequence[int]) -> asyncio.Future[TransferHandle]:
        """Start a transfer (KVTransferError for bad ids); the future gets the finished handle
        (state DONE or FAILED). The source blocks must stay allocated until it resolves."""
        done: asyncio.Future[TransferHandle] = self._loop.create_future()

        def start() -> None:
            if faults().kv_send_dropped():  # PDSERVE_FAULTS only (services/common/faults.py)
                handle = TransferHandle(request_id, len(src_block_ids), state=TransferState.FAILED,
                                        error="fault injection: KV send dropped")
            else:
                handle = self._live_sender.send_blocks(request_id, list(src_block_ids), remote,
                                                 list(dst_block_ids))
            if handle.state is TransferState.IN_PROGRESS:
                self._pending[handle.transfer_id] = (handle, done)
            else:
                self._loop.call_soon_threadsafe(_resolve, done, handle)

        await self._call(start)
        return done

    async def close(self) -> None:
        await self._call(self._close)
        self._commands.put(None)

    def _close(self) -> None:
        for handle, done in self._pending.values():
            handle.state, handle.error = TransferState.FAILED, "the sender was closed"
            self._loop.call_soon_threadsafe(_resolve, done, handle)
        self._pending.clear()
        if self.sender is not None:
            self.sender.close()

    async def _call(self, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn(*args)`` on the sender thread; its result or exception comes back here."""
        result: asyncio.Future[T] = self._loop.create_future()
        self._commands.put((fn, args, result))
        return await result

    def _run(self) -> None:
        while True:
            command: _Command | tuple[()] | None
            try:
                command = self._commands.get(timeout=POLL_INTERVAL_S if self._pending else None)
            except queue.Empty:
                command = ()
            if command is None:
                return
            if command:
                fn, args, result = command
                try:
                    value = fn(*args)
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    self._loop.call_soon_threadsafe(_fail, result, exc)
                else:
                    self._loop.call_soon_threadsafe(_resolve, result, value)
            self._poll()

    def _poll(self) -> None:
        for transfer_id, (handle, done) in list(self._pending.items()):
            try:
                state = self._live_sender.poll(handle)
            except Exception as exc:  # noqa: BLE001 - a broken transport fails the transfer
                log.exception("polling a KV transfer failed")
                handle.state, handle.error = TransferState.FAILED, f"poll failed: {exc!r}"
                state = TransferState.FAILED
            if state is not TransferState.IN_PROGRESS:
                del self._pending[transfer_id]
                self._loop.call_soon_threadsafe(_resolve, done, handle)


def _resolve(future: asyncio.Future[T], value: T) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)

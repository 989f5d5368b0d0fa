"""NIXL connectors: one agent per process, UCX backend, one-sided WRITEs into reserved blocks.

Each side registers the whole KV tensor once (DRAM_SEG on CPU, VRAM_SEG on CUDA) and
describes it to NIXL as ``num_blocks`` descriptors of ``block_bytes`` each, so a transfer
is a list of block indices on both sides. The receiver's handshake carries its agent
metadata (``get_agent_metadata()``, taken after registration so it includes the region);
the sender loads it with ``add_remote_agent`` and WRITEs with a notification whose payload
names the request and the destination blocks. The receiver only polls notifications: the
write completes without any work on its side.

UCX picks the transports: between two processes on one host it uses cma (cross-memory
attach) for the writes and tcp for the notifications; ``UCX_TLS`` / ``UCX_NET_DEVICES``
restrict it (tests pin ``UCX_NET_DEVICES=lo``).
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    import torch


def import_nixl() -> Any:
    """Return ``nixl._api`` or raise KVTransferError saying why NIXL cannot be used here."""
    try:
        from nixl import _api  # type: ignore[import-untyped]  # no stubs; the `nixl` meta package picks nixl_cu12 / nixl_cu13
    except Exception as exc:  # ImportError, or a backend wheel whose shared libraries fail
        raise KVTransferError(
            f"NIXL is not usable in this environment ({type(exc).__name__}: {exc}); "
            "install it with `pip install nixl` or use --transfer grpc") from exc
    return _api


class NixlAgent:
    """A NIXL agent with the UCX backend and one registered KV tensor."""

    def __init__(self, model_name: str, role: str, agent_name: str | None = None) -> None:
        api = import_nixl()
        self.model_name = model_name
        self.name = agent_name or f"pdserve-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            # No progress thread: NIXL's polls UCX with no delay between polls, a core per idle
            # agent. Progress is made by the calls that wait on it instead (check_xfer_state on
            # the sender's thread, get_new_notifs on the receiver's loop), only while needed.
            config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
            self.agent = api.nixl_agent(self.name, config)
        except Exception as exc:
            raise KVTransferError(f"could not create NIXL agent {self.name!r} with the UCX "
                                  f"backend: {type(exc).__name__}: {exc}") from exc
        if "UCX" not in self.agent.backends:
            raise KVTransferError(f"NIXL has no UCX plugin here (plugins: {self.agent.plugin_list})")
        self.kv_cache: torch.Tensor | None = None
        self.region: KVRegion | None = None
        self._reg_descs = None

    def register(self, kv_cache: torch.Tensor) -> None:
        if self.kv_cache is not None:
            raise KVTransferError(f"agent {self.name!r} already has a registered kv_cache")
        self.region = KVRegion.of(kv_cache)
        self._reg_descs = self.agent.register_memory(kv_cache)  # mem type from the device
        self.kv_cache = kv_cache
        self.compat = KVCompat.from_kv_cache(self.model_name, kv_cache)

    def block_descs(self, region: KVRegion) -> list[tuple[int, int, int]]:
        """(address, length, device id) of every block in ``region``."""
        return [(region.base_addr + i * region.block_bytes, region.block_bytes, region.device_id)
                for i in range(region.num_blocks)]

    def handshake_info(self) -> KVHandshake:
        if self.region is None:
            raise KVTransferError("call register(kv_cache) before handshake_info()")
        return KVHandshake(compat=self.compat, agent_name=self.name, region=self.region,
                           agent_metadata=self.agent.get_agent_metadata())

    def close(self) -> None:
        if self._reg_descs is not None:
            self.agent.deregister_memory(self._reg_descs)
            self._reg_descs = None


class NixlKVSender(KVSender):
    """Prefill side: WRITEs local blocks into a connected receiver's reserved blocks."""

    def __init__(self, model_name: str, agent_name: str | None = None) -> None:
        self._agent = NixlAgent(model_name, "prefill", agent_name)
        self._local_dlist = None
        self._remote_dlists: dict[str, Any] = {}  # remote agent name -> prepped dlist
        self._xfers: dict[int, Any] = {}  # transfer id -> nixl_xfer_handle

    @property
    def agent_name(self) -> str:
        return self._agent.name

    def register(self, kv_cache: torch.Tensor) -> None:
        self._agent.register(kv_cache)
        assert self._agent.region is not None
        self._local_dlist = self._agent.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self._agent.block_descs(self._agent.region),
            self._agent.region.mem_type)

    def handshake_info(self) -> KVHandshake:
        return self._agent.handshake_info()

    def connect(self, remote: KVHandshake, address: str = "") -> RemoteInfo:
        self.handshake_info().check_compatible(remote, sides=("sender", "receiver"))
        if not remote.agent_metadata:
            raise KVTransferError(f"receiver {remote.agent_name!r} sent no NIXL agent metadata; "
                                  "it does not run NIXL, use the gRPC transport")
        agent = self._agent.agent
        name = agent.add_remote_agent(remote.agent_metadata)
        name = name.decode() if isinstance(name, bytes) else name
        if name not in self._remote_dlists:
            self._remote_dlists[name] = agent.prep_xfer_dlist(
                name, self._agent.block_descs(remote.region), remote.region.mem_type)
        return RemoteInfo(handshake=remote, address=address, peer_name=name)

    def send_blocks(self, request_id: str, src_block_ids: Sequence[int], remote: RemoteInfo,
                    dst_block_ids: Sequence[int]) -> TransferHandle:
        if self._agent.region is None:
            raise KVTransferError("call register(kv_cache) before send_blocks()")
        if remote.peer_name not in self._remote_dlists:
            raise KVTransferError(f"not connected to {remote.peer_name!r}; call connect() first")
        check_send_args(src_block_ids, dst_block_ids, self._agent.region.num_blocks,
                        remote.handshake)
        handle = TransferHandle(request_id=request_id, num_blocks=len(src_block_ids))
        agent = self._agent.agent
        xfer = None
        try:
            xfer = agent.make_prepped_xfer(
                "WRITE", self._local_dlist, list(src_block_ids),
                self._remote_dlists[remote.peer_name], list(dst_block_ids),
                encode_notification(request_id, dst_block_ids))
            state = agent.transfer(xfer)
        except Exception as exc:  # nixlRemoteDisconnectError and kin: the peer is gone
            state = f"{type(exc).__name__}: {exc}"
        if state == "PROC" or state == "DONE":
            self._xfers[handle.transfer_id] = xfer
        else:
            if xfer is not None:
                with contextlib.suppress(Exception):  # a handle to a dead peer may refuse
                    xfer.release()
            handle.state = TransferState.FAILED
            handle.error = f"NIXL refused to post the WRITE to {remote.peer_name!r} ({state})"
        return handle

    def poll(self, handle: TransferHandle) -> TransferState:
        xfer = self._xfers.get(handle.transfer_id)
        if xfer is None:  # already finished
            return handle.state
        state = self._agent.agent.check_xfer_state(xfer)
        if state == "PROC":
            return TransferState.IN_PROGRESS
        del self._xfers[handle.transfer_id]
        xfer.release()
        if state == "DONE":
            handle.state = TransferState.DONE
        else:
            handle.state, handle.error = TransferState.FAILED, "NIXL WRITE failed (see UCX log)"
        return handle.state

    def close(self) -> None:
        for xfer in self._xfers.values():
            xfer.release()
        self._xfers.clear()
        self._agent.close()


class NixlKVReceiver(KVReceiver):
    """Decode side: exposes its registered cache and turns NIXL notifications into events."""

    def __init__(self, model_name: str, agent_name: str | None = None) -> None:
        self._agent = NixlAgent(model_name, "decode", agent_name)

    @property
    def agent_name(self) -> str:
        return self._agent.name

    def register(self, kv_cache: torch.Tensor) -> None:
        self._agent.register(kv_cache)

    def handshake_info(self) -> KVHandshake:
        return self._agent.handshake_info()

    def completed_requests(self) -> list[KVNotification]:
        notifications: list[KVNotification] = []
        for sender, messages in self._agent.agent.get_new_notifs().items():
            sender = sender.decode() if isinstance(sender, bytes) else sender
            notifications.extend(decode_notification(m, sender) for m in messages)
        return notifications

    def close(self) -> None:
        self._agent.close()


def encode_notification(request_id: str, dst_block_ids: Sequence[int]) -> bytes:
    """The NIXL notification payload: JSON ``{"r": request_id, "b": [block ids]}``."""
    return json.dumps({"r": request_id, "b": list(dst_block_ids)}, separators=(",", ":")).encode()


def decode_notification(message: bytes, sender: str) -> KVNotification:
    body = json.loads(message)
    return KVNotification(request_id=body["r"], dst_block_ids=tuple(body["b"]), sender=sender)

"""The worker side of the kvstore's NIXL path: READ store slots into local KV cache blocks.

The reader owns a NIXL agent (UCX, no progress thread) with the worker's KV cache registered,
``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``. ``connect`` loads the
store's agent metadata (from the kvstore Handshake); ``start_read`` posts one READ of store
slots into local blocks; ``poll`` drives it to DONE or FAILED. Not thread-safe: one thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.kv_transfer.base import KVHandshake, KVTransferError, TransferState

if TYPE_CHECKING:
    import torch


class NixlBlockReader:
    def __init__(self, model_name: str, kv_cache: torch.Tensor, agent_name: str | None = None) -> None:
        from engine.kv_transfer.nixl import NixlAgent

        self._agent = NixlAgent(model_name, "kvstore-reader", agent_name)
        self._agent.register(kv_cache)
        assert self._agent.region is not None
        self.region = self._agent.region
        self.compat = self._agent.compat
        self._local = self._agent.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self._agent.block_descs(self.region), self.region.mem_type)
        self._remotes: dict[str, Any] = {}  # store agent name -> prepped dlist of its slots
        self.num_abandoned = 0  # READs given up while in progress: their blocks may still change

    @property
    def agent_name(self) -> str:
        return self._agent.name

    def connect(self, store: KVHandshake) -> str:
        """Load the store's agent; returns its name. KVTransferError if incompatible."""
        self._agent.handshake_info().check_compatible(store, sides=("worker", "kvstore"))
        if not store.agent_metadata:
            raise KVTransferError(f"kvstore {store.agent_name!r} runs without NIXL; use Get")
        name = self._agent.agent.add_remote_agent(store.agent_metadata)
        name = name.decode() if isinstance(name, bytes) else name
        if name not in self._remotes:
            self._remotes[name] = self._agent.agent.prep_xfer_dlist(
                name, self._agent.block_descs(store.region), store.region.mem_type)
        return name

    def start_read(self, store_name: str, slot_ids: Sequence[int],
                   dst_block_ids: Sequence[int]) -> Any:
        """Post a READ of store ``slot_ids[i]`` into local block ``dst_block_ids[i]``; returns
        the transfer handle. KVTransferError if it cannot be posted."""
        if store_name not in self._remotes:
            raise KVTransferError(f"not connected to kvstore agent {store_name!r}")
        if len(slot_ids) != len(dst_block_ids) or not slot_ids:
            raise KVTransferError(f"{len(slot_ids)} store slots for {len(dst_block_ids)} blocks")
        bad = [b for b in dst_block_ids if not 0 <= b < self.region.num_blocks]
        if bad:
            raise KVTransferError(f"destination block ids {bad[:8]} out of range "
                                  f"[0, {self.region.num_blocks})")
        agent = self._agent.agent
        try:
            xfer = agent.make_prepped_xfer("READ", self._local, list(dst_block_ids),
                                           self._remotes[store_name], list(slot_ids))
            state = agent.transfer(xfer)
        except Exception as exc:  # the store is gone, or UCX refused
            raise KVTransferError(f"NIXL READ from {store_name!r} not posted: "
                                  f"{type(exc).__name__}: {exc}") from exc
        if state not in ("PROC", "DONE"):
            with contextlib.suppress(Exception):
                xfer.release()
            raise KVTransferError(f"NIXL READ from {store_name!r} refused ({state})")
        return xfer

    def poll(self, xfer: Any) -> TransferState:
        """IN_PROGRESS, or DONE / FAILED (then the handle is released)."""
        try:
            state = self._agent.agent.check_xfer_state(xfer)
        except Exception:  # noqa: BLE001 - a dead peer surfaces here
            state = "ERR"
        if state == "PROC":
            return TransferState.IN_PROGRESS
        with contextlib.suppress(Exception):
            xfer.release()
        return TransferState.DONE if state == "DONE" else TransferState.FAILED

    def abandon(self, xfer: Any) -> None:
        """Give up on a READ still in progress. Its destination blocks are then undefined, and
        may still be written by UCX after this returns (releasing the handle is a request to
        cancel, not a guarantee): counted in ``num_abandoned``."""
        self.num_abandoned += 1
        with contextlib.suppress(Exception):
            xfer.release()

    def close(self) -> None:
        self._agent.close()

"""KV transfer over gRPC, what both ends share: the registered cache and its handshake.

The transport is kv.proto's ``KVTransferService``: the decode worker serves it
(services/decode/kv_grpc_receiver.py: ``Handshake`` answers with the receiver's
:class:`KVHandshake`, NIXL metadata included when the worker runs NIXL, so the prefill side
calls it whichever transport moves the bytes; ``PushBlocks`` is the fallback transport), the
prefill worker pushes into it (services/prefill/kv_grpc_sender.py). Bytes are packed by
engine/kv_transfer/packing.py. Nothing is pickled.
"""

from __future__ import annotations

import os
import uuid

import torch

from engine.kv_transfer.base import KVCompat, KVHandshake, KVRegion, KVTransferError
from services.common.grpc_server import CHUNK_BYTES

DEFAULT_CHUNK_BYTES = CHUNK_BYTES  # payload per message; the header travels alone
DEFAULT_PUSH_TIMEOUT_S = 60.0
DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0


def _local_handshake(model_name: str, kv_cache: torch.Tensor, agent_name: str) -> KVHandshake:
    return KVHandshake(compat=KVCompat.from_kv_cache(model_name, kv_cache),
                       agent_name=agent_name, region=KVRegion.of(kv_cache))


def _agent_name(role: str) -> str:
    return f"pdserve-{role}-grpc-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class GrpcEndpoint:
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

"""The decode worker's KV receivers, by ``--transfer``.

    nixl: the gRPC PushBlocks receiver and NixlKVReceiver (whose handshake, carrying NIXL
          metadata, is the one the worker answers with); a request names the method it wants.
    grpc: the gRPC receiver only.
"""

from __future__ import annotations

import torch

from engine.kv_transfer.base import KVReceiver
from services.decode.kv_grpc_receiver import GrpcKVReceiver


def make_receivers(transfer: str, model_name: str, kv_cache: torch.Tensor,
                   shared_memory: bool = True) -> tuple[KVReceiver, ...]:
    """Decode side: (gRPC receiver, NIXL receiver?) registered on ``kv_cache``; the gRPC one
    takes same-host pushes through shared memory unless ``shared_memory`` is False. Raises
    KVTransferError (saying to use --transfer grpc) when NIXL is asked for but unusable."""
    receivers: list[KVReceiver] = [GrpcKVReceiver(model_name, shared_memory)]
    if transfer == "nixl":
        from engine.kv_transfer.nixl import NixlKVReceiver
        receivers.append(NixlKVReceiver(model_name))
    for receiver in receivers:
        receiver.register(kv_cache)
    return tuple(receivers)

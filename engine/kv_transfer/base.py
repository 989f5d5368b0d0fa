"""KV-transfer connectors by role: the prefill side sends blocks, the decode side receives them.

The unit of transfer is a *block* of the paged cache. With the layout of
:class:`engine.config.CacheConfig`::

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

one block is one contiguous region across all layers, so block ``i`` sits at
``base_addr + i * block_bytes`` and the *packed* form of a list of blocks is simply the raw
bytes of ``kv_cache[block_ids]``, in list order. Nothing else (and never pickle) crosses.

Protocol, whatever the transport:

1. Both sides ``register(kv_cache)`` once, then exchange :class:`KVHandshake` values
   (the services carry them over ``KVTransferService.Handshake``).
2. The sender calls ``connect(remote_handshake)``, which checks the wire version and the
   compatibility hash and raises :class:`KVTransferError` naming every differing field.
3. The decode side reserves destination blocks; the sender calls ``send_blocks`` and then
   ``poll``s the handle. The source blocks must stay allocated and unmodified until ``poll``
   returns DONE or FAILED.
4. The receiver learns of landed blocks from ``completed_requests()``: one
   :class:`KVNotification` per ``send_blocks`` call, after all its bytes are in place.

This module is torch-free at import (the router and tests use the hash without torch).
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import json
import struct
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, ClassVar

from engine.kv_cache.quant_format import SCALE_BYTES, is_quantized, stored_head_dim

if TYPE_CHECKING:
    import torch

KV_WIRE_VERSION = 1
# 1: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], block-contiguous; for a
#    quantized dtype (int8, float8_e4m3fn) each row is head_dim codes + its 4-byte fp32 scale.
KV_LAYOUT_VERSION = 1

class KVTransferError(RuntimeError):
    """A transfer cannot happen as asked (incompatible peers, bad block ids, transport down)."""


@dataclass(frozen=True)
class KVCompat:
    """The values that must be equal on both sides for a block to mean the same thing.

    ``dtype`` is the cache's storage dtype (``CacheConfig.dtype``: float32, int8, ...) and
    ``head_dim`` the model's; a quantized cache's rows are wider by their scale (``block_shape``),
    so an int8 worker and an fp32 one never agree on the hash and refuse each other's blocks.
    """

    model_name: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout_version: int = KV_LAYOUT_VERSION

    @classmethod
    def from_kv_cache(cls, model_name: str, kv_cache: torch.Tensor) -> KVCompat:
        check_kv_layout(kv_cache)
        _, num_layers, _, block_size, num_kv_heads, row_width = kv_cache.shape
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        head_dim = row_width - SCALE_BYTES if is_quantized(dtype) else row_width
        return cls(model_name, dtype, block_size, num_layers, num_kv_heads, head_dim)

    @property
    def hash(self) -> str:
        return kv_compat_hash(**asdict(self))

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one stored block: [num_layers, 2, block_size, num_kv_heads, head_dim], with
        head_dim + 4 (the scale's bytes) for a quantized dtype."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads,
                stored_head_dim(self.dtype, self.head_dim))

    def check_matches(self, remote: KVCompat, sides: tuple[str, str] = ("local", "remote")) -> None:
        """Raise :class:`KVTransferError` listing each field that differs from ``remote``.

        ``sides`` names this side and the remote one in the message (e.g. receiver/sender).
        """
        mine, theirs = sides
        diffs = [f"{f.name}: {mine}={getattr(self, f.name)!r} {theirs}={getattr(remote, f.name)!r}"
                 for f in fields(self) if getattr(self, f.name) != getattr(remote, f.name)]
        if diffs:
            raise KVTransferError(
                "KV caches are incompatible (" + "; ".join(diffs) + "); the prefill and decode "
                "workers must serve the same model with the same cache dtype (--kv-cache-dtype) "
                "and block size")


def kv_compat_hash(model_name: str, dtype: str, block_size: int, num_layers: int,
                   num_kv_heads: int, head_dim: int, layout_version: int = KV_LAYOUT_VERSION) -> str:
    """sha256 hex of everything that must agree between a sender and a receiver."""
    canonical = json.dumps(
        {"wire_version": KV_WIRE_VERSION, "model_name": model_name, "dtype": dtype,
         "block_size": block_size, "num_layers": num_layers, "num_kv_heads": num_kv_heads,
         "head_dim": head_dim, "layout_version": layout_version},
        sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_kv_layout(kv_cache: torch.Tensor) -> None:
    """Raise ValueError unless ``kv_cache`` is a contiguous 6-d cache with a K/V axis of 2."""
    if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
        raise ValueError("kv_cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, "
                         f"head_dim], got shape {tuple(kv_cache.shape)}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (one block = one region across layers)")


def check_block_ids(block_ids: Sequence[int], num_blocks: int, what: str) -> None:
    """Raise KVTransferError for ids outside [0, num_blocks) or repeated ids."""
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise KVTransferError(f"{what} block ids {bad[:8]} out of range [0, {num_blocks})")
    if len(set(block_ids)) != len(block_ids):
        raise KVTransferError(f"{what} block ids repeat: {list(block_ids)[:16]}")


@dataclass(frozen=True)
class KVRegion:
    """Where the registered cache lives: block i is at ``base_addr + i * block_bytes``."""

    mem_type: str  # "DRAM" | "VRAM"
    base_addr: int
    device_id: int
    num_blocks: int
    block_bytes: int

    @classmethod
    def of(cls, kv_cache: torch.Tensor) -> KVRegion:
        check_kv_layout(kv_cache)
        return cls(mem_type="DRAM" if kv_cache.device.type == "cpu" else "VRAM",
                   base_addr=kv_cache.data_ptr(), device_id=max(kv_cache.get_device(), 0),
                   num_blocks=kv_cache.shape[0],
                   block_bytes=kv_cache[0].numel() * kv_cache.element_size())


@dataclass(frozen=True)
class KVHandshake:
    """What one side tells the other before any block moves (mirrors kv.proto KVHandshake)."""

    compat: KVCompat
    agent_name: str
    region: KVRegion
    agent_metadata: bytes = b""  # NIXL get_agent_metadata(); empty for the gRPC transport
    wire_version: int = KV_WIRE_VERSION
    shm_probe: str = ""  # gRPC receiver: its shared-memory probe (services/worker/kv_shm.py)

    _HEADER: ClassVar[struct.Struct] = struct.Struct(">4sI")
    _MAGIC: ClassVar[bytes] = b"PDKV"

    def check_compatible(self, remote: KVHandshake,
                         sides: tuple[str, str] = ("local", "remote")) -> None:
        """Raise :class:`KVTransferError` if ``remote`` cannot exchange blocks with us."""
        if remote.wire_version != self.wire_version:
            raise KVTransferError(f"KV wire version differs: {sides[0]}={self.wire_version} "
                                  f"{sides[1]}={remote.wire_version}; upgrade the older worker")
        if remote.compat.hash != self.compat.hash:
            self.compat.check_matches(remote.compat, sides)

    def to_bytes(self) -> bytes:
        """Self-describing encoding (JSON header + raw agent metadata) for out-of-band use."""
        header = json.dumps({"wire_version": self.wire_version, "agent_name": self.agent_name,
                             "compat": asdict(self.compat), "region": asdict(self.region),
                             "shm_probe": self.shm_probe}).encode()
        return self._HEADER.pack(self._MAGIC, len(header)) + header + self.agent_metadata

    @classmethod
    def from_bytes(cls, data: bytes) -> KVHandshake:
        try:
            magic, header_len = cls._HEADER.unpack_from(data)
            if magic != cls._MAGIC:
                raise ValueError(f"bad magic {magic!r}")
            start = cls._HEADER.size
            header = json.loads(data[start:start + header_len])
            return cls(compat=KVCompat(**header["compat"]), agent_name=header["agent_name"],
                       region=KVRegion(**header["region"]),
                       agent_metadata=bytes(data[start + header_len:]),
                       wire_version=header["wire_version"],
                       shm_probe=str(header.get("shm_probe", "")))
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            raise KVTransferError(f"not a pdserve KV handshake ({type(exc).__name__}: {exc})") from exc


@dataclass(frozen=True)
class RemoteInfo:
    """A receiver the sender has connected to (returned by ``KVSender.connect``)."""

    handshake: KVHandshake
    address: str = ""  # host:port of its KVTransferService (gRPC transport)
    peer_name: str = ""  # the transport's name for it (the NIXL remote agent name)


class TransferState(enum.Enum):
    IN_PROGRESS = "in_progress"
    DONE = "done"
    FAILED = "failed"


_transfer_ids = itertools.count()


@dataclass(slots=True, eq=False)
class TransferHandle:
    """One ``send_blocks`` call. ``state`` and ``error`` are updated by ``poll``."""

    request_id: str
    num_blocks: int
    transfer_id: int = field(default_factory=lambda: next(_transfer_ids))
    state: TransferState = TransferState.IN_PROGRESS
    error: str = ""


@dataclass(frozen=True, slots=True)
class KVNotification:
    """Blocks of ``request_id`` that have fully landed in the receiver's cache."""

    request_id: str
    dst_block_ids: tuple[int, ...]
    sender: str = ""  # agent name of the sender


class KVSender(ABC):
    """Prefill side. Not thread-safe: call from one thread (the worker's engine thread)."""

    @abstractmethod
    def register(self, kv_cache: torch.Tensor) -> None:
        """Register the whole cache once; ``kv_cache`` must outlive the connector."""

    @abstractmethod
    def handshake_info(self) -> KVHandshake: ...

    @abstractmethod
    def connect(self, remote: KVHandshake, address: str = "") -> RemoteInfo:
        """Check compatibility (raises KVTransferError) and prepare to write into ``remote``."""

    @abstractmethod
    def send_blocks(self, request_id: str, src_block_ids: Sequence[int], remote: RemoteInfo,
                    dst_block_ids: Sequence[int]) -> TransferHandle:
        """Start copying local blocks ``src_block_ids[i]`` into remote ``dst_block_ids[i]``.

        Raises KVTransferError for bad ids (out of range, repeated, unequal lengths);
        transport failures surface later as ``poll(...) == FAILED`` with ``handle.error``.
        """

    @abstractmethod
    def poll(self, handle: TransferHandle) -> TransferState: ...

    def close(self) -> None:
        """Release transport resources; pending transfers are abandoned."""


class KVReceiver(ABC):
    """Decode side: owns the destination cache and reports what has landed."""

    @abstractmethod
    def register(self, kv_cache: torch.Tensor) -> None: ...

    @abstractmethod
    def handshake_info(self) -> KVHandshake: ...

    @abstractmethod
    def completed_requests(self) -> list[KVNotification]:
        """Notifications that arrived since the last call (each is returned once)."""

    def close(self) -> None:
        """Release transport resources."""


def check_send_args(src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                    num_local_blocks: int, remote: KVHandshake) -> None:
    """Validate a ``send_blocks`` call against both caches (shared by the transports)."""
    if len(src_block_ids) != len(dst_block_ids):
        raise KVTransferError(f"send_blocks got {len(src_block_ids)} source and "
                              f"{len(dst_block_ids)} destination block ids; they pair up 1:1")
    if not src_block_ids:
        raise KVTransferError("send_blocks got no block ids")
    check_block_ids(src_block_ids, num_local_blocks, "source")
    check_block_ids(dst_block_ids, remote.region.num_blocks, "destination")

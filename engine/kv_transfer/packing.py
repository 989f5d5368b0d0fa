"""Packing KV blocks into bytes and writing byte ranges back (the gRPC transport's payload).

The transport itself (streams, deadlines, status codes) is in services/prefill/kv_grpc_sender.py
and services/decode/kv_grpc_receiver.py; ``engine/`` never imports grpc.

Packed format of ``block_ids = [b0, b1, ...]`` (``block_bytes`` = one block across layers)::

    offset 0              block_bytes            2*block_bytes
    | raw bytes of kv_cache[b0] | raw bytes of kv_cache[b1] | ...

A stream may split it anywhere (chunks need not align to blocks); ``write_packed_range``
puts one chunk's bytes where they belong in the destination cache.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

RowsT = TypeVar("RowsT", np.ndarray, torch.Tensor)


def block_bytes_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache as ``uint8 [num_blocks, block_bytes]`` sharing its storage."""
    return kv_cache.view(torch.uint8).view(kv_cache.shape[0], -1)


def _block_rows(kv_cache: torch.Tensor) -> np.ndarray | torch.Tensor:
    """``block_bytes_view`` as a numpy array for a CPU cache, else the tensor. The copies of a
    transfer run on the caller's thread (gRPC's); numpy copies on that thread alone, where
    torch's index ops would open OpenMP parallel regions there, and a second OpenMP team in
    the process makes libgomp stop spinning for the engine's (``AsyncEngine.build``):
    decode steps of a 2-thread worker fed over gRPC took 31.7 ms instead of 21."""
    rows = block_bytes_view(kv_cache)
    return rows.numpy() if rows.device.type == "cpu" else rows


def pack_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int],
                out: np.ndarray | None = None) -> torch.Tensor:
    """Copy ``kv_cache[block_ids]`` to a flat CPU ``uint8`` tensor (a gather, then one copy).
    ``out``: a CPU cache's blocks are gathered into this flat uint8 array of exactly their
    size instead (a shared-memory segment: no fresh memory to fault in)."""
    rows = _block_rows(kv_cache)
    if isinstance(rows, np.ndarray):
        ids = np.asarray(block_ids, dtype=np.int64)
        if out is not None:
            np.take(rows, ids, axis=0, out=out.reshape(len(ids), rows.shape[1]))
            return torch.from_numpy(out)
        gathered: np.ndarray = rows[ids]
        return torch.from_numpy(gathered.reshape(-1))
    if out is not None:
        raise ValueError("pack_blocks: out= is for a CPU cache")
    index = torch.tensor(list(block_ids), dtype=torch.long, device=kv_cache.device)
    return rows.index_select(0, index).reshape(-1).cpu()


class PackedBlocks:
    """``pack_blocks``' payload, on CUDA perhaps still on its way to host memory
    (``gather_blocks``): ``host()`` waits for it."""

    def __init__(self, host: torch.Tensor, copied: torch.cuda.Event | None = None,
                 source: torch.Tensor | None = None) -> None:
        self._host = host
        self._copied = copied
        self._source = source  # the device-side gather, kept until its copy is done

    @property
    def nbytes(self) -> int:
        return self._host.numel()

    def host(self) -> torch.Tensor:
        """The flat ``uint8`` payload in host memory (blocks until the copy is done)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = self._source = None
        return self._host


def gather_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int],
                  stream: torch.cuda.Stream | None = None) -> PackedBlocks:
    """Start packing ``kv_cache[block_ids]`` (``pack_blocks``' format) into host memory.

    A CPU cache (or no ``stream``): packed now. A CUDA cache: gathered on ``stream``, after the
    work queued so far on the caller's current stream (the engine's, which wrote the blocks), and
    copied into pinned memory there; the caller does not wait for it, where ``pack_blocks``
    waits for everything queued on the device and copies into pageable memory. The blocks must
    not be written again until ``host()`` has returned (a sender keeps them allocated until its
    transfer ends)."""
    if not kv_cache.is_cuda or stream is None:
        return PackedBlocks(pack_blocks(kv_cache, block_ids))
    rows = block_bytes_view(kv_cache)
    ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ready.record()
    host = torch.empty(len(block_ids) * rows.shape[1], dtype=torch.uint8, pin_memory=True)
    index = torch.tensor(list(block_ids), dtype=torch.long, pin_memory=True)
    with torch.cuda.stream(stream):
        stream.wait_event(ready)
        gathered = rows.index_select(0, index.to(kv_cache.device, non_blocking=True)).reshape(-1)
        host.copy_(gathered, non_blocking=True)
        copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
        copied.record(stream)
    return PackedBlocks(host, copied, gathered)


def iter_chunks(packed: torch.Tensor, max_chunk_bytes: int) -> Iterator[tuple[int, bytes]]:
    """Yield ``(offset, bytes)`` pieces of ``packed`` of at most ``max_chunk_bytes`` each."""
    if max_chunk_bytes <= 0:
        raise ValueError(f"max_chunk_bytes must be positive, got {max_chunk_bytes}")
    flat = packed.numpy()
    for offset in range(0, flat.size, max_chunk_bytes):
        yield offset, flat[offset:offset + max_chunk_bytes].tobytes()


def bytes_as_tensor(data: bytes | np.ndarray) -> torch.Tensor:
    """A read-only ``uint8`` view of ``data`` without a copy (only ever read from)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable"
        return torch.frombuffer(data, dtype=torch.uint8)


def write_packed_range(kv_cache: torch.Tensor, dst_block_ids: Sequence[int], offset: int,
                       data: bytes | np.ndarray | torch.Tensor) -> None:
    """Write bytes ``[offset, offset + len(data))`` of a packed payload into ``kv_cache``.

    Whole blocks inside the range go in with one scatter
    (``cache[dst_ids] = chunk.view(n, block_bytes)``); a partial block at either end is
    sliced. The caller has checked that the ids are valid and the range is inside
    ``len(dst_block_ids) * block_bytes``. ``data`` may be a flat ``uint8`` numpy array (a
    shared-memory view) or CPU tensor: a pinned tensor goes to a CUDA cache without blocking,
    on the current stream.
    """
    if not len(data):
        return
    rows = _block_rows(kv_cache)
    if isinstance(rows, np.ndarray):
        src = data.numpy() if isinstance(data, torch.Tensor) else np.frombuffer(data, dtype=np.uint8)
        _write_range(rows, src, dst_block_ids, offset, list)
    else:
        def index(ids: list[int]) -> torch.Tensor:
            return torch.tensor(ids, dtype=torch.long, device=rows.device)
        host = data if isinstance(data, torch.Tensor) else bytes_as_tensor(data)
        _write_range(rows, host.to(rows.device, non_blocking=host.is_pinned()), dst_block_ids, offset, index)


def _write_range(cache: RowsT, src: RowsT, dst_block_ids: Sequence[int], offset: int,
                 index: Callable[[list[int]], Any]) -> None:
    """``write_packed_range`` on ``cache`` [num_blocks, block_bytes] (numpy or torch alike);
    ``index(ids)`` makes the index of a run of whole blocks."""
    block_bytes = cache.shape[1]
    end = offset + len(src)
    pos = offset
    while pos < end:
        block, in_block = divmod(pos, block_bytes)
        if in_block == 0 and end - pos >= block_bytes:  # a run of whole blocks
            num_whole = (end - pos) // block_bytes
            ids = index(list(dst_block_ids[block:block + num_whole]))
            cache[ids] = src[pos - offset:pos - offset + num_whole * block_bytes].reshape(
                num_whole, block_bytes)
            pos += num_whole * block_bytes
        else:  # the head or tail of one block
            length = min(block_bytes - in_block, end - pos)
            cache[dst_block_ids[block], in_block:in_block + length] = src[pos - offset:
                                                                          pos - offset + length]
            pos += length

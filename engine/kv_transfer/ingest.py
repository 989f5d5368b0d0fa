"""Writing a pushed payload's chunks into the KV cache off the receiving event loop.

On a CPU a chunk is a numpy copy into the cache (``packing.write_packed_range``). On CUDA a
chunk from pageable bytes would be copied on the engine's stream, behind the decode step in
flight: the caller (the gRPC servicer's event loop) would wait for that step, and for the copy,
at every 4 MiB, while every stream it serves stalls. Here each chunk goes through one pinned
staging buffer onto a side stream, which waits for nothing the engine queued (the reserved
blocks it writes are read by no step before the push is delivered), and the caller's thread
waits for that copy alone. ``write`` blocks: call it in a worker thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Sequence

import numpy as np
import torch

from engine.kv_transfer.packing import write_packed_range


class ChunkWriter:
    """Writes chunks into ``kv_cache``; thread-safe (one chunk at a time on CUDA: one staging
    buffer of ``max_chunk_bytes``, larger chunks go through it in pieces)."""

    def __init__(self, kv_cache: torch.Tensor, max_chunk_bytes: int) -> None:
        self.kv_cache = kv_cache
        self._lock = threading.Lock()
        self._stream: torch.cuda.Stream | None = None
        self._staging: torch.Tensor | None = None
        if kv_cache.is_cuda:
            self._stream = torch.cuda.Stream(kv_cache.device)  # type: ignore[no-untyped-call]
            self._staging = torch.empty(max_chunk_bytes, dtype=torch.uint8, pin_memory=True)

    def write(self, dst_block_ids: Sequence[int], offset: int, data: bytes | np.ndarray,
              crc: int | None = 0) -> int | None:
        """Write bytes ``[offset, offset + len(data))`` of a payload packed from
        ``dst_block_ids``'s blocks (``write_packed_range``'s contract; ``data`` bytes or a flat
        uint8 array); returns ``crc`` updated with ``data`` (zlib.crc32), computed on this
        thread too, or None when ``crc`` is None (not checked)."""
        if crc is not None:
            crc = zlib.crc32(data if isinstance(data, bytes) else data.data, crc)
        if self._stream is None or self._staging is None:
            write_packed_range(self.kv_cache, dst_block_ids, offset, data)
            return crc
        src = np.frombuffer(data, dtype=np.uint8)
        size = self._staging.numel()
        with self._lock, torch.cuda.stream(self._stream):
            for start in range(0, len(src), size):
                piece = src[start:start + size]
                staged = self._staging[:len(piece)]
                staged.numpy()[:] = piece  # into pinned memory: the copy below does not block
                write_packed_range(self.kv_cache, dst_block_ids, offset + start, staged)
                self._stream.synchronize()  # the staging is free again, and the bytes landed
        return crc

"""One preallocated host region per KV compatibility: the slots the kvstore copies blocks into.

The region has the worker cache's layout, ``[num_slots, num_layers, 2, block_size,
num_kv_heads, head_dim]`` in the compat's dtype, so slot ``i`` is one contiguous block at
``base_addr + i * block_bytes`` and the whole region is one NIXL registration (a worker READs
slot ``i`` straight into one of its own blocks). Pages are committed by the kernel only when a
slot is first written, so a large capacity costs address space, not memory, until used.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.kv_transfer.base import KVCompat

_DTYPES = {name: dtype for name in ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn",
                                    "float8_e5m2", "int8", "uint8")
           if isinstance(dtype := getattr(torch, name, None), torch.dtype)}


def block_bytes_of(compat: KVCompat) -> int:
    """Bytes of one block of ``compat``: num_layers * 2 * block_size * kv_heads * head_dim * itemsize."""
    numel = 1
    for dim in compat.block_shape:
        numel *= dim
    return numel * torch.empty(0, dtype=torch_dtype(compat.dtype)).element_size()


def torch_dtype(name: str) -> torch.dtype:
    """``"float16"`` -> ``torch.float16``; ValueError for a name torch does not know."""
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise ValueError(f"unknown KV dtype {name!r}; expected a torch dtype name such as 'float16'")
    return dtype


class BlockRegion:
    """``num_slots`` block slots of one compat, and which of them are free."""

    def __init__(self, compat: KVCompat, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a region needs at least one slot, got num_slots={num_slots}")
        self.compat = compat
        self.block_bytes = block_bytes_of(compat)
        self.tensor = torch.empty((num_slots, *compat.block_shape), dtype=torch_dtype(compat.dtype))
        # [num_slots, block_bytes] view of the same memory, for byte copies
        self.rows: np.ndarray = self.tensor.view(num_slots, -1).view(torch.uint8).numpy()
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def num_slots(self) -> int:
        return self.tensor.shape[0]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot_id: int) -> None:
        self._free.append(slot_id)

    def write(self, slot_id: int, data: memoryview) -> None:
        """Copy exactly ``block_bytes`` of ``data`` into slot ``slot_id``."""
        if len(data) != self.block_bytes:
            raise ValueError(f"a block of this compat is {self.block_bytes} bytes, got {len(data)}")
        self.rows[slot_id] = np.frombuffer(data, dtype=np.uint8)

    def read(self, slot_id: int) -> memoryview:
        """The bytes of slot ``slot_id`` (a view: valid while the slot is leased)."""
        return memoryview(self.rows[slot_id])

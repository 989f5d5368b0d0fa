"""The compiled quantized linear on CPU (``kernels/cpu/csrc/quant_linear.cpp``).

    handle = pack(rows)        # QuantRows (kernels.quant) -> panels, once at load
    y = quant_linear(x, handle)    # x [M, in] fp32 -> [M, out] fp32

``pack`` repacks the file's blocks into column panels of the ISA's lane count (the C++ file
documents the layout) without changing a byte of a scale or a quant: the weight's values are
the file's. Bad arguments raise ValueError naming them. Importing this module builds the
library once per machine and raises ``kernels.cpu.CpuKernelsUnavailable`` if it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.cpu import library
from kernels.quant import BLOCK, QuantRows, to_q4_1

_ops = library("quant_linear")
_quant_linear = _ops.quant_linear.default
LANES = library("linear").linear_lanes()
FORMAT_IDS = {"q8_0": 0, "q4_1": 1}


@dataclass(frozen=True, slots=True)
class PackedQuant:
    """Panels [P, num_blocks, block bytes] uint8 of one matrix, and what the kernel needs to
    read them. ``nbytes`` is what one call streams."""

    panels: torch.Tensor
    out_features: int
    format_id: int

    @property
    def in_features(self) -> int:
        return self.panels.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return self.panels.numel()


def pack(rows: QuantRows) -> PackedQuant:
    """QuantRows -> the kernel's panel layout (4-bit as q4_1; the last panel zero-padded)."""
    if rows.format != "q8_0":
        rows = to_q4_1(rows)
    blocks = rows.blocks()  # [N, nb, bytes]
    n, nb, _ = blocks.shape
    num_panels = -(-n // LANES)
    padded = np.zeros((num_panels * LANES, nb, blocks.shape[2]), dtype=np.uint8)
    padded[:n] = blocks
    per_lane = padded.reshape(num_panels, LANES, nb, -1).transpose(0, 2, 1, 3)  # [P, nb, L, bytes]
    if rows.format == "q8_0":
        header, quants = per_lane[..., :2], per_lane[..., 2:]  # d | 32 q
    else:
        header, quants = per_lane[..., :4], per_lane[..., 4:]  # d m | 16 bytes
    # header: per lane (d[, m]) -> d for every lane, then m for every lane
    header = header.reshape(num_panels, nb, LANES, -1, 2).transpose(0, 1, 3, 2, 4)
    quants = quants.transpose(0, 1, 3, 2)  # [P, nb, byte i, lane]
    panel = np.concatenate([header.reshape(num_panels, nb, -1), quants.reshape(num_panels, nb, -1)], axis=2)
    return PackedQuant(torch.from_numpy(np.ascontiguousarray(panel)), n, FORMAT_IDS[rows.format])


def quant_linear(x: torch.Tensor, weight: PackedQuant) -> torch.Tensor:
    """x [M, in] fp32 (stride 1 in the last dim) -> [M, out] fp32."""
    return _quant_linear(x, weight.panels, weight.out_features, weight.format_id)

"""The compiled quantized linear on CPU (``kernels/cpu/csrc/quant_linear.cpp``).

    handle = pack(rows)        # QuantRows (kernels.quant) -> panels, once at load
    y = quant_linear(x, handle)    # x [M, in] fp32 -> [M, out] fp32
    y, residual_out = rms_norm_quant_linear(x, norm_weight, eps, residual, handle)   # fused

``$PDSERVE_CPU_QUANT_ACTIVATIONS`` (read by ``pack``, so per weight at load):

    int8   (default) x quantized to 8 bits per block of 32 inputs, integer dot products
           (llama.cpp's arithmetic; ``kernels.quant.quant_linear_int8_ref``)
    fp32   x kept in fp32: exactly the products of dequantize-then-matmul, in another order
           (what the greedy-parity test against HF on the dequantized weights runs); slower

``pack`` repacks the file's blocks into column panels of the ISA's lane count (the C++ file
documents the layout) without changing a byte of a scale or a quant: the weight's values are
the file's. ``quant_linear`` quantizes each row of x to 8 bits per block of 32 inputs and sums
integer products, as llama.cpp does (``kernels.quant.quant_linear_int8_ref`` is its exact
reference; the error against the fp32 x is bounded there). Bad arguments raise ValueError
naming them. Importing this module builds the
library once per machine and raises ``kernels.cpu.CpuKernelsUnavailable`` if it cannot.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kernels.cpu import library
from kernels.quant import BLOCK_VALUES, QuantRows, nibble_pairs, q4_k_codes, q4_k_scales, q6_k_codes, to_offset_form

_ops = library("quant_linear")
_quant_linear: Callable[..., torch.Tensor] = _ops.quant_linear.default
_rms_norm_quant_linear: Callable[..., tuple[torch.Tensor, torch.Tensor]] = _ops.rms_norm_quant_linear.default
LANES: int = library("linear").linear_lanes()
FORMAT_IDS = {"q8_0": 0, "q4_1": 1, "q4_k": 2, "q6_k": 3, "q5_1": 4}
_FORMATS = {v: k for k, v in FORMAT_IDS.items()}
ACTIVATIONS_ENV = "PDSERVE_CPU_QUANT_ACTIVATIONS"
ACTIVATIONS = ("int8", "fp32")


def activations_mode() -> str:
    """``$PDSERVE_CPU_QUANT_ACTIVATIONS`` or ``int8``; ValueError for an unknown value."""
    mode = os.environ.get(ACTIVATIONS_ENV) or "int8"
    if mode not in ACTIVATIONS:
        raise ValueError(f"{ACTIVATIONS_ENV} must be one of {'|'.join(ACTIVATIONS)}, got {mode!r}")
    return mode


@dataclass(frozen=True, slots=True)
class PackedQuant:
    """Panels [P, num_blocks, block bytes] uint8 of one matrix, and what the kernel needs to
    read them. ``nbytes`` is what one call streams."""

    panels: torch.Tensor
    out_features: int
    format_id: int
    exact: bool = False  # x in fp32 (True) or quantized to int8 per block

    @property
    def in_features(self) -> int:
        return self.panels.shape[1] * BLOCK_VALUES[_FORMATS[self.format_id]]

    @property
    def nbytes(self) -> int:
        return self.panels.numel()


def pack(rows: QuantRows, activations: str | None = None) -> PackedQuant:
    """QuantRows -> the kernel's panel layout (Q4_0 as q4_1, Q5_0 as q5_1, the K-quants in their
    own; the last panel zero-padded), for ``activations`` int8 or fp32 (None: ``activations_mode()``)."""
    if activations not in (None, *ACTIVATIONS):
        raise ValueError(f"activations must be one of {'|'.join(ACTIVATIONS)}, got {activations!r}")
    exact = (activations or activations_mode()) == "fp32"
    rows = to_offset_form(rows)
    blocks = rows.blocks()  # [N, nb, bytes]
    n, nb, _ = blocks.shape
    num_panels = -(-n // LANES)
    padded = np.zeros((num_panels * LANES, nb, blocks.shape[2]), dtype=np.uint8)
    padded[:n] = blocks
    per_lane = padded.reshape(num_panels, LANES, nb, -1).transpose(0, 2, 1, 3)  # [P, nb, L, bytes]
    if rows.format in ("q4_k", "q6_k"):
        panel = _q4_k_panels(per_lane) if rows.format == "q4_k" else _q6_k_panels(per_lane)
        return PackedQuant(torch.from_numpy(np.ascontiguousarray(panel)), n, FORMAT_IDS[rows.format], exact)
    fifth_bits = None
    if rows.format == "q8_0":
        header, quants = per_lane[..., :2], per_lane[..., 2:]  # d | 32 q
    elif rows.format == "q5_1":
        header, quants = per_lane[..., :4], per_lane[..., 8:]  # d m | qh | 16 bytes
        fifth_bits = _fifth_bits(per_lane[..., 4:8])
    else:
        header, quants = per_lane[..., :4], per_lane[..., 4:]  # d m | 16 bytes
    # header: per lane (d[, m]) -> d for every lane, then m for every lane
    header = header.reshape(num_panels, nb, LANES, -1, 2).transpose(0, 1, 3, 2, 4)
    # quants: per lane 16 or 32 bytes -> groups of 4 bytes, each group's lanes side by side
    quants = quants.reshape(num_panels, nb, LANES, -1, 4).transpose(0, 1, 3, 2, 4)  # [P, nb, group, lane, 4]
    parts = [header.reshape(num_panels, nb, -1), quants.reshape(num_panels, nb, -1)]
    if fifth_bits is not None:
        parts.append(fifth_bits.reshape(num_panels, nb, -1))
    panel = np.concatenate(parts, axis=2)
    return PackedQuant(torch.from_numpy(np.ascontiguousarray(panel)), n, FORMAT_IDS[rows.format], exact)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5 qh [..., 4] (bit i: input i's fifth bit, little-endian) -> one word per lane whose
    byte t holds in bit 2g input 4g + t's and in bit 2g + 1 input 16 + 4g + t's (g = 0..3)."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")  # [..., 32]: input i
    word = np.zeros((*qh.shape[:-1], 4), dtype=np.uint8)
    for g in range(4):
        for t in range(4):
            word[..., t] |= (bits[..., 4 * g + t] << (2 * g)) | (bits[..., 16 + 4 * g + t] << (2 * g + 1))
    return word


def _q4_k_panels(per_lane: np.ndarray) -> np.ndarray:
    """Q4_K super-blocks [P, nb, L, 144] -> the kernel's [P, nb, 148 L]: d and dmin per lane, the
    6-bit scales and mins a byte each ([8][L] apiece), and per sub-block of 32 its 16 bytes in the
    4-bit layout (``kernels.quant.nibble_pairs``), in groups of 4 per lane."""
    p, nb, lanes, _ = per_lane.shape
    d, dmin = per_lane[..., 0:2], per_lane[..., 2:4]
    sc, mn = q4_k_scales(per_lane[..., 4:16])  # [P, nb, L, 8]
    packed = nibble_pairs(q4_k_codes(per_lane))  # [P, nb, L, 128]
    quants = packed.reshape(p, nb, lanes, 8, 4, 4).transpose(0, 1, 3, 4, 2, 5)  # [P, nb, sub, group, L, 4]
    parts = [d, dmin, sc.transpose(0, 1, 3, 2), mn.transpose(0, 1, 3, 2), quants]
    return np.concatenate([part.reshape(p, nb, -1) for part in parts], axis=2)


def _q6_k_panels(per_lane: np.ndarray) -> np.ndarray:
    """Q6_K super-blocks [P, nb, L, 210] -> the kernel's [P, nb, 210 L]: d per lane, the 16 int8
    scales ([16][L]), and per block of 32 inputs its low 4 bits in the 4-bit layout ([4][L][4])
    and its high 2 bits as two words per lane (quant_tiles.h's block_sums_q6k)."""
    p, nb, lanes, _ = per_lane.shape
    q = q6_k_codes(per_lane).reshape(p, nb, lanes, 8, 32)  # 0..63
    nibbles = nibble_pairs(q & 15).reshape(p, nb, lanes, 8, 4, 4)  # [.., block, group, t]
    h = (q >> 4).reshape(p, nb, lanes, 8, 2, 4, 4)  # [.., block, half, group, t]
    # word w of a block, byte t: inputs 4g + t, 16 + 4g + t for g = 2w (bits 0-3), 2w + 1 (bits 4-7)
    words = (h[:, :, :, :, 0, 0::2] | (h[:, :, :, :, 1, 0::2] << 2)
             | (h[:, :, :, :, 0, 1::2] << 4) | (h[:, :, :, :, 1, 1::2] << 6))  # [.., block, w, t]
    per_block = np.concatenate([nibbles.transpose(0, 1, 3, 4, 2, 5).reshape(p, nb, 8, -1),
                                words.transpose(0, 1, 3, 4, 2, 5).reshape(p, nb, 8, -1)], axis=3)
    d = per_lane[..., 208:210]
    sc = per_lane[..., 192:208].transpose(0, 1, 3, 2)  # [P, nb, 16, L]
    return np.concatenate([d.reshape(p, nb, -1), sc.reshape(p, nb, -1), per_block.reshape(p, nb, -1)], axis=2)


def quant_linear(x: torch.Tensor, weight: PackedQuant) -> torch.Tensor:
    """x [M, in] fp32 (stride 1 in the last dim) -> [M, out] fp32, x quantized to int8 per
    block of 32 inputs (``kernels.quant.quant_linear_int8_ref``)."""
    return _quant_linear(x, weight.panels, weight.out_features, weight.format_id, weight.exact)


def rms_norm_quant_linear(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor,
                          handle: PackedQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """(quant_linear(rms_norm(x + residual) * weight), x + residual): ``kernels.cpu.elementwise``'s
    rms_norm with a residual and then ``quant_linear``, bit for bit, in one call. x, residual:
    [M, in] fp32; weight: [in]."""
    return _rms_norm_quant_linear(x, residual, weight, eps, handle.panels, handle.out_features,
                                  handle.format_id, handle.exact)

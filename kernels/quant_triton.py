"""Dequantize-in-kernel GEMV/GEMM in Triton for GGUF blocks (Q8_0, 4-, 5-bit, Q4_K, Q6_K; kernels.quant).

    handle = pack(rows, device)        # QuantRows -> TritonQuant: quants, scales, offsets on device
    y = quant_linear(x, handle)        # x [M, in] fp32 -> [M, out] fp32

``pack`` splits the blocks once into three plain tensors (no value changes): ``qs`` the quant
bytes [out, in / 32 * bytes per block's quants] as stored (4-bit: byte i of a block holds
input i low and input i + 16 high; Q8_0: one int8 per input), ``d`` and ``m`` the per-block
fp16 scale and offset [out, in / 32] (m = 0 for Q8_0, -8 d for Q4_0). Q4_K keeps its
super-block d and dmin [out, in / 256] and its 6-bit sub-block scales and mins a byte each
[out, in / 32]: a sub-block's scale is d * sc, its offset -dmin * mn, formed in registers (its
quant bytes are reordered at pack time to the 4-bit layout above). Q6_K keeps its d per 256
inputs in ``d``, its int8 scales per 16 in ``sc``, and its codes q - 32 as int8 per input in
``qs`` (8 bits per weight where the file has 6.56: simpler unpacking, more bytes; the CPU kernel
reads the file's bit planes). Each program computes
BLOCK_N outputs of one row of x, streaming BLOCK_K inputs at a time: it loads the quant bytes,
unpacks and scales them in registers, and accumulates x * w in fp32. Weights stay 4/8-bit in
memory; that is the point on a GPU, where decode is bound by the bytes read. Tested on CPU
under ``TRITON_INTERPRET=1`` (small shapes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kernels._checks import check_tensor
from kernels._triton import check_launchable, tl, triton
from kernels.quant import (
    BLOCK,
    BLOCK_VALUES,
    QuantRows,
    block_codes,
    nibble_pairs,
    q4_k_codes,
    q4_k_scales,
    q6_k_codes,
    to_offset_form,
)

BLOCK_N, BLOCK_K = 16, 64


@dataclass(frozen=True, slots=True)
class TritonQuant:
    qs: torch.Tensor  # uint8 [out, in / 2] (4-bit) or int8 [out, in] (Q8_0)
    d: torch.Tensor  # fp16 [out, in / 32]; Q4_K: d [out, in / 256]
    m: torch.Tensor  # fp16 [out, in / 32]; Q4_K: dmin [out, in / 256]
    four_bit: bool
    sc: torch.Tensor | None = None  # Q4_K: uint8 [out, in / 32] sub-block scales; Q6_K: int8 [out, in / 16]
    mn: torch.Tensor | None = None  # Q4_K: ... and mins
    six_bit: bool = False  # Q6_K

    @property
    def out_features(self) -> int:
        return self.d.shape[0]

    @property
    def in_features(self) -> int:
        return self.d.shape[1] * (BLOCK if self.sc is None else BLOCK_VALUES["q4_k"])


def pack(rows: QuantRows, device: torch.device | str = "cpu") -> TritonQuant:
    """Split ``rows`` into quants, scales and offsets on ``device``."""
    packers = {"q4_k": _pack_q4_k, "q6_k": _pack_q6_k, "q5_0": _pack_q5, "q5_1": _pack_q5}
    handle = packers.get(rows.format, _pack_q8_0_or_4_bit)(rows)
    fields = (getattr(handle, f.name) for f in dataclasses.fields(handle))  # astuple would deep-copy
    moved: Iterator[Any] = (t.to(device) if isinstance(t, torch.Tensor) else t for t in fields)
    return TritonQuant(*moved)


def _fp16(blocks: np.ndarray, offset: int) -> torch.Tensor:
    """The fp16 at bytes offset, offset + 1 of every block of [out, nb, bytes] -> [out, nb]."""
    return torch.from_numpy(blocks[:, :, offset:offset + 2].copy()).view(torch.float16)[:, :, 0]


def _pack_q8_0_or_4_bit(rows: QuantRows) -> TritonQuant:
    four_bit = rows.format != "q8_0"
    blocks = np.array(to_offset_form(rows).blocks())  # a copy: the file map is read-only
    n, nb, _ = blocks.shape
    if four_bit:
        qs = torch.from_numpy(blocks[:, :, 4:].reshape(n, nb * 16).copy())
        return TritonQuant(qs, _fp16(blocks, 0), _fp16(blocks, 2), True)
    qs = torch.from_numpy(blocks[:, :, 2:].reshape(n, nb * 32).copy()).view(torch.int8)
    return TritonQuant(qs, _fp16(blocks, 0), torch.zeros(n, nb, dtype=torch.float16), False)


def _pack_q5(rows: QuantRows) -> TritonQuant:
    """The 5-bit codes as int8 per input (``qs``), d and m per block of 32 (Q5_0: m = -16 d)."""
    rows = to_offset_form(rows)
    blocks = np.array(rows.blocks())  # [out, nb, 24]
    qs = block_codes(rows).reshape(rows.out_features, -1).to(torch.int8)
    return TritonQuant(qs, _fp16(blocks, 0), _fp16(blocks, 2), False)


def _pack_q6_k(rows: QuantRows) -> TritonQuant:
    """The codes q - 32 as int8 per input, d per 256 inputs, the int8 scales per 16."""
    blocks = np.array(rows.blocks())  # [out, nb, 210]
    n, nb, _ = blocks.shape
    codes = torch.from_numpy(q6_k_codes(blocks).reshape(n, nb * 256).astype(np.int8) - 32)
    sc = torch.from_numpy(blocks[:, :, 192:208].copy().view(np.int8).reshape(n, nb * 16))
    d = _fp16(blocks, 208)
    return TritonQuant(codes, d, d, False, sc, six_bit=True)


def _pack_q4_k(rows: QuantRows) -> TritonQuant:
    blocks = np.array(rows.blocks())  # [out, nb, 144]
    n, nb, _ = blocks.shape
    sc, mn = q4_k_scales(blocks[:, :, 4:16])  # [out, nb, 8]
    qs = nibble_pairs(q4_k_codes(blocks)).reshape(n, nb * 128)
    return TritonQuant(torch.from_numpy(qs), _fp16(blocks, 0), _fp16(blocks, 2), True,
                       torch.from_numpy(sc.reshape(n, nb * 8)), torch.from_numpy(mn.reshape(n, nb * 8)))


@triton.jit
def _quant_gemv_kernel(  # type: ignore[no-untyped-def]  # JIT kernel (kernels/_triton.py)
    x_ptr, qs_ptr, d_ptr, m_ptr, sc_ptr, mn_ptr, out_ptr, N, K, stride_x, stride_qs, stride_d,
    stride_sc, stride_out, FOUR_BIT: tl.constexpr, K_QUANT: tl.constexpr,
    SIX_BIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + row * stride_x + ks, mask=k_mask, other=0.0).to(tl.float32)
        block = ks // 32
        mask = col_mask[:, None] & k_mask[None, :]
        if FOUR_BIT:
            within = ks % 32
            byte = tl.load(qs_ptr + cols[:, None] * stride_qs + (block * 16 + within % 16)[None, :],
                           mask=mask, other=0).to(tl.int32)
            q = ((byte >> ((within // 16) * 4)[None, :]) & 15).to(tl.float32)
        else:
            q = tl.load(qs_ptr + cols[:, None] * stride_qs + ks[None, :], mask=mask, other=0).to(tl.float32)
        if SIX_BIT:  # Q6_K: d per 256 inputs times the int8 scale per 16, no offset
            sc = tl.load(sc_ptr + cols[:, None] * stride_sc + (ks // 16)[None, :], mask=mask, other=0).to(tl.float32)
            d = tl.load(d_ptr + cols[:, None] * stride_d + (ks // 256)[None, :], mask=mask, other=0.0)
            d = d.to(tl.float32) * sc
            m = tl.zeros_like(d)
        elif K_QUANT:  # sub-block scale d * sc and offset -dmin * mn, d and dmin per 8 sub-blocks
            sc = tl.load(sc_ptr + cols[:, None] * stride_sc + block[None, :], mask=mask, other=0).to(tl.float32)
            mn = tl.load(mn_ptr + cols[:, None] * stride_sc + block[None, :], mask=mask, other=0).to(tl.float32)
            d = tl.load(d_ptr + cols[:, None] * stride_d + (block // 8)[None, :], mask=mask, other=0.0)
            m = tl.load(m_ptr + cols[:, None] * stride_d + (block // 8)[None, :], mask=mask, other=0.0)
            d = d.to(tl.float32) * sc
            m = -(m.to(tl.float32) * mn)
        else:
            d = tl.load(d_ptr + cols[:, None] * stride_d + block[None, :], mask=mask, other=0.0).to(tl.float32)
            m = tl.load(m_ptr + cols[:, None] * stride_d + block[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum((d * q + m) * x[None, :], axis=1)
    tl.store(out_ptr + row * stride_out + cols, acc, mask=col_mask)


def quant_linear(x: torch.Tensor, weight: TritonQuant) -> torch.Tensor:
    """x [M, in] fp32 -> [M, out] fp32: x @ the blocks' values, transposed."""
    check_tensor("x", x, ndim=2, dtypes=(torch.float32,), device=weight.d.device, last_dim_contiguous=True)
    if x.shape[1] != weight.in_features:
        raise ValueError(f"x has {x.shape[1]} features but the weight expects {weight.in_features}")
    check_launchable(x.device)
    num_rows, n = x.shape[0], weight.out_features
    out = torch.empty(num_rows, n, dtype=torch.float32, device=x.device)
    if num_rows:
        k_quant = weight.sc is not None and not weight.six_bit
        sc = weight.sc if weight.sc is not None else weight.qs  # not read unless K_QUANT / SIX_BIT
        mn = weight.mn if weight.mn is not None else weight.qs
        _quant_gemv_kernel[(num_rows, triton.cdiv(n, BLOCK_N))](
            x, weight.qs, weight.d, weight.m, sc, mn, out, n, weight.in_features, x.stride(0),
            weight.qs.stride(0), weight.d.stride(0), sc.stride(0), out.stride(0),
            FOUR_BIT=weight.four_bit, K_QUANT=k_quant, SIX_BIT=weight.six_bit, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out

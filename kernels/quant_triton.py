"""Dequantize-in-kernel GEMV/GEMM in Triton for GGUF blocks (Q8_0 and 4-bit, see kernels.quant).

    handle = pack(rows, device)        # QuantRows -> TritonQuant: quants, scales, offsets on device
    y = quant_linear(x, handle)        # x [M, in] fp32 -> [M, out] fp32

``pack`` splits the blocks once into three plain tensors (no value changes): ``qs`` the quant
bytes [out, in / 32 * bytes per block's quants] as stored (4-bit: byte i of a block holds
input i low and input i + 16 high; Q8_0: one int8 per input), ``d`` and ``m`` the per-block
fp16 scale and offset [out, in / 32] (m = 0 for Q8_0, -8 d for Q4_0). Each program computes
BLOCK_N outputs of one row of x, streaming BLOCK_K inputs at a time: it loads the quant bytes,
unpacks and scales them in registers, and accumulates x * w in fp32. Weights stay 4/8-bit in
memory; that is the point on a GPU, where decode is bound by the bytes read. Tested on CPU
under ``TRITON_INTERPRET=1`` (small shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels._checks import check_tensor
from kernels._triton import check_launchable, tl, triton
from kernels.quant import BLOCK, QuantRows, to_q4_1

BLOCK_N, BLOCK_K = 16, 64


@dataclass(frozen=True, slots=True)
class TritonQuant:
    qs: torch.Tensor  # uint8 [out, in / 2] (4-bit) or int8 [out, in] (Q8_0)
    d: torch.Tensor  # fp16 [out, in / 32]
    m: torch.Tensor  # fp16 [out, in / 32]
    four_bit: bool

    @property
    def out_features(self) -> int:
        return self.d.shape[0]

    @property
    def in_features(self) -> int:
        return self.d.shape[1] * BLOCK


def pack(rows: QuantRows, device: torch.device | str = "cpu") -> TritonQuant:
    """Split ``rows`` into quants, scales and offsets on ``device``."""
    four_bit = rows.format != "q8_0"
    if four_bit:
        rows = to_q4_1(rows)
    blocks = np.array(rows.blocks())  # a copy: the file map is read-only
    n, nb, _ = blocks.shape
    d = torch.from_numpy(blocks[:, :, :2].copy()).view(torch.float16).reshape(n, nb)
    if four_bit:
        m = torch.from_numpy(blocks[:, :, 2:4].copy()).view(torch.float16).reshape(n, nb)
        qs = torch.from_numpy(blocks[:, :, 4:].reshape(n, nb * 16).copy())
    else:
        m = torch.zeros(n, nb, dtype=torch.float16)
        qs = torch.from_numpy(blocks[:, :, 2:].reshape(n, nb * 32).copy()).view(torch.int8)
    return TritonQuant(qs.to(device), d.to(device), m.to(device), four_bit)


@triton.jit
def _quant_gemv_kernel(x_ptr, qs_ptr, d_ptr, m_ptr, out_ptr, N, K, stride_x, stride_qs, stride_d,
                       stride_out, FOUR_BIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
        _quant_gemv_kernel[(num_rows, triton.cdiv(n, BLOCK_N))](
            x, weight.qs, weight.d, weight.m, out, n, weight.in_features, x.stride(0),
            weight.qs.stride(0), weight.d.stride(0), out.stride(0),
            FOUR_BIT=weight.four_bit, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out

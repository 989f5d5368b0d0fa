"""Weights in GGUF block formats, and the pure-torch reference of the quantized linear.

A ``QuantRows`` is an ``[out, in]`` matrix (HF's Linear layout) whose rows are stored as the
GGUF file stores them: ``in / 32`` blocks of 32 values per row, each block

    q8_0  d fp16 | 32 x int8 q                  value = d * q            (34 bytes)
    q4_0  d fp16 | 16 bytes                     value = d * (q - 8)      (18 bytes)
    q4_1  d fp16 | m fp16 | 16 bytes            value = d * q + m        (20 bytes)

with 4-bit byte i holding input i in its low nibble and input i + 16 in its high one. The
kernels serve two layouts: ``q8_0``, and ``q4_1`` for every 4-bit block (``to_q4_1`` rewrites
a Q4_0 block exactly: m = -8 d). Rows can be reordered and concatenated as bytes, so fused
matmuls (q/k/v, gate/up) keep the file's blocks.

    rows = QuantRows.from_gguf("q4_1", raw_bytes, in_features)
    w = dequantize(rows)                 # fp32 [out, in], the values HF's loader produces
    handle = pack_quant_ref(rows)        # the 'torch' backend: dequantize once at load
    y = quant_linear_ref(x, handle)      # x [M, in] -> [M, out]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
FORMATS = tuple(BLOCK_BYTES)


@dataclass(frozen=True)
class QuantRows:
    """An [out, in] matrix in a block format; ``data`` is uint8 [out, in / 32 * block bytes]
    (a numpy array, possibly a read-only view of the mapped file)."""

    format: str
    data: np.ndarray
    in_features: int

    def __post_init__(self) -> None:
        if self.format not in BLOCK_BYTES:
            raise ValueError(f"format must be one of {'|'.join(FORMATS)}, got {self.format!r}")
        if self.in_features <= 0 or self.in_features % BLOCK:
            raise ValueError(f"in_features must be a positive multiple of {BLOCK}, got {self.in_features}")
        expected = self.in_features // BLOCK * BLOCK_BYTES[self.format]
        if self.data.dtype != np.uint8 or self.data.ndim != 2 or self.data.shape[1] != expected:
            raise ValueError(f"{self.format} rows of {self.in_features} inputs need uint8 data [out, {expected}], "
                             f"got {self.data.dtype} {self.data.shape}")

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])

    @property
    def num_blocks(self) -> int:
        return self.in_features // BLOCK

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def blocks(self) -> np.ndarray:
        """uint8 [out, num_blocks, block bytes]."""
        return self.data.reshape(self.out_features, self.num_blocks, BLOCK_BYTES[self.format])


def to_q4_1(rows: QuantRows) -> QuantRows:
    """A 4-bit matrix as q4_1 (Q4_0's d * (q - 8) is d * q + m with m = -8 d, exact in fp16)."""
    if rows.format == "q4_1":
        return rows
    if rows.format != "q4_0":
        raise ValueError(f"to_q4_1 takes 4-bit rows, got {rows.format}")
    blocks = rows.blocks()
    d = blocks[:, :, :2].copy().view(np.float16)
    m = (d.astype(np.float32) * -8).astype(np.float16).view(np.uint8)
    out = np.concatenate([blocks[:, :, :2], m, blocks[:, :, 2:]], axis=2)
    return QuantRows("q4_1", out.reshape(rows.out_features, -1), rows.in_features)


def cat_rows(parts: list[QuantRows]) -> QuantRows:
    """Row-wise concatenation (a fused q/k/v or gate/up); 4-bit parts become q4_1."""
    if any(p.format != "q8_0" for p in parts):
        parts = [to_q4_1(p) for p in parts]
    if len({(p.format, p.in_features) for p in parts}) != 1:
        raise ValueError(f"cannot fuse rows of {[(p.format, p.in_features) for p in parts]}")
    return QuantRows(parts[0].format, np.concatenate([p.data for p in parts]), parts[0].in_features)


def quantize(w: torch.Tensor, fmt: str) -> QuantRows:
    """fp32 [out, in] -> ``fmt`` blocks, by gguf's reference quantizer (llama.cpp's rounding)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    if w.dim() != 2:
        raise ValueError(f"quantize takes a 2-d [out, in] matrix, got shape {tuple(w.shape)}")
    qtype = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0,
             "q4_1": GGMLQuantizationType.Q4_1}[fmt]
    data = gguf_quantize(np.ascontiguousarray(w.detach().float().cpu().numpy()), qtype)
    return QuantRows(fmt, np.ascontiguousarray(data, dtype=np.uint8), int(w.shape[1]))


def random_rows(out_features: int, in_features: int, fmt: str, seed: int = 0) -> QuantRows:
    """Random blocks of weight scale ~in^-0.5 without running a quantizer (fast, for timing)."""
    rng = np.random.default_rng(seed)
    nb, size = in_features // BLOCK, BLOCK_BYTES[fmt]
    blocks = rng.integers(0, 256, (out_features, nb, size), dtype=np.uint8)
    step = (2.0 if fmt == "q8_0" else 32.0) / 127 / in_features ** 0.5
    blocks[:, :, :2] = np.full((out_features, nb, 1), step, dtype=np.float16).view(np.uint8)
    if fmt == "q4_1":
        blocks[:, :, 2:4] = np.full((out_features, nb, 1), -7.5 * step, dtype=np.float16).view(np.uint8)
    return QuantRows(fmt, blocks.reshape(out_features, -1), in_features)


def dequantize(rows: QuantRows) -> torch.Tensor:
    """fp32 [out, in]: exactly the values of the stored blocks (d * q [+ m] in fp32)."""
    blocks = torch.from_numpy(np.array(rows.blocks()))  # a copy: the file map is read-only
    d = blocks[:, :, :2].contiguous().view(torch.float16).float()
    if rows.format == "q8_0":
        q = blocks[:, :, 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(rows.out_features, rows.in_features)
    qs = blocks[:, :, -16:].to(torch.int32)
    q = torch.cat([qs & 15, qs >> 4], dim=2).float()
    if rows.format == "q4_0":
        return (d * (q - 8)).reshape(rows.out_features, rows.in_features)
    m = blocks[:, :, 2:4].contiguous().view(torch.float16).float()
    return (d * q + m).reshape(rows.out_features, rows.in_features)


def pack_quant_ref(rows: QuantRows) -> torch.Tensor:
    """The reference's handle: the dequantized weight transposed, [in, out] contiguous."""
    return dequantize(rows).t().contiguous()


def quant_linear_ref(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """x [M, in] @ the dequantized weight: dequantize-then-matmul, the kernels' oracle."""
    from kernels.linear import linear_ref

    return linear_ref(x, w_t.to(x.device))


def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, in] fp32 -> (xq int8 [M, in], dx fp32 [M, in / 32]): per block of 32 inputs
    dx = max|x| / 127 and xq = round(x * (127 / max|x|)) (ties to even; 0 for an all-zero
    block), all in fp32: bit for bit what the compiled kernel computes (llama.cpp's Q8 rounding).
    Each input is off by at most dx / 2 = max|x| / 254: ``|x - dx * xq| <= dx / 2``."""
    if x.dim() != 2 or x.shape[1] % BLOCK:
        raise ValueError(f"x must be [M, in] with in a multiple of {BLOCK}, got {tuple(x.shape)}")
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    amax = blocks.abs().amax(dim=2)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    xq = (blocks * inv[:, :, None]).round().to(torch.int8).reshape(x.shape)
    return xq, amax / 127.0


def quant_linear_int8_ref(x: torch.Tensor, rows: QuantRows) -> torch.Tensor:
    """The compiled kernel's arithmetic in float64: x [M, in] quantized per block
    (``quantize_activations_ref``) times the blocks' d * q, plus each block's offset m (4-bit)
    times the exact sum of x over the block. -> [M, out] float64."""
    xq, dx = quantize_activations_ref(x)
    m_rows, nb = x.shape[0], rows.num_blocks
    x_hat = (xq.double().reshape(m_rows, nb, BLOCK) * dx.double()[:, :, None]).reshape(x.shape)
    if rows.format == "q8_0":
        return x_hat @ dequantize(rows).double().t()
    fused = to_q4_1(rows).blocks()
    m = torch.from_numpy(np.array(fused[:, :, 2:4])).view(torch.float16).double().reshape(rows.out_features, nb)
    scaled = dequantize(rows).double() - m.repeat_interleave(BLOCK, dim=1)  # d * q per input
    xsum = x.double().reshape(m_rows, nb, BLOCK).sum(dim=2)
    return x_hat @ scaled.t() + xsum @ m.t()

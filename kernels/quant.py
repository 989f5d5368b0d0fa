"""Weights in GGUF block formats, and the pure-torch reference of the quantized linear.

A ``QuantRows`` is an ``[out, in]`` matrix (HF's Linear layout) whose rows are stored as the
GGUF file stores them: blocks of 32 values per row (256 for the K-quants), each block

    q8_0  d fp16 | 32 x int8 q                  value = d * q            (34 bytes)
    q4_0  d fp16 | 16 bytes                     value = d * (q - 8)      (18 bytes)
    q4_1  d fp16 | m fp16 | 16 bytes            value = d * q + m        (20 bytes)
    q5_0  d fp16 | qh u32 | 16 bytes            value = d * (q - 16)     (22 bytes)
    q5_1  d fp16 | m fp16 | qh u32 | 16 bytes   value = d * q + m        (24 bytes)
    q4_k  d fp16 | dmin fp16 | 12 bytes of 6-bit scales sc[8] and mins mn[8] | 128 bytes
          (256 values, 8 sub-blocks of 32)      value = d * sc[j] * q - dmin * mn[j]   (144 bytes)
    q6_k  128 bytes of low 4 bits | 64 bytes of high 2 bits | int8 sc[16] | d fp16
          (256 values, 16 sub-blocks of 16)     value = d * sc[j] * (q - 32)   (210 bytes)

with 4-bit byte i holding input i in its low nibble and input i + 16 in its high one (q5: bit i
of qh is input i's fifth bit; q4_k, q6_k: llama.cpp's orders, ``q4_k_codes`` / ``q6_k_codes``).
The kernels serve five layouts: ``q8_0``, ``q4_1`` for Q4_0/Q4_1 blocks (``to_offset_form``
rewrites a Q4_0 block exactly: m = -8 d), ``q5_1`` for Q5_0/Q5_1 (m = -16 d), ``q4_k`` and
``q6_k``. Rows can be reordered and concatenated as bytes, so fused matmuls (q/k/v, gate/up)
keep the file's blocks.

    rows = QuantRows.from_gguf("q4_1", raw_bytes, in_features)
    w = dequantize(rows)                 # fp32 [out, in], the values HF's loader produces
    handle = pack_quant_ref(rows)        # the 'torch' backend: dequantize once at load
    y = quant_linear_ref(x, handle)      # x [M, in] -> [M, out]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32  # inputs per block of x the kernels quantize, and per (sub-)block of every format
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q4_k": 144, "q6_k": 210}
BLOCK_VALUES = {**dict.fromkeys(BLOCK_BYTES, BLOCK), "q4_k": 256, "q6_k": 256}  # inputs per block
# the formats without an offset, and their offset form: d * (q - c) = d * q + m with m = -c d
# (exact in fp16: c is a power of two)
_OFFSET_FORMS = {"q4_0": ("q4_1", 8), "q5_0": ("q5_1", 16)}
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
        values = BLOCK_VALUES[self.format]
        if self.in_features <= 0 or self.in_features % values:
            raise ValueError(f"{self.format} needs in_features a positive multiple of {values}, "
                             f"got {self.in_features}")
        expected = self.in_features // values * BLOCK_BYTES[self.format]
        if self.data.dtype != np.uint8 or self.data.ndim != 2 or self.data.shape[1] != expected:
            raise ValueError(f"{self.format} rows of {self.in_features} inputs need uint8 data [out, {expected}], "
                             f"got {self.data.dtype} {self.data.shape}")

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])

    @property
    def num_blocks(self) -> int:
        return self.in_features // BLOCK_VALUES[self.format]

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def blocks(self) -> np.ndarray:
        """uint8 [out, num_blocks, block bytes]."""
        return self.data.reshape(self.out_features, self.num_blocks, BLOCK_BYTES[self.format])


def to_offset_form(rows: QuantRows) -> QuantRows:
    """Q4_0 rows as q4_1 and Q5_0 as q5_1 (d * (q - c) is d * q + m with m = -c d, exact in
    fp16); other rows as they are."""
    if rows.format not in _OFFSET_FORMS:
        return rows
    target, c = _OFFSET_FORMS[rows.format]
    blocks = rows.blocks()
    d = blocks[:, :, :2].copy().view(np.float16)
    m = (d.astype(np.float32) * -c).astype(np.float16).view(np.uint8)
    out = np.concatenate([blocks[:, :, :2], m, blocks[:, :, 2:]], axis=2)
    return QuantRows(target, out.reshape(rows.out_features, -1), rows.in_features)


def kernel_format(fmt: str) -> str:
    """The layout the kernels serve ``fmt`` in: q4_0 as q4_1, q5_0 as q5_1, the others as they are."""
    return _OFFSET_FORMS[fmt][0] if fmt in _OFFSET_FORMS else fmt


def cat_rows(parts: list[QuantRows]) -> QuantRows:
    """Row-wise concatenation (a fused q/k/v or gate/up); Q4_0/Q5_0 parts become q4_1/q5_1.
    ValueError for parts of different kernel formats or input sizes."""
    parts = [to_offset_form(p) for p in parts]
    if len({(p.format, p.in_features) for p in parts}) != 1:
        raise ValueError(f"cannot fuse rows of {[(p.format, p.in_features) for p in parts]}")
    return QuantRows(parts[0].format, np.concatenate([p.data for p in parts]), parts[0].in_features)


def quantize(w: torch.Tensor, fmt: str) -> QuantRows:
    """fp32 [out, in] -> ``fmt`` blocks, by gguf's reference quantizer (llama.cpp's rounding);
    q4_k and q6_k (which gguf cannot quantize) by ``quantize_q4_k`` / ``quantize_q6_k``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    if w.dim() != 2:
        raise ValueError(f"quantize takes a 2-d [out, in] matrix, got shape {tuple(w.shape)}")
    if fmt == "q4_k":
        return quantize_q4_k(w)
    if fmt == "q6_k":
        return quantize_q6_k(w)
    qtype = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0,
             "q4_1": GGMLQuantizationType.Q4_1, "q5_0": GGMLQuantizationType.Q5_0,
             "q5_1": GGMLQuantizationType.Q5_1}[fmt]
    data = gguf_quantize(np.ascontiguousarray(w.detach().float().cpu().numpy()), qtype)
    return QuantRows(fmt, np.ascontiguousarray(data, dtype=np.uint8), int(w.shape[1]))


def quantize_q4_k(w: torch.Tensor) -> QuantRows:
    """fp32 [out, in] (in a multiple of 256) -> Q4_K blocks by plain rounding: per sub-block of
    32 the range [min(0, lo), hi] in 15 steps, the 8 steps and mins of a super-block in 6 bits
    against its d and dmin. Valid blocks for tests and benchmarks (llama.cpp searches each
    sub-block's scale and min for a smaller error; files quantized by it load as they are)."""
    if w.dim() != 2 or w.shape[1] % 256:
        raise ValueError(f"q4_k takes [out, in] with in a multiple of 256, got shape {tuple(w.shape)}")
    n, k = w.shape
    x = w.detach().double().cpu().numpy().reshape(n, k // 256, 8, BLOCK)
    lo, hi = np.minimum(x.min(axis=3), 0.0), x.max(axis=3)
    step = np.maximum(hi - lo, 1e-30) / 15  # [n, nb, 8]
    d = (step.max(axis=2, keepdims=True) / 63).astype(np.float16)
    dmin = ((-lo).max(axis=2, keepdims=True) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float64), dmin.astype(np.float64)
    sc = np.clip(np.round(step / np.where(d32 > 0, d32, 1)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / np.where(dmin32 > 0, dmin32, 1)), 0, 63).astype(np.uint8)
    scale, offset = d32 * sc, dmin32 * mn
    q = np.clip(np.round((x + offset[..., None]) / np.where(scale > 0, scale, 1)[..., None]), 0, 15).astype(np.uint8)
    scales = np.empty((n, k // 256, 12), dtype=np.uint8)  # q4_k_scales' inverse
    scales[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    scales[..., 4:8] = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    chunks = q.reshape(n, k // 256, 4, 2, BLOCK)  # chunk c: sub-block 2c low nibbles, 2c + 1 high
    qs = (chunks[:, :, :, 0] | (chunks[:, :, :, 1] << 4)).reshape(n, k // 256, 128)
    blocks = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), scales, qs], axis=2)
    return QuantRows("q4_k", blocks.reshape(n, -1), k)


def quantize_q6_k(w: torch.Tensor) -> QuantRows:
    """fp32 [out, in] (in a multiple of 256) -> Q6_K blocks by plain rounding: per sub-block of
    16 a step of max|x| / 31, the 16 steps of a super-block in int8 against its d. Valid blocks
    for tests and benchmarks, as ``quantize_q4_k``."""
    if w.dim() != 2 or w.shape[1] % 256:
        raise ValueError(f"q6_k takes [out, in] with in a multiple of 256, got shape {tuple(w.shape)}")
    n, k = w.shape
    x = w.detach().double().cpu().numpy().reshape(n, k // 256, 16, 16)
    step = np.abs(x).max(axis=3) / 31  # [n, nb, 16]
    d = (step.max(axis=2, keepdims=True) / 127).astype(np.float16)
    d64 = d.astype(np.float64)
    sc = np.clip(np.round(step / np.where(d64 > 0, d64, 1)), -128, 127).astype(np.int8)
    scale = (d64 * sc)[..., None]
    q = (np.clip(np.round(x / np.where(scale != 0, scale, 1)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(n, k // 256, 2, 4, 32)  # value 128 h + 32 c + l: [half h, c, l]
    ql = np.concatenate([(q[:, :, :, 0] & 15) | ((q[:, :, :, 2] & 15) << 4),
                         (q[:, :, :, 1] & 15) | ((q[:, :, :, 3] & 15) << 4)], axis=3)  # [n, nb, 2, 64]
    qh = (q[:, :, :, 0] >> 4) | ((q[:, :, :, 1] >> 4) << 2) | ((q[:, :, :, 2] >> 4) << 4) | ((q[:, :, :, 3] >> 4) << 6)
    blocks = np.concatenate([ql.reshape(n, k // 256, 128), qh.reshape(n, k // 256, 64),
                             sc.view(np.uint8), d.view(np.uint8)], axis=2)
    return QuantRows("q6_k", blocks.reshape(n, -1), k)


def random_rows(out_features: int, in_features: int, fmt: str, seed: int = 0) -> QuantRows:
    """Random blocks of weight scale ~in^-0.5 without running a quantizer (fast, for timing)."""
    rng = np.random.default_rng(seed)
    nb, size = in_features // BLOCK_VALUES[fmt], BLOCK_BYTES[fmt]
    blocks = rng.integers(0, 256, (out_features, nb, size), dtype=np.uint8)
    step = (2.0 if fmt == "q8_0" else 32.0) / 127 / in_features ** 0.5
    if fmt == "q6_k":  # d per super-block at the end; random int8 scales and 6-bit codes
        blocks[:, :, 208:210] = np.full((out_features, nb, 1), step / 1024, dtype=np.float16).view(np.uint8)
        return QuantRows(fmt, blocks.reshape(out_features, -1), in_features)
    if fmt == "q4_k":  # d, dmin per super-block; the random 6-bit scales and mins are 0..63
        blocks[:, :, :2] = np.full((out_features, nb, 1), step / 32, dtype=np.float16).view(np.uint8)
        blocks[:, :, 2:4] = np.full((out_features, nb, 1), 7.5 * step / 32, dtype=np.float16).view(np.uint8)
        return QuantRows(fmt, blocks.reshape(out_features, -1), in_features)
    blocks[:, :, :2] = np.full((out_features, nb, 1), step, dtype=np.float16).view(np.uint8)
    if fmt in ("q4_1", "q5_1"):
        blocks[:, :, 2:4] = np.full((out_features, nb, 1), -7.5 * step, dtype=np.float16).view(np.uint8)
    return QuantRows(fmt, blocks.reshape(out_features, -1), in_features)


def dequantize(rows: QuantRows) -> torch.Tensor:
    """fp32 [out, in]: exactly the values of the stored blocks (d * q [+ m] in fp32)."""
    if rows.format == "q4_k":
        d, offsets, q = q4_k_parts(rows)
        return (d.repeat_interleave(BLOCK, dim=1) * q + offsets.repeat_interleave(BLOCK, dim=1)).float()
    if rows.format == "q6_k":
        scale, codes = q6_k_parts(rows)
        return (scale.repeat_interleave(16, dim=1) * codes).float()
    blocks = torch.from_numpy(np.array(rows.blocks()))  # a copy: the file map is read-only
    d = blocks[:, :, :2].contiguous().view(torch.float16).float()
    if rows.format == "q8_0":
        q = blocks[:, :, 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(rows.out_features, rows.in_features)
    q = block_codes(rows).float()
    if rows.format in _OFFSET_FORMS:
        return (d * (q - _OFFSET_FORMS[rows.format][1])).reshape(rows.out_features, rows.in_features)
    m = blocks[:, :, 2:4].contiguous().view(torch.float16).float()
    return (d * q + m).reshape(rows.out_features, rows.in_features)


def block_codes(rows: QuantRows) -> torch.Tensor:
    """The unsigned codes q of 4- and 5-bit rows (q4_0/q4_1/q5_0/q5_1): int32 [out, nb, 32],
    inputs in order (byte i of the 16 quant bytes: input i low, i + 16 high; q5: bit i of the
    little-endian qh before them is input i's fifth bit)."""
    blocks = torch.from_numpy(np.array(rows.blocks()))
    qs = blocks[:, :, -16:].to(torch.int32)
    q = torch.cat([qs & 15, qs >> 4], dim=2)
    if rows.format in ("q5_0", "q5_1"):
        qh = blocks[:, :, -20:-16].contiguous().view(torch.int32)
        q = q | (((qh >> torch.arange(BLOCK, dtype=torch.int32)) & 1) << 4)
    return q


def q4_k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_K block's 12 scale bytes [..., 12] -> (sc, mn) uint8 [..., 8], llama.cpp's
    get_scale_min_k4: sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7; 4-7 split between
    the low (sc) / high (mn) nibbles of bytes 8-11 and the top 2 bits of bytes 0-3 / 4-7."""
    sc = np.empty((*scales.shape[:-1], 8), dtype=np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = scales[..., 0:4] & 63
    mn[..., :4] = scales[..., 4:8] & 63
    sc[..., 4:] = (scales[..., 8:12] & 15) | ((scales[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (scales[..., 8:12] >> 4) | ((scales[..., 4:8] >> 6) << 4)
    return sc, mn


def q4_k_codes(blocks: np.ndarray) -> np.ndarray:
    """Q4_K blocks [..., 144] -> the 4-bit codes uint8 [..., 256], inputs in order (4 chunks of
    64 inputs, each 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high ones)."""
    chunks = blocks[..., 16:].reshape(*blocks.shape[:-1], 4, 1, 32)
    return np.concatenate([chunks & 15, chunks >> 4], axis=-2).reshape(*blocks.shape[:-1], 256)


def q6_k_codes(blocks: np.ndarray) -> np.ndarray:
    """Q6_K blocks [..., 210] -> the 6-bit codes q (0..63, the value's q - 32) uint8 [..., 256],
    inputs in order (llama.cpp's dequantize_row_q6_K: value 128 h + 32 c + l takes the low
    nibble of ql[64 h + l + 32 (c % 2)] (the high one for c >= 2) and bits 2c, 2c + 1 of
    qh[32 h + l])."""
    lead = blocks.shape[:-1]
    ql = blocks[..., 0:128].reshape(*lead, 2, 2, 32)  # [half, c % 2, l]
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)
    low = np.concatenate([ql & 15, ql >> 4], axis=-2)  # [half, c, l], c = 0..3
    high = (qh >> (2 * np.arange(4, dtype=np.uint8).reshape(4, 1))) & 3
    codes: np.ndarray = (low | (high << 4)).reshape(*lead, 256)
    return codes


def nibble_pairs(codes: np.ndarray) -> np.ndarray:
    """4-bit codes uint8 [..., 32 k] -> the 4-bit layout [..., 16 k]: per 32 inputs, byte i holds
    input i in its low nibble and input 16 + i in its high one (the file's Q4_0/Q4_1 order)."""
    blocks = codes.reshape(*codes.shape[:-1], -1, 2, 16)
    pairs: np.ndarray = (blocks[..., 0, :] | (blocks[..., 1, :] << 4)).reshape(*codes.shape[:-1], -1)
    return pairs


def q4_k_parts(rows: QuantRows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K rows as 32-input sub-blocks: (scale d * sc, offset -dmin * mn) float64 [out, in / 32]
    (both exact: fp16 times a 6-bit integer) and the 4-bit codes q float64 [out, in], inputs
    in order; a value is scale * q + offset."""
    blocks = np.array(rows.blocks())  # [out, nb, 144]
    n = blocks.shape[0]
    d = blocks[:, :, 0:2].copy().view(np.float16).astype(np.float64)  # [out, nb, 1]
    dmin = blocks[:, :, 2:4].copy().view(np.float16).astype(np.float64)
    sc, mn = q4_k_scales(blocks[:, :, 4:16])
    q = q4_k_codes(blocks).reshape(n, rows.in_features)
    scale = (d * sc).reshape(n, -1)
    offset = -(dmin * mn).reshape(n, -1)
    return torch.from_numpy(scale), torch.from_numpy(offset), torch.from_numpy(q.astype(np.float64))


def q6_k_parts(rows: QuantRows) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K rows as 16-input sub-blocks: the scale d * sc float64 [out, in / 16] and the codes
    q - 32 float64 [out, in], inputs in order (``q6_k_codes``); a value is scale * code, exact
    in fp32."""
    blocks = np.array(rows.blocks())  # [out, nb, 210]
    n = blocks.shape[0]
    codes = q6_k_codes(blocks).astype(np.float64).reshape(n, rows.in_features) - 32
    sc = blocks[:, :, 192:208].copy().view(np.int8).astype(np.float64)  # [out, nb, 16]
    d = blocks[:, :, 208:210].copy().view(np.float16).astype(np.float64)
    return torch.from_numpy((d * sc).reshape(n, -1)), torch.from_numpy(codes)


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
    (``quantize_activations_ref``) times the blocks' d * q, plus each (sub-)block's offset m
    (4-bit) times the exact sum of x over the block. -> [M, out] float64."""
    xq, dx = quantize_activations_ref(x)
    m_rows, nb = x.shape[0], rows.in_features // BLOCK
    x_hat = (xq.double().reshape(m_rows, nb, BLOCK) * dx.double()[:, :, None]).reshape(x.shape)
    if rows.format in ("q8_0", "q6_k"):  # no offsets
        return x_hat @ dequantize(rows).double().t()
    if rows.format == "q4_k":
        scale, m, q = q4_k_parts(rows)
        scaled = scale.repeat_interleave(BLOCK, dim=1) * q
    else:
        fused = to_offset_form(rows).blocks()
        m = torch.from_numpy(np.array(fused[:, :, 2:4])).view(torch.float16).double().reshape(rows.out_features, -1)
        scaled = dequantize(rows).double() - m.repeat_interleave(BLOCK, dim=1)  # d * q per input
    xsum = x.double().reshape(m_rows, nb, BLOCK).sum(dim=2)
    return x_hat @ scaled.t() + xsum @ m.t()

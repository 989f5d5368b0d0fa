"""Rotary position embedding, rotate-half (NeoX / HF Llama) style, applied in place to q and k.

For each head vector x = [x1 | x2] (halves of head_dim) at position p:
    x1' = x1 * cos(p * f) - x2 * sin(p * f)
    x2' = x2 * cos(p * f) + x1 * sin(p * f)
The frequencies f live in ``cos_sin_cache: [max_pos, head_dim]`` = [cos | sin], fp32.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from kernels._checks import FLOAT_DTYPES, check_tensor
from kernels._triton import check_launchable, tl, triton


class RopeScaling(Protocol):
    """The fields read here (``engine.config.RopeScaling`` has them; kernels import nothing
    from the engine)."""

    @property
    def kind(self) -> str: ...  # 'none', 'linear' or 'llama3'
    @property
    def factor(self) -> float: ...
    @property
    def low_freq_factor(self) -> float: ...
    @property
    def high_freq_factor(self) -> float: ...
    @property
    def original_max_position_embeddings(self) -> int: ...


def build_cos_sin_cache(head_dim: int, max_pos: int, base: float,
                        rope_scaling: RopeScaling | None = None) -> torch.Tensor:
    """[max_pos, head_dim] fp32 = [cos | sin] of position * inv_freq, as HF computes them.

    rope_scaling.kind: 'none'; 'linear' (positions divided by factor); 'llama3' (long wavelengths
    divided by factor, short ones kept, a smooth blend between; HF ``_compute_llama3_parameters``).
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    if max_pos <= 0:
        raise ValueError(f"max_pos must be positive, got {max_pos}")
    kind = "none" if rope_scaling is None else rope_scaling.kind
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    positions = torch.arange(max_pos, dtype=torch.int64).float()
    if kind == "linear" and rope_scaling is not None:  # always set here: kind is "none" without it
        positions = positions / rope_scaling.factor
    elif kind == "llama3" and rope_scaling is not None:
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
    elif kind != "none":
        raise ValueError(f"rope_scaling.kind must be 'none', 'linear' or 'llama3', got {kind!r}")
    freqs = torch.outer(positions, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def check_rotary_args(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor) -> None:
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_tokens, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"q must have an even head_dim, got shape {tuple(q.shape)}")
    check_tensor("k", k, shape=(num_tokens, None, head_dim), dtypes=(q.dtype,), device=q.device,
                 last_dim_contiguous=True)
    check_tensor("positions", positions, shape=(num_tokens,), dtypes=(torch.int64, torch.int32),
                 device=q.device)
    check_tensor("cos_sin_cache", cos_sin_cache, shape=(None, head_dim), dtypes=(torch.float32,),
                 device=q.device)
    if not cos_sin_cache.is_contiguous():
        raise ValueError(f"cos_sin_cache must be contiguous, got strides {cos_sin_cache.stride()}")


def rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> None:
    """q: [N, num_heads, head_dim], k: [N, num_kv_heads, head_dim] (views allowed), positions: [N].
    Rotates q and k in place; math in fp32."""
    check_rotary_args(q, k, positions, cos_sin_cache)
    half = q.shape[-1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions.long()).unsqueeze(1)  # [N, 1, head_dim]
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]
    for x in (q, k):
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))


@triton.jit
def token_cos_sin(positions_ptr, cos_sin_ptr, token, half, stride_cache,  # type: ignore[no-untyped-def]  # JIT
                  BLOCK_HALF: tl.constexpr):
    """The cos and sin halves [1, BLOCK_HALF] of ``token``'s position (masked past ``half``)."""
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cs_mask = dims < half
    cos = tl.load(cos_sin_ptr + pos * stride_cache + dims, mask=cs_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cache + half + dims, mask=cs_mask, other=0.0)
    return cos, sin


@triton.jit
def rotate_heads(  # type: ignore[no-untyped-def]  # JIT kernel (kernels/_triton.py)
    x_ptr, stride_h, num_heads, cos, sin, half, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < half)
    ptr1 = x_ptr + heads * stride_h + dims
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr1 + half, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(  # type: ignore[no-untyped-def]  # JIT kernel (kernels/_triton.py)
    q_ptr, k_ptr, positions_ptr, cos_sin_ptr,
    num_heads, num_kv_heads, half,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # One program per token: all its q heads and k heads share one cos/sin row.
    token = tl.program_id(0).to(tl.int64)
    cos, sin = token_cos_sin(positions_ptr, cos_sin_ptr, token, half, stride_cache, BLOCK_HALF)
    rotate_heads(q_ptr + token * stride_qt, stride_qh, num_heads, cos, sin, half, BLOCK_HQ, BLOCK_HALF)
    rotate_heads(k_ptr + token * stride_kt, stride_kh, num_kv_heads, cos, sin, half, BLOCK_HK,
                  BLOCK_HALF)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
           cos_sin_cache: torch.Tensor) -> None:
    """Triton version of :func:`rotary_ref` (same contract, in place)."""
    check_rotary_args(q, k, positions, cos_sin_cache)
    check_launchable(q.device)
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache,
        num_heads, k.shape[1], head_dim // 2,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        BLOCK_HQ=triton.next_power_of_2(num_heads), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
    )

"""Compiled CPU versions of the small per-layer ops (``csrc/elementwise.cpp``), fp32 only.

Same signatures, return conventions and semantics as the torch references:

    rms_norm(x, weight, eps, residual=None)            -> out | (out, residual_out)   kernels.rms_norm
    rotary(q, k, positions, cos_sin_cache)             in place                       kernels.rotary
    store_kv(key, value, key_cache, value_cache, slot_mapping)   in place             kernels.store_kv
    silu_and_mul(x)                                    -> [N, I]                      kernels.activation
    row_argmax(logits)                                 -> [int] | None    engine.sampling.sampler.argmax_rows

A batch-1 decode step calls these ~150 times, so each wrapper is one call into the C++ op, which
checks its arguments itself: a bad one raises ValueError naming it (fp16/bf16 included: this path
is fp32 only), before anything is written. A position outside cos_sin_cache or a slot outside the
cache is a ValueError too (the references raise IndexError). Importing this module builds the
library once per machine and raises ``kernels.cpu.CpuKernelsUnavailable`` if it cannot.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.cpu import library

_ops = library("elementwise")
# The resolved overloads: calling them skips the overload-packet lookup on every call.
_rms_norm: Callable[..., torch.Tensor] = _ops.rms_norm.default
_rms_norm_residual: Callable[..., tuple[torch.Tensor, torch.Tensor]] = _ops.rms_norm_residual.default
_rotary: Callable[..., None] = _ops.rotary.default
_store_kv: Callable[..., None] = _ops.store_kv.default
_silu_and_mul: Callable[..., torch.Tensor] = _ops.silu_and_mul.default
_row_argmax: Callable[..., list[int]] = _ops.row_argmax.default


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [N, H], weight: [H]. Returns out, or (out, residual_out = x + residual) when residual is
    given; new contiguous tensors, inputs untouched."""
    if residual is None:
        return _rms_norm(x, weight, eps)
    return _rms_norm_residual(x, weight, eps, residual)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
           cos_sin_cache: torch.Tensor) -> None:
    """q: [N, num_heads, head_dim], k: [N, num_kv_heads, head_dim] (views allowed), positions: [N]
    int64|int32, cos_sin_cache: [max_pos, head_dim] = [cos | sin]. Rotates q and k in place."""
    _rotary(q, k, positions, cos_sin_cache)


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value: [N, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads,
    head_dim] strided views (``layer_kv``); slot_mapping: [N] int64|int32, < 0 = skip. In place."""
    _store_kv(key, value, key_cache, value_cache, slot_mapping)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [N, 2*I] (gate | up) -> silu(gate) * up: [N, I]."""
    return _silu_and_mul(x)


def row_argmax(logits: torch.Tensor) -> list[int] | None:
    """logits: [N, V] -> each row's index of its first maximum, or None when some row's maximum
    is not finite (a NaN, or +-inf): what ``torch.max(logits, -1)`` gives for finite maxima, in
    one pass of one thread over rows the LM head just wrote."""
    indices: list[int] = _row_argmax(logits)
    return None if -1 in indices else indices

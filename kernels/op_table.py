"""The op table (``Ops``, one callable per op; its contract is ``kernels.ops``'s docstring) and
the two tables every backend choice is built from: ``torch_ops()``, the pure-torch references,
and ``compiled_ops()``, the compiled CPU kernels. ``kernels.ops`` picks a backend;
``kernels.calibration`` times these two against each other and mixes them by size. Both import
this module and neither imports the other's callers, so the two stay free of import cycles.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernels.linear import linear_ref, pack_linear_ref
from kernels.quant import pack_quant_ref, quant_linear_ref


@dataclass(frozen=True)
class Ops:
    rms_norm: Callable[..., Any]  # out, or (out, residual_out) when given a residual
    rotary: Callable[..., None]  # in place on q and k
    silu_and_mul: Callable[..., torch.Tensor]
    store_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    pack_linear: Callable[[torch.Tensor], Any]  # a weight only ``linear`` reads (backend's own)
    linear: Callable[[torch.Tensor, Any], torch.Tensor]
    pack_quant: Callable[..., Any] = pack_quant_ref  # default: the dequantize-then-matmul reference
    quant_linear: Callable[..., torch.Tensor] = quant_linear_ref
    norm_quant_linear: Callable[..., Any] | None = None  # fused rms_norm + quant_linear, where compiled
    norm_linear: Callable[..., Any] | None = None  # rms_norm + linear in one call, where written (Triton)
    silu_and_mul_linear: Callable[..., torch.Tensor] | None = None  # silu_and_mul + linear, likewise
    # model -> its layers in one compiled call (kernels.cpu.decoder_stack.build), or None; used for
    # steps of at most stack_max_tokens tokens (where every op of the step is the compiled one)
    decoder_stack: Callable[..., Any] | None = None
    stack_max_tokens: int = 0
    # the greedy sample [N, V] -> [int] | None, where compiled (not measured per size: one pass
    # that gives the same indices; 4.6 vs torch's 30 us at a 49k vocabulary, docs/benchmark-log.md)
    argmax_rows: Callable[[torch.Tensor], list[int] | None] | None = None
    rotary_store_kv: Callable[..., None] | None = None  # fused rotary + store_kv, where written
    # a decode step's rotary_store_kv + paged_attention in one launch, where written (Triton)
    rotary_store_attention: Callable[..., torch.Tensor] | None = None


def torch_ops() -> Ops:
    """The pure-torch references for every op: the fallback and the oracle."""
    from kernels.activation import silu_and_mul_ref
    from kernels.paged_attention_ref import paged_attention_ref
    from kernels.rms_norm import rms_norm_ref
    from kernels.rotary import rotary_ref
    from kernels.store_kv import store_kv_ref

    return Ops(rms_norm=rms_norm_ref, rotary=rotary_ref, silu_and_mul=silu_and_mul_ref,
               store_kv=store_kv_ref, paged_attention=paged_attention_ref,
               pack_linear=pack_linear_ref, linear=linear_ref)


def compiled_ops() -> Ops:
    """The compiled CPU kernels for every op (``$PDSERVE_CPU_ISA``)."""
    from kernels.cpu import elementwise
    from kernels.cpu.attention import paged_attention
    from kernels.cpu.decoder_stack import build as build_stack
    from kernels.cpu.linear import linear, pack_weight
    from kernels.quant_cpu import pack, quant_linear, rms_norm_quant_linear

    return Ops(rms_norm=elementwise.rms_norm, rotary=elementwise.rotary,
               silu_and_mul=elementwise.silu_and_mul, store_kv=elementwise.store_kv,
               paged_attention=paged_attention, pack_linear=pack_weight, linear=linear,
               pack_quant=pack, quant_linear=quant_linear, norm_quant_linear=rms_norm_quant_linear,
               decoder_stack=build_stack, stack_max_tokens=sys.maxsize, argmax_rows=elementwise.row_argmax)

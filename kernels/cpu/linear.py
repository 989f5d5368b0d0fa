"""fp32 ``x @ W`` on CPU over weights packed once at load (see csrc/linear.cpp).

    packed = pack_weight(w_t)      # w_t: [in, out], the transposed Linear weight
    y = linear(x, packed)          # x: [M, in] -> [M, out]

Packing lays the weight out in column panels [ceil(out / lanes), in, lanes] (``LANES``: the
ISA's vector width) so every call streams each weight byte once, whatever M; decode (M = 1) and
speculative verification (M = 2..8) therefore cost the same weight traffic. Bad arguments raise ValueError naming them.
Importing this module builds the library once per machine and raises
``kernels.cpu.CpuKernelsUnavailable`` if it cannot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.cpu import library

_ops = library("linear")
_linear: Callable[..., torch.Tensor] = _ops.linear.default  # the resolved overload: no lookup per call
LANES: int = _ops.linear_lanes()


@dataclass(frozen=True, slots=True)
class PackedWeight:
    panels: torch.Tensor  # [P, in_features, lanes] fp32, contiguous
    out_features: int

    @property
    def in_features(self) -> int:
        return self.panels.shape[1]


def pack_weight(w_t: torch.Tensor) -> PackedWeight:
    """[in, out] fp32 -> column panels (the last one zero-padded)."""
    if w_t.dim() != 2 or w_t.dtype != torch.float32 or w_t.device.type != "cpu":
        raise ValueError(f"w_t must be a 2-d float32 CPU tensor, got {tuple(w_t.shape)} {w_t.dtype} "
                         f"on {w_t.device}")
    k, n = w_t.shape
    num_panels = -(-n // LANES)
    padded = torch.zeros(k, num_panels * LANES, dtype=torch.float32)
    padded[:, :n] = w_t
    return PackedWeight(padded.view(k, num_panels, LANES).permute(1, 0, 2).contiguous(), n)


def linear(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """x [M, in] fp32 (stride 1 in the last dim) -> [M, out]."""
    return _linear(x, weight.panels, weight.out_features)

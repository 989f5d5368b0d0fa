"""SwiGLU gate: silu_and_mul(x) = silu(x[:, :I]) * x[:, I:] for x: [N, 2*I] -> [N, I]."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._checks import FLOAT_DTYPES, check_tensor
from kernels._triton import check_launchable, tl, triton


def _check_args(x: torch.Tensor) -> int:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    if x.shape[1] % 2:
        raise ValueError(f"x must have an even last dim [N, 2*I], got shape {tuple(x.shape)}")
    return x.shape[1] // 2


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [N, 2*I] (gate | up) -> [N, I] in x's dtype."""
    inter = _check_args(x)
    return F.silu(x[:, :inter]) * x[:, inter:]

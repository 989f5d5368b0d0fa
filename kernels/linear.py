"""The model's matmuls: ``y = x @ W`` with W given as the transposed Linear weight [in, out].

Each backend prepares a weight once at load (``pack_linear``) and multiplies with it every step
(``linear``). The reference keeps the plain [in, out] tensor: fp32 on CPU goes through numpy's
OpenBLAS (about 2x torch's CPU BLAS at one torch thread for the skinny products of decode), all
else through ``torch.matmul``. The compiled CPU backend packs the weight into column panels
(``kernels.cpu.linear``).
"""

from __future__ import annotations

import numpy as np
import torch


def pack_linear_ref(w_t: torch.Tensor) -> torch.Tensor:
    """[in, out] -> the same tensor, contiguous (the layout both BLAS paths stream fastest)."""
    return w_t.contiguous()


def linear_ref(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """x [M, in] @ w_t [in, out]; numpy shares memory with the tensors, nothing is copied."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and w_t.dtype == torch.float32:
        return torch.from_numpy(np.matmul(x.numpy(), w_t.numpy()))
    return torch.matmul(x, w_t)

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


@triton.jit
def _silu_and_mul_kernel(  # type: ignore[no-untyped-def]  # JIT kernel (kernels/_triton.py)
    x_ptr, out_ptr, inter, stride_x, stride_out, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    res = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + offs, res.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`silu_and_mul_ref` (math in fp32)."""
    inter = _check_args(x)
    check_launchable(x.device)
    out = torch.empty((x.shape[0], inter), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(max(inter, 1)))
    if out.numel():
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(inter, block))](
            x, out, inter, x.stride(0), out.stride(0), BLOCK=block)
    return out

"""RMSNorm, optionally fused with the residual add that precedes it in a Llama block.

    residual_out = x + residual                  (rounded to x's dtype: the next block's residual)
    out = residual_out / sqrt(mean(residual_out^2) + eps) * weight

Statistics are computed in fp32; outputs have x's dtype.
"""

from __future__ import annotations

import torch

from kernels._checks import FLOAT_DTYPES, check_tensor
from kernels._triton import check_launchable, tl, triton


def _check_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor("weight", weight, shape=(x.shape[1],), dtypes=FLOAT_DTYPES, device=x.device,
                 last_dim_contiguous=True)
    if residual is not None:
        check_tensor("residual", residual, shape=tuple(x.shape), dtypes=(x.dtype,), device=x.device,
                     last_dim_contiguous=True)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [N, H], weight: [H]. Returns out, or (out, residual_out) when residual is given."""
    _check_args(x, weight, residual)
    if residual is not None:
        residual_out = (x.float() + residual.float()).to(x.dtype)
        return _normalize(residual_out, weight, eps), residual_out
    return _normalize(x, weight, eps)


def _normalize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv_rms * weight.float()).to(x.dtype)


@triton.jit
def _rms_norm_kernel(  # type: ignore[no-untyped-def]  # JIT kernel (kernels/_triton.py)
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    hidden_size, eps,
    stride_x, stride_res, stride_out, stride_res_out,
    HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # One program per row; the whole row fits in one tile (BLOCK_H >= hidden_size).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < hidden_size
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_res + offs, mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_res_out + offs, s, mask=mask)
        x = s
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden_size + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (xf * inv_rms * w).to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`rms_norm_ref` (same contract; new output tensors)."""
    _check_args(x, weight, residual)
    check_launchable(x.device)
    num_rows, hidden_size = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = torch.empty_like(out) if residual is not None else out
    block_h = triton.next_power_of_2(hidden_size)
    if num_rows:
        _rms_norm_kernel[(num_rows,)](
            x, residual if residual is not None else x, weight, out, residual_out,
            hidden_size, eps,
            x.stride(0), (residual if residual is not None else x).stride(0),
            out.stride(0), residual_out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK_H=block_h,
            num_warps=4 if block_h <= 2048 else 8 if block_h <= 8192 else 16,
        )
    return (out, residual_out) if residual is not None else out

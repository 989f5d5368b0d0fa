"""Argument checks shared by every launcher (torch reference and Triton alike).

Each check raises ``ValueError`` whose message names the argument, what was expected and what
was given, so a caller can fix the call site without reading the kernel.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    shape: Iterable[int | None] | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
    last_dim_contiguous: bool = False,
) -> torch.Tensor:
    """Check one tensor argument; ``None`` entries in ``shape`` match any size."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if shape is not None:
        shape = tuple(shape)
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-d, got shape {tuple(t.shape)}")
    if shape is not None:
        for dim, (want, got) in enumerate(zip(shape, t.shape)):
            if want is not None and want != got:
                expected = tuple("*" if s is None else s for s in shape)
                raise ValueError(
                    f"{name} must have shape {expected}, got {tuple(t.shape)} (dim {dim} differs)")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            names = "|".join(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(f"{name} must have dtype {names}, got {str(t.dtype).removeprefix('torch.')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} like the other inputs, got {t.device}")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dim, got strides {t.stride()}")
    return t


def check_same_dtype(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(f"{name} must have the dtype of {ref_name} ({ref.dtype}), got {t.dtype}")

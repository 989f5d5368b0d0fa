"""Import Triton if it is installed; otherwise stand-ins so the torch references still import.

The references are the production CPU path, so ``kernels`` must import on a machine without
Triton. Launching a Triton kernel there raises a clear ``RuntimeError``.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

    class _MissingKernel:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            raise RuntimeError(f"Triton is not installed; cannot launch {self.fn.__name__}. "
                               "Install pdserve[triton] or use the 'torch' backend.")

    class triton:  # type: ignore[no-redef]
        @staticmethod
        def jit(fn=None, **_kwargs):
            return _MissingKernel(fn) if fn is not None else _MissingKernel

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(0, n - 1).bit_length()

    class tl:  # type: ignore[no-redef]
        constexpr = int


def is_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def can_launch_on(device: torch.device) -> bool:
    """True when Triton kernels can run on tensors of ``device`` here."""
    if not HAS_TRITON:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and is_interpreter()


def check_launchable(device: torch.device) -> None:
    if not can_launch_on(device):
        raise ValueError(
            f"Triton kernels need CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before "
            f"triton is imported; got tensors on {device} (use the 'torch' backend on CPU)")

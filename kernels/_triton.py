"""Import Triton if it is installed; otherwise stand-ins so the torch references still import.

The references are the production CPU path, so ``kernels`` must import on a machine without
Triton. Launching a Triton kernel there raises a clear ``RuntimeError``.

Typing: Triton ships no type information (no ``py.typed``, no stubs), so to mypy ``triton`` is
``_Triton`` below, a typed view of the part of its API that kernels/ calls, and ``tl`` is the
untyped ``triton.language`` (only JIT kernel bodies use it). A ``@triton.jit`` function's
parameters stay unannotated: Triton reads a parameter's annotation as its own type
(``tl.constexpr`` makes it a compile-time constant; a Python type would change how the kernel is
specialized), and the values are Triton tensors and pointers, which exist only in its compiler.
So each JIT def carries ``# type: ignore[no-untyped-def]``; mypy still checks its body.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, overload

import torch

__all__ = ["HAS_TRITON", "JITFunction", "can_launch_on", "check_launchable", "is_interpreter", "tl", "triton"]


class JITFunction(Protocol):
    """A ``@triton.jit`` function as kernels/ uses one: launched over a grid
    (``kernel[grid](*args, **constexprs)``), called from another JIT function's body, or handed
    to Triton's compiler with its Python function ``fn`` (``kernels.compile_check``)."""

    fn: Callable[..., object]

    def __getitem__(self, grid: tuple[int, ...], /) -> Callable[..., object]: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


if TYPE_CHECKING:
    class _Triton(Protocol):
        @overload
        def jit(self, fn: Callable[..., object], /) -> JITFunction: ...
        @overload
        def jit(self, *, do_not_specialize: Sequence[str]) -> Callable[[Callable[..., object]], JITFunction]: ...
        def cdiv(self, a: int, b: int) -> int: ...
        def next_power_of_2(self, n: int) -> int: ...

    triton: _Triton

try:
    import triton  # type: ignore[no-redef]  # mypy reads the typed view above (no types in triton)
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

    class _MissingKernel:
        def __init__(self, fn: Callable[..., object]) -> None:
            self.fn = fn

        def __getitem__(self, grid: tuple[int, ...]) -> NoReturn:
            raise RuntimeError(f"Triton is not installed; cannot launch {self.fn.__name__}. "
                               "Install pdserve[triton] or use the 'torch' backend.")

    class triton:  # type: ignore[no-redef]  # the stand-in takes the module's name on purpose
        @staticmethod
        def jit(fn: Callable[..., object] | None = None,
                **_kwargs: object) -> _MissingKernel | type[_MissingKernel]:
            return _MissingKernel(fn) if fn is not None else _MissingKernel

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(0, n - 1).bit_length()

    class tl:  # type: ignore[no-redef]  # as above: stands in for triton.language
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

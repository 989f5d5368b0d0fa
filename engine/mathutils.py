"""Integer arithmetic the whole codebase shares (torch-free: the router uses it too).

kernels/ keeps its own (``triton.cdiv`` or the shim in kernels/_triton.py): kernels import
nothing from the engine.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, ``b > 0``: e.g. the blocks that ``a`` tokens fill."""
    return -(-a // b)


def round_up(a: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` (> 0) that is at least ``a``."""
    return cdiv(a, multiple) * multiple

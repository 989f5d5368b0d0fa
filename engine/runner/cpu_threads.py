"""CPU thread policy for the fp32 CPU paths.

Two thread pools must never compete for the cores: torch's OpenMP workers spin after each op,
stealing the cores another pool is about to use (with torch and OpenBLAS both at 2 threads a
decode step took 460 ms instead of 26 ms here). So exactly one pool gets the cores:

- backend 'cpu': the compiled kernels run on torch's OpenMP pool (``at::parallel_for``), as do
  torch's own small ops; torch gets the cores and BLAS one thread.
- backend 'torch': the matmuls go through numpy's OpenBLAS (``kernels.linear.linear_ref``);
  BLAS gets the cores and torch one thread.
- backend 'triton' on a CPU (the interpreter, ``TRITON_INTERPRET=1``: tests only): each kernel
  program runs in Python on numpy tiles of a few KB; a second BLAS thread never speeds those up
  and spins beside the interpreter (the whole-model Triton test: 80 CPU-seconds in 51 s with it,
  41 in 41 s without), so both pools get one thread.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from threadpoolctl import ThreadpoolController  # type: ignore[import-untyped]  # no stubs


def default_num_threads() -> int:
    """``OMP_NUM_THREADS`` where it is set to a positive count (torch reads it too, as it loads),
    else every CPU this process may run on."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else len(os.sched_getaffinity(0))


def configure_cpu_threads(num_threads: int = 0, backend: str = "torch") -> int:
    """Give the pool that does the work for ``backend`` ``num_threads`` threads (0:
    ``default_num_threads()``) and the other pool one. Returns that thread count."""
    num_threads = 1 if backend == "triton" else num_threads or default_num_threads()
    set_pool_threads(num_threads, backend)
    return num_threads


def set_pool_threads(num_threads: int, backend: str) -> None:
    """The working pool of ``backend`` (module docstring) on ``num_threads`` threads, the other
    on one. Cheap enough to call between two steps (``core_share.CoreShare``); call it on the
    thread that runs the steps (OpenMP's thread count is that thread's own setting)."""
    compiled = backend == "cpu"
    torch.set_num_threads(num_threads if compiled else 1)
    _blas().limit(limits=1 if compiled else num_threads)  # 10 us (a new threadpool_limits: 0.5 ms)


@functools.cache
def _blas() -> Any:
    """The BLAS libraries loaded in this process (numpy's OpenBLAS), found once."""
    return ThreadpoolController().select(user_api="blas")

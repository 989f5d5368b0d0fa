"""CPU thread policy for the fp32 CPU paths.

Two thread pools must never compete for the cores: torch's OpenMP workers spin after each op,
stealing the cores another pool is about to use (with torch and OpenBLAS both at 2 threads a
decode step took 460 ms instead of 26 ms here). So exactly one pool gets the cores:

- backend 'cpu': the compiled kernels run on torch's OpenMP pool (``at::parallel_for``), as do
  torch's own small ops; torch gets the cores and BLAS one thread.
- backend 'torch': the matmuls go through numpy's OpenBLAS (``kernels.linear.linear_ref``);
  BLAS gets the cores and torch one thread.
"""

from __future__ import annotations

import os

import torch
from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]  # no stubs

_limits = None  # keeps the BLAS limit alive for the life of the process


def configure_cpu_threads(num_threads: int = 0, backend: str = "torch") -> int:
    """Give the pool that does the work for ``backend`` ``num_threads`` threads (0: the CPUs
    this process may run on) and the other pool one. Returns that thread count."""
    global _limits
    num_threads = num_threads or len(os.sched_getaffinity(0))
    compiled = backend == "cpu"
    torch.set_num_threads(num_threads if compiled else 1)
    _limits = threadpool_limits(limits=1 if compiled else num_threads, user_api="blas")
    return num_threads

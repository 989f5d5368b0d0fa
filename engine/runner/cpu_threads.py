"""CPU thread policy for the fp32 CPU path.

The matmuls go through numpy's OpenBLAS (engine.models.llama.make_matmul); everything else
(norms, RoPE, attention) is small torch ops. Both libraries keep their own thread pool, and
torch's OpenMP workers spin after each op, stealing the cores OpenBLAS is about to use: with
both pools at 2 threads a decode step took 460 ms instead of 26 ms here. So BLAS gets the
cores and torch gets one thread.
"""

from __future__ import annotations

import os

import torch
from threadpoolctl import threadpool_limits

_limits = None  # keeps the BLAS limit alive for the life of the process


def configure_cpu_threads(num_threads: int = 0) -> int:
    """Give BLAS ``num_threads`` threads (0: the CPUs this process may run on) and torch one.
    Returns the BLAS thread count."""
    global _limits
    num_threads = num_threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(1)
    _limits = threadpool_limits(limits=num_threads, user_api="blas")
    return num_threads

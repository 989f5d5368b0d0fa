# The CPU paged attention alone on the shapes below: best of 7 rounds of 10 calls.
# PYTHONPATH=. [PDSERVE_CPU_ISA=avx2] python docs/cpu/issue28-auto-default/attn_bench.py THREADS
import sys
import time

import torch

from kernels.cpu.attention import paged_attention
from tests.kernels.test_cpu_attention import make_case

torch.set_num_threads(int(sys.argv[1]))
shapes = {
    "decode 1 seq ctx 2000": ([2000], [1]),
    "decode 1 seq ctx 1100": ([1100], [1]),
    "prefix-hit 112 on 2012": ([2012], [112]),
    "decode 16 seqs ctx 700": ([700] * 16, [1] * 16),
    "chunk 512 on 1536": ([2048], [512]),
}
for name, (sl, ql) in shapes.items():
    args = make_case(sl, ql, 9, 3)
    out = torch.empty_like(args[0])
    for _ in range(3):
        paged_attention(*args, out=out)
    best = 1e9
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(10):
            paged_attention(*args, out=out)
        best = min(best, (time.perf_counter() - t) / 10)
    print(f"{name:28s} {best * 1e6:9.1f} us")

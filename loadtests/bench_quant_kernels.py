"""The compiled quantized matmul per block format (Q8_0, Q4_1, Q5_0, Q4_K, Q6_K) at batch-1 decode shapes,
against the streaming-read bandwidth measured in the same run.

    python -m loadtests.bench_quant_kernels [--shape 1536x2304] [--weights 30] [--repeats 30]

Each format multiplies one row of x by ``--weights`` distinct random weights of ``--shape``
(in x out; default: the default model's down_proj input width and 4x its hidden outputs), as a
decode step reads its layers: every weight once, so they stream from memory (or the last-level
cache, where it holds them) rather than sitting in L2. Printed per format: the bytes read, the
best time of all the matmuls, the rate in GB/s and its ratio to the streaming read (256 MB
copies, ``loadtests.bench_engine.memcpy_bandwidth``) and to Q4_1, whose kernel the other 4-bit
format shares its inner loop with. ``PDSERVE_CPU_ISA=avx2`` runs the AVX2 build.
"""

from __future__ import annotations

import argparse
import os

import torch

from kernels.cpu import cpu_identity, default_isa
from kernels.quant import random_rows
from kernels.quant_cpu import pack, quant_linear
from kernels.timing import best_seconds
from loadtests.bench_engine import memcpy_bandwidth, torch_threads

FORMATS = ("q8_0", "q4_1", "q5_0", "q4_k", "q6_k")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1536x2304", help="in x out of each weight (in: a multiple of 256)")
    parser.add_argument("--weights", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    k, n = (int(v) for v in args.shape.split("x"))
    print(f"CPU: {cpu_identity()}\nISA build {default_isa()}, torch threads {torch.get_num_threads()}, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    x = torch.randn(1, k)
    weights = {fmt: [pack(random_rows(n, k, fmt, seed=i), "int8") for i in range(args.weights)] for fmt in FORMATS}
    with torch_threads(len(os.sched_getaffinity(0))):
        read_bw = memcpy_bandwidth(256 << 20, 3)[1]
    seconds = {}
    for _ in range(2):  # interleaved rounds: drift hits every format alike
        for fmt, ws in weights.items():
            t = best_seconds(lambda ws=ws: [quant_linear(x, w) for w in ws], args.repeats, warmup=2)
            seconds[fmt] = min(seconds.get(fmt, t), t)
    print(f"{args.weights} weights of {k}x{n}, one row of x; streaming read {read_bw / 1e9:.1f} GB/s")
    print(f"{'format':<8}{'MB':>8}{'ms':>9}{'GB/s':>8}{'of read':>9}{'time vs q4_1':>14}")
    for fmt, ws in weights.items():
        nbytes = sum(w.nbytes for w in ws)
        rate = nbytes / seconds[fmt]
        print(f"{fmt:<8}{nbytes / 1e6:>8.1f}{seconds[fmt] * 1e3:>9.3f}{rate / 1e9:>8.1f}{rate / read_bw:>9.2f}"
              f"{seconds[fmt] / seconds['q4_1']:>14.2f}")


if __name__ == "__main__":
    main()

"""Measure, per CPU op and size class, the compiled kernel against torch's own op, and show
which one the engine uses on this machine (``kernels.calibration``).

    python -m loadtests.bench_kernels [--model PATH] [--threads 1,2] [--isa avx2|avx512|native]
    pdserve bench kernels ...

Each table is measured afresh and replaces the cached one, so the engines started after it use
what it printed. ``--threads`` lists the thread counts to measure: ``pdserve up`` splits the
cores between its workers, so a worker may run on fewer threads than the machine has.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded)")
    parser.add_argument("--threads", default=str(len(os.sched_getaffinity(0))),
                        help="comma-separated thread counts to calibrate (default: every CPU)")
    parser.add_argument("--isa", choices=("native", "avx2", "avx512"), default=None,
                        help="kernel ISA (default: $PDSERVE_CPU_ISA or native)")
    parser.add_argument("--cached", action="store_true",
                        help="measure only where no table is cached (the Makefile's install step)")
    args = parser.parse_args(argv)
    if args.isa:
        os.environ["PDSERVE_CPU_ISA"] = args.isa

    from engine.models.loader import load_model
    from engine.runner.model_runner import model_dims
    from kernels.calibration import calibrate, format_table

    dims = model_dims(load_model(args.model).config)
    for num_threads in (int(n) for n in args.threads.split(",")):
        torch.set_num_threads(num_threads)
        started = time.perf_counter()
        table = calibrate(dims, force=not args.cached)
        print(format_table(table))
        print(f"({time.perf_counter() - started:.1f} s; cached as {table.key})\n")


if __name__ == "__main__":
    main()

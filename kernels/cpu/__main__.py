"""``python -m kernels.cpu [ISA ...]``: build the compiled CPU kernel libraries now (the Makefile
does, once per install), so no test or worker pays for the compiler. With no argument it builds
``$PDSERVE_CPU_ISA`` (default ``native``). ``--tested`` builds what the tests run here: the native
build and, on an AVX-512 CPU, the AVX2 one too (tests/kernels/test_cpu_other_isa.py), so that
``make`` compiles it while pip installs rather than a test while other tests wait for the CPU.

The libraries compile side by side, one child process each (a library is its own build
directory; the compiler is single-threaded), as many at a time as there are CPUs; then this
process loads them all from the cache, which also reports a library that failed to build."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from kernels.cpu import build_all, default_isa, runnable_isas, sources

BUILD_ONE = "import sys; from kernels.cpu import library; library(sys.argv[1], sys.argv[2])"


def build_in_children(isa: str) -> None:
    def build(name: str) -> None:  # a failure is reported by build_all below, with the compiler's message
        subprocess.run([sys.executable, "-c", BUILD_ONE, name, isa], capture_output=True, check=False)

    with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
        list(pool.map(build, sources()))


if sys.argv[1:] == ["--tested"]:
    isas = ["native", "avx2"] if "avx512" in runnable_isas() else ["native"]
else:
    isas = sys.argv[1:] or [default_isa()]
for isa in isas:
    build_in_children(isa)
    print(f"pdserve CPU kernels built for {isa}: {', '.join(build_all(isa))}")

"""``python -m kernels.cpu [ISA ...]``: build the compiled CPU kernel libraries now (the Makefile
does, once per install), so no test or worker pays for the compiler. With no argument it builds
``$PDSERVE_CPU_ISA`` (default ``native``)."""

import sys

from kernels.cpu import build_all, default_isa

for isa in sys.argv[1:] or [default_isa()]:
    print(f"pdserve CPU kernels built for {isa}: {', '.join(build_all(isa))}")

"""``python -m kernels.cpu``: build every compiled CPU kernel library now (the Makefile does,
once per install), so no test or worker pays for the compiler."""

from kernels.cpu import build_all

print(f"pdserve CPU kernels built: {', '.join(build_all())}")

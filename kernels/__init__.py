"""Kernels, one per file: the Triton kernels next to their pure-torch references (``*_ref``),
and in ``kernels.cpu`` the compiled fp32 CPU kernels with the same contracts.

The model gets its kernels through :func:`kernels.ops.get_ops`; tests compare every Triton and CPU
kernel with its reference (Triton on CPU under ``TRITON_INTERPRET=1``). ``python -m kernels.bench``
times the Triton kernels on CUDA; ``python -m kernels.compile_check`` compiles them for sm_90
without a GPU; ``python -m kernels.cpu`` builds the CPU kernels.
"""

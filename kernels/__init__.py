"""Triton kernels, one per file, each next to its pure-torch reference (``*_ref``).

The model gets its kernels through :func:`kernels.ops.get_ops`; tests compare every Triton kernel
with its reference (on CPU under ``TRITON_INTERPRET=1``). ``python -m kernels.bench`` times them
on CUDA; ``python -m kernels.compile_check`` compiles them for sm_90 without a GPU.
"""

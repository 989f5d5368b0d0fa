"""Compiled CPU kernels: the production path for fp32 inference on CPU.

Each C++ source ``csrc/<name>.cpp`` is one small library, compiled on first use with
``torch.utils.cpp_extension`` (``-O3 -march=native -fopenmp``: built on the machine that runs
it, so it uses that machine's widest SIMD) and cached under ``$PDSERVE_CACHE_DIR`` (default
``~/.cache/pdserve``), keyed by the source's hash. Every library registers its ops into the one
``torch.ops.pdserve_cpu`` namespace with ``TORCH_LIBRARY_FRAGMENT``; loops parallelise with
``at::parallel_for`` over torch's own OpenMP pool, so one thread pool serves the kernels and
torch's small ops alike. ``csrc/vec.h`` is the shared SIMD vocabulary.

``library(name)`` builds and loads one source and returns the namespace; it raises
``CpuKernelsUnavailable`` (with the compiler's message) when that fails. ``available()`` says
whether every library builds. ``python -m kernels.cpu`` builds them all ahead of time (the
Makefile does, once per install).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

NAMESPACE = "pdserve_cpu"
CSRC = Path(__file__).parent / "csrc"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-Wall")
LDFLAGS = ("-fopenmp",)  # resolves to the libgomp torch already loaded (same soname): one pool


class CpuKernelsUnavailable(RuntimeError):
    """The compiled CPU kernels could not be built or loaded here."""


def _build_directory(source: Path) -> Path:
    root = Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")
    digest = hashlib.sha256()
    for part in (source.read_bytes(), (CSRC / "vec.h").read_bytes(),
                 " ".join(CFLAGS + LDFLAGS).encode(), torch.__version__.encode()):
        digest.update(part + b"\0")
    path = root / "cpu_kernels" / f"{source.stem}-{digest.hexdigest()[:16]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def sources() -> list[str]:
    return sorted(p.stem for p in CSRC.glob("*.cpp"))


@functools.cache
def library(name: str):
    """Build (once per machine and source version) and load ``csrc/<name>.cpp``; returns the
    ``torch.ops.pdserve_cpu`` namespace."""
    from torch.utils import cpp_extension

    source = CSRC / f"{name}.cpp"
    try:
        # fresh lists: load() appends its own flags to the ones it is given
        cpp_extension.load(name=f"{NAMESPACE}_{name}", sources=[str(source)],
                           extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                           extra_include_paths=[str(CSRC)],
                           is_python_module=False, build_directory=str(_build_directory(source)),
                           verbose=False)
    except Exception as exc:  # compiler missing or failing: say why, callers fall back
        raise CpuKernelsUnavailable(f"building the pdserve CPU kernel {source.name} failed: {exc}") from exc
    return getattr(torch.ops, NAMESPACE)


def build_all() -> list[str]:
    """Build and load every library; returns their names."""
    for name in sources():
        library(name)
    return sources()


def available() -> bool:
    try:
        build_all()
    except CpuKernelsUnavailable as exc:
        logger.warning("%s", exc)
        return False
    return True


"""Compiled CPU kernels: the production path for fp32 inference on CPU.

Each C++ source ``csrc/<name>.cpp`` is one small library, compiled on first use with
``torch.utils.cpp_extension`` for one instruction set (an *ISA*) and cached under
``$PDSERVE_CACHE_DIR`` (default ``~/.cache/pdserve``), keyed by the source's hash, the flags,
torch's version and, for ``native``, this CPU's model and flags (a cache directory may be shared by
machines with different CPUs). Loops parallelise with ``at::parallel_for`` over torch's own OpenMP
pool, so one thread pool serves the kernels and torch's small ops alike. ``csrc/vec.h`` is the
shared SIMD vocabulary. The build list is ``csrc/*.cpp`` (``sources()``); the headers a source
includes are split by what they do (``quant_format.h`` / ``quant_dot.h`` / ``quant_blocks.h`` /
``quant_kquants.h`` under ``quant_tiles.h``; ``attention_rows.h`` / ``attention_query.h`` /
``attention_tile.h`` / ``attention_work.h``; ``op_checks.h``, ``store_kv.h``) and compile into
each library that includes them, so every ``*.h`` is part of every library's cache key.

ISAs (``$PDSERVE_CPU_ISA``, default ``native``):

    native   -march=native: the widest this CPU has (AVX-512 where present)
    avx2     -march=x86-64-v3 (AVX2 + FMA), tuned for this CPU: what an AVX-512 machine builds to
             test and benchmark the AVX2 path
    avx512   -march=x86-64-v4 (AVX-512 F/BW/CD/DQ/VL); refused on a CPU without avx512f

Each ISA registers its ops into its own namespace, ``torch.ops.pdserve_cpu_<isa>``, so one
process can load several variants side by side (tests and benchmarks compare them).

``library(name, isa=None)`` builds and loads one source and returns its namespace; it raises
``CpuKernelsUnavailable`` (with the compiler's message) when that fails. ``available()`` says
whether every library builds. ``python -m kernels.cpu`` builds them all ahead of time (the
Makefile does, once per install).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

ISA_ENV = "PDSERVE_CPU_ISA"
ISA_FLAGS = {
    "native": ("-march=native",),
    "avx2": ("-march=x86-64-v3", "-mtune=native"),
    "avx512": ("-march=x86-64-v4", "-mtune=native", "-mprefer-vector-width=512"),
}
CSRC = Path(__file__).parent / "csrc"
# --param avoid-fma-max-bits=0: GCC tuned for AMD Zen (-mtune=znver*, which -mtune=native and
# -march=native pick there) leaves loop-carried a += b * c of vectors up to 256 bits as a multiply
# and an add, and contracts the same sum elsewhere: the attention's per-query and multi-query
# steps then round differently (head_dim 80, AVX2 build, on an EPYC), and a token's output
# depends on the item that served it (tests/kernels/test_cpu_attention.py: rows of an item).
# Contracting everywhere keeps their orders identical on every tuning.
CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-Wall", "--param=avoid-fma-max-bits=0")
LDFLAGS = ("-fopenmp",)  # resolves to the libgomp torch already loaded (same soname): one pool


class CpuKernelsUnavailable(RuntimeError):
    """The compiled CPU kernels could not be built or loaded here."""


@functools.cache
def cpu_identity() -> str:
    """This CPU's model name and SIMD flags (``/proc/cpuinfo``): what a native build and a
    measured kernel choice depend on."""
    model, flags = "", ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() in ("flags", "Features"):
                flags = " ".join(sorted(f for f in value.split()
                                        if f.startswith(("avx", "fma", "amx", "sse", "neon", "asimd", "sve"))))
                break
    return f"{model or platform.machine()} [{flags}]"


def has_cpu_flag(flag: str) -> bool:
    return flag in cpu_identity().partition("[")[2].rstrip("]").split()


def default_isa() -> str:
    """``$PDSERVE_CPU_ISA`` or ``native``; ValueError for an unknown name."""
    isa = os.environ.get(ISA_ENV) or "native"
    if isa not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV} must be one of {'|'.join(ISA_FLAGS)}, got {isa!r}")
    return isa


def runnable_isas() -> list[str]:
    """The ISAs whose code this CPU can execute (x86-64 only for the named ones)."""
    isas = ["native"]
    if platform.machine() in ("x86_64", "AMD64"):
        if has_cpu_flag("avx2") and has_cpu_flag("fma"):
            isas.append("avx2")
        if has_cpu_flag("avx512f") and has_cpu_flag("avx512bw") and has_cpu_flag("avx512vl"):
            isas.append("avx512")
    return isas


def namespace(isa: str) -> str:
    return f"pdserve_cpu_{isa}"


def _cflags(isa: str) -> tuple[str, ...]:
    return CFLAGS + ISA_FLAGS[isa] + (f"-DPDSERVE_NAMESPACE={namespace(isa)}",)


def _build_directory(source: Path, isa: str) -> Path:
    cflags = _cflags(isa)
    root = Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")
    digest = hashlib.sha256()
    headers = [p.read_bytes() for p in sorted(CSRC.glob("*.h"))]
    # the checkout's path too: ninja's build file names the sources by absolute path, so two
    # checkouts sharing one directory would rebuild each other's libraries on every load
    for part in (str(CSRC.resolve()).encode(), source.read_bytes(), *headers, " ".join(cflags + LDFLAGS).encode(),
                 torch.__version__.encode(), cpu_identity().encode() if isa == "native" else b""):
        digest.update(part + b"\0")
    path = root / "cpu_kernels" / f"{source.stem}-{isa}-{digest.hexdigest()[:16]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _build_lock(build_directory: Path) -> Iterator[None]:
    """Hold ``build_directory``'s lock while its library is built and loaded.

    torch's own build lock is a file that exists while a build runs; a builder killed mid-build
    (a worker SIGKILLed at its first start) leaves it behind, and every later load waits for it
    forever. An flock dies with its holder: whoever holds this one is the only live builder of
    the directory, so a torch lock file found then is a dead builder's, and is removed."""
    with open(build_directory / "pdserve.lock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            with contextlib.suppress(FileNotFoundError):
                (build_directory / "lock").unlink()
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def sources() -> list[str]:
    return sorted(p.stem for p in CSRC.glob("*.cpp"))


def library(name: str, isa: str | None = None) -> Any:
    """Build (once per machine, ISA and source version) and load ``csrc/<name>.cpp`` for ``isa``
    (default: ``default_isa()``); returns the ``torch.ops.pdserve_cpu_<isa>`` namespace (Any: its
    ops are looked up by name at run time)."""
    return _library(name, isa or default_isa())


@functools.cache
def _library(name: str, isa: str) -> Any:
    from torch.utils import cpp_extension

    if isa not in ISA_FLAGS:
        raise ValueError(f"isa must be one of {'|'.join(ISA_FLAGS)}, got {isa!r}")
    if isa not in runnable_isas():
        raise CpuKernelsUnavailable(f"this CPU cannot run {isa} code ({cpu_identity()}); "
                                    f"set {ISA_ENV} to one of {'|'.join(runnable_isas())}")
    source = CSRC / f"{name}.cpp"
    build_directory = _build_directory(source, isa)
    try:
        # fresh lists: load() appends its own flags to the ones it is given
        with _build_lock(build_directory):
            cpp_extension.load(name=f"{namespace(isa)}_{name}", sources=[str(source)],
                               extra_cflags=list(_cflags(isa)), extra_ldflags=list(LDFLAGS),
                               extra_include_paths=[str(CSRC)], is_python_module=False,
                               build_directory=str(build_directory),
                               verbose=False)
    except Exception as exc:  # compiler missing or failing: say why, callers fall back
        raise CpuKernelsUnavailable(f"building the pdserve CPU kernel {source.name} ({isa}) "
                                    f"failed: {exc}") from exc
    return getattr(torch.ops, namespace(isa))


def build_all(isa: str | None = None) -> list[str]:
    """Build and load every library for ``isa``; returns their names."""
    for name in sources():
        library(name, isa)
    return sources()


def available(isa: str | None = None) -> bool:
    try:
        build_all(isa)
    except CpuKernelsUnavailable as exc:
        logger.warning("%s", exc)
        return False
    return True


"""Which implementation serves each CPU op, decided by measuring both on this machine.

The compiled kernels (``kernels.cpu``) and torch's own ops (MKL/oneDNN, SDPA) win in different
places, and where depends on the machine: the compiled matmul streams packed weights at batch-1
decode, torch's GEMM may win a long prefill chunk; an AVX2 machine and an AVX-512 machine draw
the line in different places. So for every op and size class the model uses, both run on inputs
of the model's own shapes, on the engine's thread count, and the faster one serves that class::

    table = calibrate(dims)                   # cached; measured once per machine (seconds)
    ops = measured_ops(table)                 # an ``Ops`` whose entries dispatch by size
    print(format_table(table))                # what ``pdserve bench kernels`` shows

Both candidates run in torch's one OpenMP pool (the compiled kernels parallelise with
``at::parallel_for``, torch's GEMM is MKL/oneDNN on the same pool), so switching between them
per call never wakes a second thread pool. The 'torch' backend's numpy/OpenBLAS matmul is not a
candidate for that reason: its threads would spin against the OpenMP pool's.

Size classes are upper bounds on a size (rows for the matmuls and the small ops, the longest
query of the batch for attention); each is measured at a representative size. The table is
cached as JSON under ``$PDSERVE_CACHE_DIR/calibration/``, keyed by the CPU's model and SIMD
flags, the ISA the kernels were built for, torch's version, the thread count, the model's
dimensions and a hash of the kernel sources, of this file and of its workloads
(``kernels.calibration_workloads``), so a changed kernel or machine is
re-measured and nothing else is. ``PDSERVE_CPU_CALIBRATION=off`` skips measuring and uses the
compiled kernels everywhere (what the compiled-kernel tests want).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from kernels import calibration_workloads
from kernels.calibration_workloads import best_times, workload
from kernels.model_dims import ModelDims as ModelDims  # where engine/ imports it from
from kernels.op_table import Ops, compiled_ops, torch_ops

if TYPE_CHECKING:  # for types only: kernels.cpu.linear and kernels.quant_cpu build their C++ library on import
    from kernels.cpu.linear import PackedWeight
    from kernels.quant import QuantRows
    from kernels.quant_cpu import PackedQuant

SizeOf = Callable[[tuple[Any, ...]], float]  # an op's call arguments -> the size its class is chosen by

log = logging.getLogger(__name__)

CALIBRATION_ENV = "PDSERVE_CPU_CALIBRATION"
IMPLS = ("cpu", "torch")
# op -> (upper bound, representative size) per class; the last bound is open-ended
SIZE_CLASSES: dict[str, tuple[tuple[float, int], ...]] = {
    "linear": ((1, 1), (4, 4), (8, 8), (16, 16), (64, 64), (256, 256), (float("inf"), 1024)),
    # GGUF blocks (timed with Q4_1, the default model's format): the compiled kernel vs torch.mm
    # on the dequantized weight
    "quant_linear": ((1, 1), (4, 4), (8, 8), (16, 16), (64, 64), (256, 256), (float("inf"), 1024)),
    "paged_attention": ((1, 1), (8, 5), (128, 128), (512, 512), (float("inf"), 1024)),
    "rms_norm": ((16, 8), (256, 128), (float("inf"), 1024)),
    "rotary": ((16, 8), (256, 128), (float("inf"), 1024)),
    "store_kv": ((16, 8), (256, 128), (float("inf"), 1024)),
    "silu_and_mul": ((16, 8), (256, 128), (float("inf"), 1024)),
}


@dataclass(frozen=True)
class Choice:
    """One size class of one op: the seconds each implementation took and the winner."""

    op: str
    bound: float
    size: int
    seconds: dict[str, float]

    @property
    def impl(self) -> str:
        return min(self.seconds, key=self.seconds.__getitem__)


@dataclass(frozen=True)
class Calibration:
    key: str
    cpu: str
    isa: str
    num_threads: int
    choices: tuple[Choice, ...]

    def impls(self, op: str) -> list[tuple[float, str]]:
        """[(upper bound, winning impl)] of ``op``'s classes, smallest first."""
        return [(c.bound, c.impl) for c in self.choices if c.op == op]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        raw = json.loads(text)
        raw["choices"] = tuple(Choice(**c) for c in raw["choices"])
        return cls(**raw)


def compiled_only(isa: str, num_threads: int) -> Calibration:
    """Every class to the compiled kernel, nothing measured (``PDSERVE_CPU_CALIBRATION=off``)."""
    choices = tuple(Choice(op, bound, size, {"cpu": 0.0})
                    for op, classes in SIZE_CLASSES.items() for bound, size in classes)
    return Calibration("off", "", isa, num_threads, choices)


def calibrate(dims: ModelDims, *, force: bool = False) -> Calibration:
    """The cached table for this machine and model, measuring it first if there is none (or
    ``force``). Runs on the current ``torch.get_num_threads()``."""
    from kernels import cpu

    isa, num_threads = cpu.default_isa(), torch.get_num_threads()
    if os.environ.get(CALIBRATION_ENV) == "off":
        return compiled_only(isa, num_threads)
    key = _cache_key(dims, isa, num_threads)
    path = _cache_dir() / f"{key}.json"
    if not force:
        try:
            return Calibration.from_json(path.read_text())
        except (OSError, ValueError, TypeError, KeyError):
            pass
    started = time.perf_counter()
    table = Calibration(key, cpu.cpu_identity(), isa, num_threads, tuple(_measure_all(dims)))
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(table.to_json())
    tmp.replace(path)  # atomic: two workers calibrating at once both write whole files
    log.info("calibrated the CPU kernels in %.1f s (%s, %s, %d threads): %s", time.perf_counter() - started,
             isa, cpu.cpu_identity(), num_threads, path)
    return table


def measured_ops(table: Calibration) -> Ops:
    """The 'cpu' backend's op table: per op, per size class, the implementation that won."""
    compiled, ref = compiled_ops(), torch_ops()
    impl_of = {"cpu": compiled, "torch": ref}

    def pick(op: str, size_of: SizeOf) -> Callable[..., Any]:
        return _by_size([(bound, getattr(impl_of[impl], op)) for bound, impl in table.impls(op)], size_of)

    linear_impls = {impl for _, impl in table.impls("linear")}
    quant_impls = {impl for _, impl in table.impls("quant_linear")}
    rows = lambda args: args[0].shape[0]  # noqa: E731
    ops = Ops(rms_norm=pick("rms_norm", rows), rotary=pick("rotary", rows),
              silu_and_mul=pick("silu_and_mul", rows), store_kv=pick("store_kv", rows),
              paged_attention=pick("paged_attention", lambda args: args[6]),
              pack_linear=lambda w_t: DualWeight.pack(w_t, linear_impls),
              linear=_by_size([(bound, DualWeight.CALLS[impl]) for bound, impl in table.impls("linear")], rows),
              pack_quant=lambda blocks: DualWeight.pack_quant(blocks, quant_impls),
              quant_linear=_by_size([(bound, DualWeight.QUANT_CALLS[impl])
                                     for bound, impl in table.impls("quant_linear")], rows),
              argmax_rows=compiled.argmax_rows)
    # The compiled quantized matmul for every size: its own handles and call, no DualWeight
    # indirection (a batch-1 decode step makes ~120 matmul calls).
    if quant_impls == {"cpu"}:
        ops = dataclasses.replace(ops, pack_quant=compiled.pack_quant, quant_linear=compiled.quant_linear)
        if {impl for _, impl in table.impls("rms_norm")} == {"cpu"}:  # the fused op is both compiled ops
            ops = dataclasses.replace(ops, norm_quant_linear=compiled.norm_quant_linear)
    # The one-call layer stack makes the compiled calls (on DualWeight's packed handles when torch
    # serves larger sizes): it serves the steps whose every op the compiled kernel won (attention's
    # class is its longest query, at most the step's rows).
    limit = min(compiled_up_to(table, op) for op in STACK_OPS)
    if limit > 0:
        ops = dataclasses.replace(ops, decoder_stack=compiled.decoder_stack, stack_max_tokens=limit)
    return ops


STACK_OPS = ("quant_linear", "rms_norm", "rotary", "store_kv", "silu_and_mul", "paged_attention")


def compiled_up_to(table: Calibration, op: str) -> int:
    """The largest size up to which every class of ``op`` is served by the compiled kernel
    (0: not even the smallest; ``sys.maxsize``: every size)."""
    limit = 0
    for bound, impl in table.impls(op):
        if impl != "cpu":
            return limit
        limit = sys.maxsize if bound == float("inf") else int(bound)
    return limit


@dataclass(frozen=True, slots=True)
class DualWeight:
    """A matmul weight in the layout of each implementation that serves some size class: the
    compiled kernel's packed panels, and/or the plain [in, out] tensor for ``torch.mm``."""

    packed: PackedWeight | PackedQuant | None
    plain: torch.Tensor | None

    @classmethod
    def pack(cls, w_t: torch.Tensor, impls: set[str]) -> DualWeight:
        from kernels.cpu.linear import pack_weight

        return cls(pack_weight(w_t) if "cpu" in impls else None,
                   w_t.contiguous() if "torch" in impls else None)

    @classmethod
    def pack_quant(cls, blocks: QuantRows, impls: set[str]) -> DualWeight:
        """GGUF blocks (``kernels.quant.QuantRows``): the compiled kernel's panels and/or the
        dequantized [in, out] weight for ``torch.mm`` (the size classes torch serves)."""
        from kernels.quant import pack_quant_ref
        from kernels.quant_cpu import pack

        return cls(pack(blocks) if "cpu" in impls else None,
                   pack_quant_ref(blocks) if "torch" in impls else None)

    @staticmethod
    def _compiled(x: torch.Tensor, w: DualWeight) -> torch.Tensor:
        from kernels.cpu.linear import linear

        return linear(x, cast("PackedWeight", w.packed))  # set where 'cpu' serves a class

    @staticmethod
    def _compiled_quant(x: torch.Tensor, w: DualWeight) -> torch.Tensor:
        from kernels.quant_cpu import quant_linear

        return quant_linear(x, cast("PackedQuant", w.packed))  # as above

    CALLS = {"cpu": lambda x, w: DualWeight._compiled(x, w), "torch": lambda x, w: torch.mm(x, w.plain)}
    QUANT_CALLS = {"cpu": lambda x, w: DualWeight._compiled_quant(x, w),
                   "torch": lambda x, w: torch.mm(x, w.plain)}


def _by_size(classes: list[tuple[float, Callable[..., Any]]], size_of: SizeOf) -> Callable[..., Any]:
    """One callable over ``classes`` ([(upper bound, impl)], ascending); no dispatch at all
    when every class has the same implementation."""
    if len({id(impl) for _, impl in classes}) == 1:
        return classes[0][1]
    bounds = [bound for bound, _ in classes]
    impls = [impl for _, impl in classes]

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        size = size_of(args)
        for bound, impl in zip(bounds, impls):
            if size <= bound:
                return impl(*args, **kwargs)
        return impls[-1](*args, **kwargs)

    return dispatch


def format_table(table: Calibration) -> str:
    """The table ``pdserve bench kernels`` prints: both timings per class, and the choice."""
    def ms(s: float | None) -> str:
        return f"{s * 1e3:.3f}" if s else "-"

    lines = [f"CPU kernel choice on {table.cpu or 'this CPU'}, ISA {table.isa}, {table.num_threads} "
             f"threads, torch {torch.__version__}",
             f"{'op':<16}{'size class':>12}{'at':>6}{'compiled ms':>13}{'torch ms':>10}{'torch/compiled':>16}  chosen"]
    for op in SIZE_CLASSES:
        lower = 1
        for c in (c for c in table.choices if c.op == op):
            label = f"{lower}..{int(c.bound)}" if c.bound != float("inf") else f">={lower}"
            lower = int(c.bound) + 1 if c.bound != float("inf") else lower
            cpu_s, torch_s = c.seconds.get("cpu"), c.seconds.get("torch")
            ratio = f"{torch_s / cpu_s:.2f}x" if cpu_s and torch_s else "-"
            lines.append(f"{op:<16}{label:>12}{c.size:>6}{ms(cpu_s):>13}{ms(torch_s):>10}{ratio:>16}  {c.impl}")
    return "\n".join(lines)


def _cache_dir() -> Path:
    root = Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")
    path = root / "calibration"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _cache_key(dims: ModelDims, isa: str, num_threads: int) -> str:
    from kernels import cpu

    digest = hashlib.sha256()
    sources = sorted(cpu.CSRC.glob("*")) + [Path(__file__), Path(calibration_workloads.__file__)]
    for part in (*(p.read_bytes() for p in sources), cpu.cpu_identity().encode(), isa.encode(),
                 torch.__version__.encode(), str(num_threads).encode(), repr(dims).encode()):
        digest.update(part + b"\0")
    return digest.hexdigest()[:20]


def _measure_all(dims: ModelDims) -> list[Choice]:
    candidates = {"cpu": compiled_ops(), "torch": torch_ops()}
    torch.manual_seed(0)
    choices = []
    for op, classes in SIZE_CLASSES.items():
        for bound, size in classes:
            calls = {name: workload(op, size, dims, ops, name) for name, ops in candidates.items()}
            choices.append(Choice(op, bound, size, best_times(calls)))
    return choices

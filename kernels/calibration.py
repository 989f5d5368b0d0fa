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
dimensions and a hash of the kernel sources and of this file, so a changed kernel or machine is
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

import torch

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
BLOCK_SIZE = 16
DECODE_BATCH, DECODE_CONTEXT = 8, 512  # attention's q_len-1 class: this many sequences this long
MIN_SECONDS, MIN_CALLS, MAX_CALLS = 0.05, 3, 20
# Matmuls up to this many rows are bound by reading the weights, so they are timed over every
# layer's weights (distinct tensors, up to LINEAR_WORKING_SET bytes), as a decode step reads
# them: one layer's weights timed again and again sit in the cache, which favoured torch's GEMM
# at 9..16 rows by 10% here where over the whole model the compiled kernel is 1.6x faster.
# Bigger M is bound by arithmetic: one layer is enough.
WEIGHT_BOUND_ROWS, LINEAR_WORKING_SET = 16, 512 << 20


@dataclass(frozen=True)
class ModelDims:
    """The shapes the ops see: enough to build representative inputs."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int = 1

    @property
    def linear_shapes(self) -> tuple[tuple[int, int], ...]:
        """(in, out) of one layer's matmuls: fused qkv, o, fused gate_up, down."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return ((self.hidden_size, q + 2 * kv), (q, self.hidden_size),
                (self.hidden_size, 2 * self.intermediate_size), (self.intermediate_size, self.hidden_size))


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


def measured_ops(table: Calibration):
    """The 'cpu' backend's op table: per op, per size class, the implementation that won."""
    from kernels.ops import Ops, compiled_ops, get_ops

    compiled, ref = compiled_ops(), get_ops("torch")
    impl_of = {"cpu": compiled, "torch": ref}

    def pick(op: str, size_of: Callable) -> Callable:
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

    packed: object | None
    plain: torch.Tensor | None

    @classmethod
    def pack(cls, w_t: torch.Tensor, impls: set[str]) -> DualWeight:
        from kernels.cpu.linear import pack_weight

        return cls(pack_weight(w_t) if "cpu" in impls else None,
                   w_t.contiguous() if "torch" in impls else None)

    @classmethod
    def pack_quant(cls, blocks, impls: set[str]) -> DualWeight:
        """GGUF blocks (``kernels.quant.QuantRows``): the compiled kernel's panels and/or the
        dequantized [in, out] weight for ``torch.mm`` (the size classes torch serves)."""
        from kernels.quant import pack_quant_ref
        from kernels.quant_cpu import pack

        return cls(pack(blocks) if "cpu" in impls else None,
                   pack_quant_ref(blocks) if "torch" in impls else None)

    @staticmethod
    def _compiled(x: torch.Tensor, w: DualWeight) -> torch.Tensor:
        from kernels.cpu.linear import linear

        return linear(x, w.packed)

    @staticmethod
    def _compiled_quant(x: torch.Tensor, w: DualWeight) -> torch.Tensor:
        from kernels.quant_cpu import quant_linear

        return quant_linear(x, w.packed)

    CALLS = {"cpu": lambda x, w: DualWeight._compiled(x, w), "torch": lambda x, w: torch.mm(x, w.plain)}
    QUANT_CALLS = {"cpu": lambda x, w: DualWeight._compiled_quant(x, w),
                   "torch": lambda x, w: torch.mm(x, w.plain)}


def _by_size(classes: list[tuple[float, Callable]], size_of: Callable) -> Callable:
    """One callable over ``classes`` ([(upper bound, impl)], ascending); no dispatch at all
    when every class has the same implementation."""
    if len({id(impl) for _, impl in classes}) == 1:
        return classes[0][1]
    bounds = [bound for bound, _ in classes]
    impls = [impl for _, impl in classes]

    def dispatch(*args, **kwargs):
        size = size_of(args)
        for bound, impl in zip(bounds, impls):
            if size <= bound:
                return impl(*args, **kwargs)
        return impls[-1](*args, **kwargs)

    return dispatch


def format_table(table: Calibration) -> str:
    """The table ``pdserve bench kernels`` prints: both timings per class, and the choice."""
    ms = lambda s: f"{s * 1e3:.3f}" if s else "-"  # noqa: E731
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


# ---- measuring ---------------------------------------------------------------------------

def _cache_dir() -> Path:
    root = Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")
    path = root / "calibration"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _cache_key(dims: ModelDims, isa: str, num_threads: int) -> str:
    from kernels import cpu

    digest = hashlib.sha256()
    sources = sorted(cpu.CSRC.glob("*")) + [Path(__file__)]
    for part in (*(p.read_bytes() for p in sources), cpu.cpu_identity().encode(), isa.encode(),
                 torch.__version__.encode(), str(num_threads).encode(), repr(dims).encode()):
        digest.update(part + b"\0")
    return digest.hexdigest()[:20]


def _time(fns: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Best time of each function, calls interleaved so drift hits every candidate alike."""
    for fn in fns.values():
        fn()  # warm: first-call allocations, lazy library loads
    best = dict.fromkeys(fns, float("inf"))
    spent, calls = 0.0, 0
    while calls < MIN_CALLS or (spent < MIN_SECONDS and calls < MAX_CALLS):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t0
            best[name] = min(best[name], elapsed)
            spent += elapsed
        calls += 1
    return best


def _measure_all(dims: ModelDims) -> list[Choice]:
    from kernels.ops import compiled_ops, get_ops

    candidates = {"cpu": compiled_ops(), "torch": get_ops("torch")}
    torch.manual_seed(0)
    choices = []
    for op, classes in SIZE_CLASSES.items():
        for bound, size in classes:
            calls = {name: _workload(op, size, dims, ops, name) for name, ops in candidates.items()}
            choices.append(Choice(op, bound, size, _time(calls)))
    return choices


def _workload(op: str, size: int, dims: ModelDims, ops, impl: str) -> Callable[[], object]:
    """A call of ``op`` at ``size`` on inputs of the model's shapes."""
    if op == "quant_linear":
        return _quant_workload(size, dims, ops, impl)
    if op == "linear":
        layer_bytes = 4 * sum(k * n for k, n in dims.linear_shapes)
        copies = (max(1, min(dims.num_layers, LINEAR_WORKING_SET // layer_bytes))
                  if size <= WEIGHT_BOUND_ROWS else 1)
        layer = [torch.randn(k, n) * k ** -0.5 for k, n in dims.linear_shapes]
        weights = [w.clone() for _ in range(copies) for w in layer]
        xs = [torch.randn(size, w.shape[0]) for w in weights]
        if impl == "cpu":
            packed = [ops.pack_linear(w) for w in weights]
            return lambda: [ops.linear(x, w) for x, w in zip(xs, packed)]
        return lambda: [torch.mm(x, w) for x, w in zip(xs, weights)]
    heads, kv_heads, head_dim = dims.num_heads, dims.num_kv_heads, dims.head_dim
    if op == "paged_attention":
        return _attention_workload(size, heads, kv_heads, head_dim, ops)
    if op == "rms_norm":
        x, residual = torch.randn(size, dims.hidden_size), torch.randn(size, dims.hidden_size)
        weight = torch.rand(dims.hidden_size)
        return lambda: ops.rms_norm(x, weight, 1e-5, residual)
    if op == "silu_and_mul":
        x = torch.randn(size, 2 * dims.intermediate_size)
        return lambda: ops.silu_and_mul(x)
    if op == "rotary":
        from kernels.rotary import build_cos_sin_cache

        cache = build_cos_sin_cache(head_dim, 4096, 10000.0)
        qkv = torch.randn(size, (heads + 2 * kv_heads) * head_dim)
        q = qkv[:, :heads * head_dim].view(size, heads, head_dim)
        k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(size, kv_heads, head_dim)
        positions = torch.arange(size)
        return lambda: ops.rotary(q, k, positions, cache)
    if op == "store_kv":
        key_cache, value_cache = _kv_cache(-(-size // BLOCK_SIZE) + 1, kv_heads, head_dim)
        key, value = torch.randn(size, kv_heads, head_dim), torch.randn(size, kv_heads, head_dim)
        slots = torch.randperm(key_cache.shape[0] * BLOCK_SIZE)[:size]
        return lambda: ops.store_kv(key, value, key_cache, value_cache, slots)
    raise ValueError(f"no workload for op {op!r}")


def _quant_workload(size: int, dims: ModelDims, ops, impl: str) -> Callable[[], object]:
    """Q4_1 matmuls over as many layers as the fp32 ones (the same weight-bound rule)."""
    from kernels.quant import pack_quant_ref, random_rows

    layer_bytes = 4 * sum(k * n for k, n in dims.linear_shapes)
    copies = (max(1, min(dims.num_layers, LINEAR_WORKING_SET // layer_bytes))
              if size <= WEIGHT_BOUND_ROWS else 1)
    blocks = [random_rows(n, k, "q4_1", seed=i) for i in range(copies) for k, n in dims.linear_shapes]
    xs = [torch.randn(size, b.in_features) for b in blocks]
    if impl == "cpu":
        packed = [ops.pack_quant(b) for b in blocks]
        return lambda: [ops.quant_linear(x, w) for x, w in zip(xs, packed)]
    plain = [pack_quant_ref(b) for b in blocks]
    return lambda: [torch.mm(x, w) for x, w in zip(xs, plain)]


def _kv_cache(num_blocks: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer K and V views of a two-layer block cache: the strides the model passes."""
    cache = torch.randn(num_blocks, 2, 2, BLOCK_SIZE, kv_heads, head_dim)
    return cache[:, 0, 0], cache[:, 0, 1]


def _attention_workload(q_len: int, heads: int, kv_heads: int, head_dim: int, ops) -> Callable[[], object]:
    """q_len 1: a decode batch; up to 8: a few sequences verifying drafts on a context; longer:
    one prompt chunk, fresh (the common case of a prefill)."""
    if q_len == 1:
        num_seqs, context = DECODE_BATCH, DECODE_CONTEXT
    elif q_len <= 8:
        num_seqs, context = 4, DECODE_CONTEXT
    else:
        num_seqs, context = 1, q_len
    blocks_per_seq = -(-context // BLOCK_SIZE)
    key_cache, value_cache = _kv_cache(num_seqs * blocks_per_seq, kv_heads, head_dim)
    block_tables = torch.randperm(num_seqs * blocks_per_seq).to(torch.int32).view(num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
    cu_seqlens_q = torch.arange(0, (num_seqs + 1) * q_len, q_len, dtype=torch.int32)
    query = torch.randn(num_seqs * q_len, heads, head_dim)
    scale = head_dim ** -0.5
    return lambda: ops.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                       cu_seqlens_q, q_len, scale)

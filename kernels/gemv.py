"""Decode-sized matmuls in Triton, with the op before each one fused into its loads.

At batch 1 a decode layer launches, besides attention, an RMSNorm, the q/k/v matmul, the o
matmul, a second RMSNorm, the gate/up matmul, SiLU-and-mul and the down matmul (and cuBLAS adds
a split-K reduce to the skinny ones): on an H100, 1.7B shape, the norms, SiLU and reduces were
~10% of the step's GPU time and each launch leaves a gap in the graph (docs/benchmarks.md, GPU).
Here one kernel computes, for a few rows of ``x`` (at most ``MAX_ROWS``)::

    linear(x, w)                        x @ W^T
    norm_linear(x, g, eps, r, w)        rms_norm(x + r) * g @ W^T, and x + r (the next residual)
    silu_and_mul_linear(x, w)           (silu(x[:, :I]) * x[:, I:]) @ W^T

W is the Linear layout ``[out, in]`` (``DenseWeight``), read once per call in tiles of
``BLOCK_N`` output rows by ``BLOCK_K`` inputs, each program ``BLOCK_N`` outputs of every row of
``x``; the prologue's values are rounded to x's dtype before the products, as the separate ops
round their outputs, and the products are summed in fp32. The norm's statistics take one more
pass over the row (``K`` elements, from L2), in every program.

Whether it pays depends on the GPU, the shapes and the number of rows, so nothing uses it
unmeasured: ``choose`` times each tile shape against the unfused ops (the Triton norm or SiLU,
then cuBLAS) as CUDA graphs over enough copies of the weights to stream them from HBM, and a
weight keeps, per prologue and row count bucket, the fastest (``DenseWeight.configs``). A
weight without a choice takes the unfused ops, which is also every call of more than
``MAX_ROWS`` rows (prefill, large decode batches: cuBLAS's GEMM). ``$PDSERVE_TRITON_GEMV``:
``auto`` (default) measures on CUDA, ``on`` takes ``DEFAULT_CONFIG`` everywhere without
measuring (the tests, and the interpreter on a CPU), ``off`` never uses the kernel.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels._checks import FLOAT_DTYPES, check_tensor
from kernels._triton import check_launchable, tl, triton
from kernels.timing import best_seconds

GEMV_ENV = "PDSERVE_TRITON_GEMV"
GEMV_MODES = ("auto", "on", "off")
MAX_ROWS = 8
ROW_BUCKETS = (1, 2, 4, 8)  # a call's rows round up to one of these (its BLOCK_M)
NONE, RMS_NORM, SILU_MUL = 0, 1, 2  # the prologue


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int = 4


DEFAULT_CONFIG = GemvConfig(16, 128)
ROUNDS = 2  # ``choose`` times every candidate this many times, in turn, and keeps each one's best
# At most this many weights per timed graph (a 135M-shape o matmul needs ~300 copies to fill 4x
# an H100's L2; a test's tiny weights would need tens of thousands)
MAX_STREAMED = 512
# The tile shapes ``choose`` times, by the row bucket: fewer rows, longer tiles per load.
# Each is a compile (~0.3 s) at the first start on a machine (Triton caches it on disk after).
CANDIDATES: dict[int, tuple[GemvConfig, ...]] = {
    1: (GemvConfig(4, 512), GemvConfig(8, 512), GemvConfig(16, 256)),
    2: (GemvConfig(4, 512), GemvConfig(8, 256)),
    4: (GemvConfig(4, 256), GemvConfig(8, 256)),
    8: (GemvConfig(4, 256), GemvConfig(8, 128)),
}


def gemv_mode() -> str:
    mode = os.environ.get(GEMV_ENV, "auto")
    if mode not in GEMV_MODES:
        raise ValueError(f"{GEMV_ENV} must be one of {'|'.join(GEMV_MODES)}, got {mode!r}")
    return mode


def row_bucket(num_rows: int) -> int:
    """The smallest ``ROW_BUCKETS`` entry >= num_rows (1 <= num_rows <= MAX_ROWS)."""
    return next(b for b in ROW_BUCKETS if b >= num_rows)


@dataclass(eq=False)
class DenseWeight:
    """A Linear weight ``w`` [out, in] as the Triton backend keeps it (``pack_linear``), and the
    tile shape each (prologue, row bucket) takes the fused kernel with; a missing key takes the
    unfused ops."""

    w: torch.Tensor
    configs: dict[tuple[int, int], GemvConfig] = field(default_factory=dict)

    @property
    def in_features(self) -> int:
        return self.w.shape[1]

    @property
    def out_features(self) -> int:
        return self.w.shape[0]

    def config(self, prologue: int, num_rows: int) -> GemvConfig | None:
        if not 1 <= num_rows <= MAX_ROWS:
            return None
        return self.configs.get((prologue, row_bucket(num_rows)))


def pack_linear(w_t: torch.Tensor) -> DenseWeight:
    """The transposed Linear weight [in, out] -> ``DenseWeight`` of its [out, in] layout (no copy
    when it is a transposed contiguous tensor, as the model's fused and tied weights are).
    Under ``$PDSERVE_TRITON_GEMV=on`` every prologue and bucket takes ``DEFAULT_CONFIG``."""
    weight = DenseWeight(w_t.t().contiguous())
    if gemv_mode() == "on":
        weight.configs = {(p, b): DEFAULT_CONFIG for p in (NONE, RMS_NORM, SILU_MUL) for b in ROW_BUCKETS}
    return weight


@triton.jit
def _gemv_kernel(  # type: ignore[no-untyped-def]  # JIT kernel (kernels/_triton.py)
    x_ptr, residual_ptr, norm_ptr, w_ptr, out_ptr, residual_out_ptr,
    M, N, K, eps, stride_x, stride_res, stride_w, stride_out, stride_res_out,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    dtype = out_ptr.dtype.element_ty
    inv_rms = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if PROLOGUE == 1:  # the row's statistics first: rms_norm(x + residual)
        sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            mask = row_mask[:, None] & (ks < K)[None, :]
            s = tl.load(x_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(residual_ptr + rows[:, None] * stride_res + ks[None, :], mask=mask, other=0.0)
                s = (s + r.to(tl.float32)).to(dtype).to(tl.float32)
            sum_sq += tl.sum(s * s, axis=1)
        inv_rms = 1.0 / tl.sqrt(sum_sq / K + eps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        mask = row_mask[:, None] & k_mask[None, :]
        if PROLOGUE == 1:
            s = tl.load(x_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(residual_ptr + rows[:, None] * stride_res + ks[None, :], mask=mask, other=0.0)
                s = (s + r.to(tl.float32)).to(dtype).to(tl.float32)
                # the next residual, written once (by the first program)
                first = (tl.zeros((BLOCK_M,), dtype=tl.int32) + pid) == 0
                tl.store(residual_out_ptr + rows[:, None] * stride_res_out + ks[None, :], s.to(dtype),
                         mask=mask & first[:, None])
            g = tl.load(norm_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            a = (s * inv_rms[:, None] * g[None, :]).to(dtype).to(tl.float32)
        elif PROLOGUE == 2:
            gate = tl.load(x_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
            up = tl.load(x_rows + K + ks[None, :], mask=mask, other=0.0).to(tl.float32)
            a = (gate / (1.0 + tl.exp(-gate)) * up).to(dtype).to(tl.float32)
        else:
            a = tl.load(x_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(a[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(dtype),
             mask=row_mask[:, None] & col_mask[None, :])


def _launch(x: torch.Tensor, weight: DenseWeight, config: GemvConfig, prologue: int, k: int,
            residual: torch.Tensor | None = None, norm: torch.Tensor | None = None,
            eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    check_launchable(x.device)
    num_rows, n = x.shape[0], weight.out_features
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else None
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, residual if residual is not None else x, norm if norm is not None else x, weight.w, out,
        residual_out if residual_out is not None else out,
        num_rows, n, k, eps, x.stride(0), residual.stride(0) if residual is not None else 0,
        weight.w.stride(0), out.stride(0), residual_out.stride(0) if residual_out is not None else 0,
        PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, BLOCK_M=row_bucket(num_rows),
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps)
    return out, residual_out


def _check(name: str, x: torch.Tensor, weight: DenseWeight, in_features: int) -> None:
    check_tensor(name, x, ndim=2, dtypes=FLOAT_DTYPES, device=weight.w.device, last_dim_contiguous=True)
    if x.dtype != weight.w.dtype:
        raise ValueError(f"{name} must have the weight's dtype ({weight.w.dtype}), got {x.dtype}")
    if x.shape[1] != in_features:
        raise ValueError(f"{name} has {x.shape[1]} features but the weight expects {in_features}")


def linear(x: torch.Tensor, weight: DenseWeight) -> torch.Tensor:
    """x [M, in] @ W^T -> [M, out] in x's dtype."""
    config = weight.config(NONE, x.shape[0])
    if config is None:
        return F.linear(x, weight.w)
    _check("x", x, weight, weight.in_features)
    return _launch(x, weight, config, NONE, weight.in_features)[0]


def norm_linear(x: torch.Tensor, norm: torch.Tensor, eps: float, residual: torch.Tensor | None,
                weight: DenseWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ W^T, x + residual), ``kernels.rms_norm``'s rounding; residual
    None: no add, and the second value is ``x`` itself."""
    config = weight.config(RMS_NORM, x.shape[0])
    if config is None:
        from kernels.rms_norm import rms_norm

        if residual is None:
            normed = rms_norm(x, norm, eps)
            assert isinstance(normed, torch.Tensor)
            return F.linear(normed, weight.w), x
        normed, residual_out = rms_norm(x, norm, eps, residual)
        return F.linear(normed, weight.w), residual_out
    _check("x", x, weight, weight.in_features)
    check_tensor("norm", norm, shape=(x.shape[1],), dtypes=FLOAT_DTYPES, device=x.device)
    if residual is not None:
        check_tensor("residual", residual, shape=tuple(x.shape), dtypes=(x.dtype,), device=x.device,
                     last_dim_contiguous=True)
    out, residual_out = _launch(x, weight, config, RMS_NORM, weight.in_features, residual, norm, eps)
    return out, residual_out if residual_out is not None else x


def silu_and_mul_linear(x: torch.Tensor, weight: DenseWeight) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] @ W^T for x [M, 2*I] (the gate | up matmul's output)."""
    config = weight.config(SILU_MUL, x.shape[0])
    if config is None:
        from kernels.activation import silu_and_mul

        return F.linear(silu_and_mul(x), weight.w)
    _check("x", x, weight, 2 * weight.in_features)
    return _launch(x, weight, config, SILU_MUL, weight.in_features)[0]


# ---- choosing, on CUDA ------------------------------------------------------------------

def _seconds(calls: Callable[[], object], device: torch.device, replays: int = 5) -> float:
    """Seconds one replay of ``calls`` captured as a CUDA graph takes (best of ``replays``); on
    a CPU (the interpreter, for the tests) one eager run's."""
    calls()  # compiles; cuBLAS picks its kernel
    if device.type != "cuda":
        return best_seconds(calls, replays)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    graph.replay()
    best = float("inf")
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del graph
    return best


def _streamed(weights: Sequence[DenseWeight], min_bytes: int) -> list[DenseWeight]:
    """New handles of ``weights``' tensors, then of copies of them, until they hold
    ``min_bytes`` (or ``MAX_STREAMED`` of them): calls over them stream each weight from HBM, as
    a decode step does, not from L2."""
    out = [DenseWeight(w.w) for w in weights]
    total = sum(w.w.numel() * w.w.element_size() for w in out)
    i = 0
    while total < min_bytes and len(out) < MAX_STREAMED:
        copy = DenseWeight(weights[i % len(weights)].w.clone())
        out.append(copy)
        total += copy.w.numel() * copy.w.element_size()
        i += 1
    return out


@dataclass(frozen=True)
class Choice:
    prologue: int
    num_rows: int
    config: GemvConfig | None  # None: the unfused ops were fastest
    seconds: dict[str, float]  # per call: "unfused" and each candidate's "BLOCK_NxBLOCK_K/warps"


def _calls(streamed: Sequence[DenseWeight], prologue: int, config: GemvConfig | None, x: torch.Tensor,
           norm: torch.Tensor, eps: float, residual: torch.Tensor) -> Callable[[], object]:
    """One call per weight of ``streamed``, each taking ``config`` (None: the unfused ops)."""
    key = (prologue, row_bucket(x.shape[0]))
    for w in streamed:
        w.configs = {key: config} if config is not None else {}
    if prologue == RMS_NORM:
        return lambda: [norm_linear(x, norm, eps, residual, w) for w in streamed]
    if prologue == SILU_MUL:
        return lambda: [silu_and_mul_linear(x, w) for w in streamed]
    return lambda: [linear(x, w) for w in streamed]


# What this process has measured, by what decides it: another engine over weights of the same
# shape (a second engine start, the next model of a benchmark) takes the same choices untimed
_CHOSEN: dict[tuple[object, ...], list[Choice]] = {}


def choose(weights: Sequence[DenseWeight], prologue: int, norm: torch.Tensor | None = None,
           eps: float = 1e-6, rows: Sequence[int] = ROW_BUCKETS) -> list[Choice]:
    """Time the unfused ops and each ``CANDIDATES`` tile shape for ``prologue`` on ``weights``
    (one kind of matmul, every layer's: same shape) at each row count, and set the fastest on
    every weight (``DenseWeight.configs``); returns what was measured. On a CPU (the
    interpreter) eager runs are timed instead, which checks the bookkeeping, not the speed.
    Once per process for each device, dtype, shape, prologue and row counts: later calls set
    the choices measured then (``_CHOSEN``)."""
    device, dtype = weights[0].w.device, weights[0].w.dtype
    key = (device, dtype, tuple(weights[0].w.shape), prologue, tuple(rows))
    known = _CHOSEN.get(key)
    if known is not None:
        for choice in known:
            _keep(weights, prologue, row_bucket(choice.num_rows), choice.config)
        return known
    streamed = _streamed(weights, 4 * _l2_bytes(device))
    k = weights[0].in_features
    gen = torch.Generator(device=device).manual_seed(0)
    g = norm if norm is not None else torch.ones(k, device=device, dtype=dtype)
    choices = []
    for num_rows in rows:
        bucket = row_bucket(num_rows)
        x = torch.randn(num_rows, 2 * k if prologue == SILU_MUL else k, device=device, dtype=dtype,
                        generator=gen)
        residual = torch.randn(num_rows, k, device=device, dtype=dtype, generator=gen)
        timed: dict[str, tuple[float, GemvConfig | None]] = {}
        for _ in range(ROUNDS):  # interleaved: another process's burst on the GPU hits one round
            for config in (None, *CANDIDATES[bucket]):
                name = "unfused" if config is None else f"{config.block_n}x{config.block_k}/{config.num_warps}"
                seconds = _seconds(_calls(streamed, prologue, config, x, g, eps, residual), device)
                timed[name] = (min(seconds / len(streamed), timed.get(name, (float("inf"),))[0]), config)
        best = min(timed.values(), key=lambda t: t[0])[1]
        _keep(weights, prologue, bucket, best)
        choices.append(Choice(prologue, num_rows, best, {name: t for name, (t, _) in timed.items()}))
    streamed.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    _CHOSEN[key] = choices
    return choices


def _keep(weights: Sequence[DenseWeight], prologue: int, bucket: int, config: GemvConfig | None) -> None:
    """Every weight takes ``config`` for (prologue, bucket); None: the unfused ops."""
    for w in weights:
        if config is not None:
            w.configs[(prologue, bucket)] = config
        else:
            w.configs.pop((prologue, bucket), None)


def _l2_bytes(device: torch.device) -> int:
    """The GPU's L2 cache (at least 16 MiB assumed); 0 on a CPU (nothing to stream past)."""
    if device.type != "cuda":
        return 0
    return max(int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)), 1 << 24)

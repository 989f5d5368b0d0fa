"""Kernel micro-benchmarks: each Triton kernel against its torch baseline, in the same run.

    python -m kernels.bench            (CUDA only; on CPU it says so and exits 0)
    python -m kernels.bench --cpu [--isa native|avx2] [--threads N]   (kernels.cpu.attention)

Attention is compared with ``torch.nn.functional.scaled_dot_product_attention`` on the same data
gathered into contiguous tensors (the baseline gets its copy for free). Decode is reported as
achieved HBM GB/s (bytes of K/V read), prefill as TFLOP/s, each also as a fraction of the device's
peak when the device is in ``PEAKS``. ``--cpu`` does the same for the compiled CPU attention
(``kernels.bench_attention_cpu``) at SmolLM2-135M's shapes.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kernels.bench_attention_cpu import AttentionArgs

# name fragment -> (HBM bytes/s, dense bf16 tensor FLOP/s); first match wins, so specific first
PEAKS: list[tuple[str, float, float]] = [
    ("H200", 4.8e12, 989e12),
    ("H100 NVL", 3.9e12, 835e12),
    ("H100 PCIe", 2.0e12, 756e12),
    ("H100", 3.35e12, 989e12),  # SXM5 / HBM3
]


def _peak(device_name: str) -> tuple[float | None, float | None]:
    for fragment, bandwidth, flops in PEAKS:
        if fragment in device_name:
            return bandwidth, flops
    return None, None


def _time_ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench
    ms: float = do_bench(fn, warmup=25, rep=100)
    return ms


def _paged_case(num_seqs: int, seq_len: int, q_len: int, num_heads: int, num_kv_heads: int,
                head_dim: int, block_size: int, dtype: torch.dtype
                ) -> tuple[AttentionArgs, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A batch in the engine's 6-d cache layout, with block ids shuffled across sequences."""
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = num_seqs * blocks_per_seq
    kv_cache = torch.randn(num_blocks, 1, 2, block_size, num_kv_heads, head_dim, device="cuda",
                           dtype=dtype)
    block_tables = torch.randperm(num_blocks, device="cuda").view(num_seqs, blocks_per_seq).int()
    query = torch.randn(num_seqs * q_len, num_heads, head_dim, device="cuda", dtype=dtype)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device="cuda")
    cu = torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32, device="cuda")
    args = (query, kv_cache[:, 0, 0], kv_cache[:, 0, 1], block_tables, seq_lens, cu, q_len,
            head_dim ** -0.5)

    def dense(cache: torch.Tensor) -> torch.Tensor:  # -> [num_seqs, num_kv_heads, seq_len, head_dim]
        gathered = cache[block_tables.long()].flatten(1, 2)[:, :seq_len]
        return gathered.transpose(1, 2).contiguous()

    q_dense = query.view(num_seqs, q_len, num_heads, head_dim).transpose(1, 2).contiguous()
    return args, (q_dense, dense(kv_cache[:, 0, 0]), dense(kv_cache[:, 0, 1]))


def _row(name: str, ours_ms: float, base_ms: float, amount: float, unit: str, peak: float | None) -> str:
    rate = amount / (ours_ms * 1e-3)
    scale = 1e9 if unit == "GB/s" else 1e12
    of_peak = f"{rate / peak:6.1%}" if peak else "     -"
    return (f"{name:<34} {ours_ms:9.3f} {base_ms:9.3f} {base_ms / ours_ms:7.2f}x "
            f"{rate / scale:9.1f} {unit:<7} {of_peak}")


def bench_attention(bandwidth: float | None, flops: float | None) -> list[str]:
    from kernels.paged_attention import paged_attention
    rows = []
    dtype, heads, kv_heads, head_dim = torch.bfloat16, 32, 8, 128
    decode_cases = [("decode 64 x 4K", 64, 4096, None), ("decode 4 x 32K (auto split)", 4, 32768, None),
                    ("decode 4 x 32K (no split)", 4, 32768, 1)]
    for name, batch, ctx, splits in decode_cases:
        args, (q, k, v) = _paged_case(batch, ctx, 1, heads, kv_heads, head_dim, 16, dtype)
        ours = _time_ms(functools.partial(paged_attention, *args, num_splits=splits))
        base = _time_ms(functools.partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=True))
        kv_bytes = 2 * batch * ctx * kv_heads * head_dim * k.element_size()
        rows.append(_row(name, ours, base, kv_bytes, "GB/s", bandwidth))
        del args, q, k, v
    for name, batch, seq in [("prefill 4 x 2K causal", 4, 2048), ("prefill 1 x 8K causal", 1, 8192)]:
        args, (q, k, v) = _paged_case(batch, seq, seq, heads, kv_heads, head_dim, 16, dtype)
        ours = _time_ms(functools.partial(paged_attention, *args))
        base = _time_ms(functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=True,
                                          enable_gqa=True))
        causal_flops = 4 * batch * heads * seq * seq * head_dim / 2
        rows.append(_row(name, ours, base, causal_flops, "TFLOP/s", flops))
        del args, q, k, v
    return rows


def bench_small_kernels(bandwidth: float | None) -> list[str]:
    from kernels.activation import silu_and_mul, silu_and_mul_ref
    from kernels.rms_norm import rms_norm, rms_norm_ref
    from kernels.rotary import build_cos_sin_cache, rotary, rotary_ref
    from kernels.store_kv import store_kv, store_kv_ref
    dtype, tokens, hidden = torch.bfloat16, 4096, 4096
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    res = torch.randn_like(x)
    w = torch.randn(hidden, device="cuda", dtype=dtype)
    gate_up = torch.randn(tokens, 2 * 14336, device="cuda", dtype=dtype)
    q = torch.randn(tokens, 32, 128, device="cuda", dtype=dtype)
    k = torch.randn(tokens, 8, 128, device="cuda", dtype=dtype)
    cache = build_cos_sin_cache(128, 8192, 500000.0).cuda()
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    kv_cache = torch.zeros(tokens // 16 * 2, 1, 2, 16, 8, 128, device="cuda", dtype=dtype)
    slots = torch.randperm(tokens * 2, device="cuda")[:tokens]
    el = x.element_size()
    cases = [
        ("rms_norm + residual 4096x4096", lambda: rms_norm(x, w, 1e-5, res),
         lambda: rms_norm_ref(x, w, 1e-5, res), 4 * x.numel() * el),
        ("silu_and_mul 4096x14336", lambda: silu_and_mul(gate_up), lambda: silu_and_mul_ref(gate_up),
         1.5 * gate_up.numel() * el),
        ("rotary q32/k8 x128, 4096 tok", lambda: rotary(q, k, positions, cache),
         lambda: rotary_ref(q, k, positions, cache), 2 * (q.numel() + k.numel()) * el),
        ("store_kv 4096 tok", lambda: store_kv(k, k, kv_cache[:, 0, 0], kv_cache[:, 0, 1], slots),
         lambda: store_kv_ref(k, k, kv_cache[:, 0, 0], kv_cache[:, 0, 1], slots), 4 * k.numel() * el),
    ]
    return [_row(name, _time_ms(ours), _time_ms(base), nbytes, "GB/s", bandwidth)
            for name, ours, base, nbytes in cases]


def decode_fusion(layers: int = 24, replays: int = 100) -> list[dict[str, float | int | str]]:
    """A decode layer's rotary + KV store + attention as the graph of a step launches it: fused
    (``rotary_store_attention``) against the two kernels (``rotary_store_kv``, ``paged_attention``),
    ``layers`` of them captured in one CUDA graph, so launch gaps count as they do in a replayed
    decode step; and the fused kernel unsplit (``num_splits=1``: no merge kernel after it), what a
    split count chosen from the real context rather than the graph's block-table width would
    launch. Attention shapes of SmolLM2-135M and -1.7B, bf16, contexts of 256 tokens (and 1,024
    at batch 1)."""
    rows: list[dict[str, float | int | str]] = []
    for model, heads, kv_heads, head_dim in (("135M", 9, 3, 64), ("1.7B", 32, 32, 64)):
        for batch, context in ((1, 256), (1, 1024), (64, 256)):
            two, fused, unsplit = _decode_layer_calls(layers, batch, context, heads, kv_heads, head_dim)
            two_us, fused_us, unsplit_us = (_graph_us(fn, replays) / layers for fn in (two, fused, unsplit))
            rows.append(dict(model=model, batch=batch, context=context,
                             two_kernels_us_per_layer=round(two_us, 2), fused_us_per_layer=round(fused_us, 2),
                             fused_vs_two=round(two_us / fused_us, 3),
                             fused_unsplit_us_per_layer=round(unsplit_us, 2)))
    return rows


def _decode_layer_calls(layers: int, batch: int, context: int, heads: int, kv_heads: int, head_dim: int
                        ) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
    """(the two kernels, the fused one, the fused one unsplit), each ``layers`` times on one
    decode batch of ``context``-token sequences."""
    from kernels.paged_attention import paged_attention, rotary_store_attention
    from kernels.rotary import build_cos_sin_cache
    from kernels.rotary_store_kv import rotary_store_kv

    args, _ = _paged_case(batch, context, 1, heads, kv_heads, head_dim, 16, torch.bfloat16)
    query, key_cache, value_cache, block_tables, seq_lens, cu, _, scale = args
    last = context - 1
    slots = block_tables.long()[:, last // 16] * 16 + last % 16  # the last position's slot
    # as wide as a decode graph's block table (an 8K-token model), so the split count is the one
    # the engine's graphs launch with
    block_tables = torch.cat([block_tables, block_tables.new_zeros(batch, 512 - block_tables.shape[1])], 1)
    key = torch.randn(batch, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    positions = seq_lens.long() - 1
    cos_sin = build_cos_sin_cache(head_dim, 4096, 10000.0).cuda()

    def two() -> None:
        for _ in range(layers):
            rotary_store_kv(query, key, value, positions, cos_sin, key_cache, value_cache, slots)
            paged_attention(query, key_cache, value_cache, block_tables, seq_lens, cu, 1, scale)

    def fused(num_splits: int | None = None) -> None:
        for _ in range(layers):
            rotary_store_attention(query, key, value, positions, cos_sin, key_cache, value_cache, slots,
                                   block_tables, seq_lens, cu, scale, num_splits=num_splits)
    return two, fused, functools.partial(fused, 1)


def _graph_us(fn: Callable[[], None], replays: int) -> float:
    """Microseconds per replay of ``fn`` captured as one CUDA graph (after a warm-up on a side
    stream, which compiles what it launches)."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) * 1e3 / replays


def main() -> int:
    if "--cpu" in sys.argv[1:]:
        from kernels.bench_attention_cpu import main as cpu_main
        return cpu_main([a for a in sys.argv[1:] if a != "--cpu"])
    if not torch.cuda.is_available():
        print("kernels.bench needs a CUDA device (Triton kernels are timed natively); none found, "
              "nothing to measure.")
        return 0
    name = torch.cuda.get_device_name()
    bandwidth, flops = _peak(name)
    print(f"device: {name}  peak HBM {bandwidth / 1e12 if bandwidth else '?'} TB/s, "
          f"bf16 {flops / 1e12 if flops else '?'} TFLOP/s; all inputs bf16")
    print("baseline: SDPA on contiguous K/V (attention), the torch reference (other kernels)")
    print(f"{'kernel':<34} {'triton ms':>9} {'torch ms':>9} {'speedup':>8} {'achieved':>9} "
          f"{'':<7} {'of peak'}")
    for row in bench_attention(bandwidth, flops) + bench_small_kernels(bandwidth):
        print(row)
    print("decode layer's rotary + store + attention in a CUDA graph, fused vs the two kernels:")
    for fusion in decode_fusion():
        print("  " + "  ".join(f"{k}={v}" for k, v in fusion.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compile every Triton kernel for a CUDA target without a GPU (``python -m kernels.compile_check``),
and print the registers and spill bytes ptxas gives each.

The interpreter (TRITON_INTERPRET=1) runs kernels as numpy and accepts code the real compiler
rejects (loop-carried type changes, bad constexpr use), so the CPU test suite runs this too:
it lowers each kernel through Triton's NVIDIA backend down to a cubin (ptxas ships with the
triton wheel). Must run in a process without TRITON_INTERPRET set.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kernels._triton import JITFunction

TARGET_ARCH = 90  # H100 / H200


def _compile(kernel: JITFunction, pointer_types: dict[str, str], constexprs: dict[str, object]) -> str:
    """Lower ``kernel`` to a cubin for sm_90 as a launch would specialize it (pointers and
    strides 16-aligned, as the engine's tensors are: that decides vector loads); returns its
    registers and spills as ptxas reports them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = dict(constexprs)
    num_warps = constexprs.pop("num_warps", 4)  # a launch option, not a kernel argument
    signature = {}
    aligned = {}
    for index, name in enumerate(inspect.signature(kernel.fn).parameters):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, pointer_types["default"])
            aligned[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name in ("eps", "scale_log2") else "i32"
            if name.startswith("stride"):
                aligned[(index,)] = [["tt.divisibility", 16]]
    target = GPUTarget("cuda", TARGET_ARCH, 32)
    try:
        source = ASTSource(kernel, signature, constexprs=constexprs, attrs=aligned)
    except (TypeError, AttributeError):  # a triton whose ASTSource takes attrs another way
        source, aligned = ASTSource(kernel, signature, constexprs=constexprs), {}
    compiled = triton.compile(source, target=target, options={"num_warps": num_warps})
    return _resources(compiled.asm["ptx"]) + ("" if aligned else " (unaligned)")


def _resources(ptx: str) -> str:
    """``N registers, M spill bytes`` from ``ptxas -v`` (the one the triton wheel ships), or
    ``resources unknown: <why>`` where this triton's ptxas cannot be found or run that way."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        tool = get_ptxas(TARGET_ARCH)
        ptxas = tool[0] if isinstance(tool, tuple) else getattr(tool, "path", tool)
        with tempfile.TemporaryDirectory() as tmp:
            source = Path(tmp) / "kernel.ptx"
            source.write_text(ptx)
            # Triton's own flags (--regAllocOptLevel=2: its workaround for a ptxas 13 bug)
            done = subprocess.run([str(ptxas), "-v", "--regAllocOptLevel=2", f"--gpu-name=sm_{TARGET_ARCH}a",
                                   str(source), "-o", str(Path(tmp) / "kernel.cubin")],
                                  capture_output=True, text=True, check=True)
    except (ImportError, TypeError, OSError, subprocess.CalledProcessError) as exc:
        return f"resources unknown: {type(exc).__name__}: {str(exc)[:120]}"
    registers = re.search(r"Used (\d+) registers", done.stderr)
    spills = re.search(r"(\d+) bytes spill stores", done.stderr)
    if registers is None or spills is None:
        return "resources unknown: ptxas -v printed no register count"
    return f"{registers.group(1)} registers, {spills.group(1)} spill bytes"


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter replaces the kernels being compiled")
        return 2
    from kernels import (
        activation,
        block_copy,
        gemv,
        greedy,
        paged_attention,
        quant_triton,
        rms_norm,
        rotary,
        rotary_store_kv,
        store_kv,
    )

    index = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "cu_seqlens_q_ptr": "*i32",
             "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "default": "*bf16"}
    attention = dict(BLOCK_SIZE=16, HEAD_DIM_PAD=128, G_PAD=4, BLOCK_Q=4, BLOCK_M=16, TILE_N=64,
                     DOT_FP32=False, QUANT=0, ROPE_STORE=False)
    # An 8-bit cache: codes through a uint8 view, row scales through a float32 view of it.
    quant_cache = {**index, "k_cache_ptr": "*u8", "v_cache_ptr": "*u8", "k_scale_ptr": "*fp32",
                   "v_scale_ptr": "*fp32"}
    quant_store = {"key_codes_ptr": "*u8", "value_codes_ptr": "*u8", "key_scale_ptr": "*fp32",
                   "value_scale_ptr": "*fp32", "slot_ptr": "*i64", "default": "*bf16"}
    jobs: list[tuple[str, JITFunction, dict[str, str], dict[str, object]]] = [
        ("paged attention", paged_attention._paged_attention_kernel, index, {**attention, "NUM_SPLITS": 1}),
        ("paged attention split-KV", paged_attention._paged_attention_kernel, index,
         {**attention, "NUM_SPLITS": 4}),
        ("paged attention fp32 queries, bf16 cache", paged_attention._paged_attention_kernel,
         {**index, "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "default": "*fp32"},
         {**attention, "G_PAD": 4, "NUM_SPLITS": 1, "DOT_FP32": True}),
        ("paged attention int8 cache", paged_attention._paged_attention_kernel, quant_cache,
         {**attention, "NUM_SPLITS": 1, "QUANT": 1}),
        ("paged attention fp8 cache split-KV", paged_attention._paged_attention_kernel, quant_cache,
         {**attention, "NUM_SPLITS": 4, "QUANT": 2}),
        # decode: rotary + KV store in the attention launch (rotary_store_attention)
        ("paged attention + rotary + store_kv, split-KV", paged_attention._paged_attention_kernel,
         {**index, "positions_ptr": "*i64", "cos_sin_ptr": "*fp32", "slot_ptr": "*i64"},
         {**attention, "NUM_SPLITS": 16, "ROPE_STORE": True}),
        ("paged attention + rotary + store_kv, fp32", paged_attention._paged_attention_kernel,
         {**index, "positions_ptr": "*i64", "cos_sin_ptr": "*fp32", "slot_ptr": "*i64", "default": "*fp32"},
         {**attention, "NUM_SPLITS": 1, "DOT_FP32": True, "ROPE_STORE": True}),
        ("split-KV reduce", paged_attention._reduce_splits_kernel, index,
         dict(HEAD_DIM_PAD=128, NUM_SPLITS=4, SPLITS_PAD=4)),
        ("rms_norm", rms_norm._rms_norm_kernel, {"default": "*bf16"}, dict(HAS_RESIDUAL=True, BLOCK_H=1024)),
        ("silu_and_mul", activation._silu_and_mul_kernel, {"default": "*bf16"}, dict(BLOCK=1024)),
        ("rotary", rotary._rotary_kernel, {"positions_ptr": "*i64", "cos_sin_ptr": "*fp32", "default": "*bf16"},
         dict(BLOCK_HQ=16, BLOCK_HK=4, BLOCK_HALF=32)),
        ("store_kv", store_kv._store_kv_kernel, {"slot_ptr": "*i64", "default": "*bf16"},
         dict(BLOCK_H=4, BLOCK_D=64, BF16_BITS=False)),
        # --kv-cache-dtype bf16 under an fp32 model: rounded bits through an int16 view
        ("store_kv fp32 into a bf16 cache", store_kv._store_kv_kernel,
         {"slot_ptr": "*i64", "key_cache_ptr": "*i16", "value_cache_ptr": "*i16", "default": "*fp32"},
         dict(BLOCK_H=4, BLOCK_D=64, BF16_BITS=True)),
        ("rotary + store_kv", rotary_store_kv._rotary_store_kv_kernel,
         {"positions_ptr": "*i64", "cos_sin_ptr": "*fp32", "slot_ptr": "*i64", "default": "*bf16"},
         dict(BLOCK_HQ=16, BLOCK_HK=4, BLOCK_HALF=32, BF16_BITS=False)),
        ("store_kv int8", store_kv._store_kv_quant_kernel, quant_store,
         dict(BLOCK_H=4, BLOCK_D=64, QMAX=127.0, IS_FP8=False)),
        ("store_kv fp8", store_kv._store_kv_quant_kernel, quant_store,
         dict(BLOCK_H=4, BLOCK_D=64, QMAX=448.0, IS_FP8=True)),
        ("gather_blocks", block_copy._copy_blocks_kernel, {"src_ids_ptr": "*i64", "dst_ids_ptr": "*i64",
         "default": "*bf16"}, dict(SRC_INDEXED=True, DST_INDEXED=False, BLOCK=4096)),
        ("copy_blocks", block_copy._copy_blocks_kernel, {"src_ids_ptr": "*i64", "dst_ids_ptr": "*i64",
         "default": "*bf16"}, dict(SRC_INDEXED=True, DST_INDEXED=True, BLOCK=4096)),
    ]
    # the quantized GEMV, one job per block format (kernels.quant_triton.pack's tensors)
    quant_pointers = {"x_ptr": "*fp32", "out_ptr": "*fp32", "d_ptr": "*fp16", "m_ptr": "*fp16", "default": "*u8"}
    tiles = dict(BLOCK_N=quant_triton.BLOCK_N, BLOCK_K=quant_triton.BLOCK_K)
    for name, pointers, flags in (
            ("q8_0", {"qs_ptr": "*i8"}, dict(FOUR_BIT=False, K_QUANT=False, SIX_BIT=False)),
            ("q4_1", {}, dict(FOUR_BIT=True, K_QUANT=False, SIX_BIT=False)),
            ("q4_k", {}, dict(FOUR_BIT=True, K_QUANT=True, SIX_BIT=False)),
            ("q6_k", {"qs_ptr": "*i8", "sc_ptr": "*i8"}, dict(FOUR_BIT=False, K_QUANT=False, SIX_BIT=True))):
        jobs.append((f"quant GEMV {name}", quant_triton._quant_gemv_kernel, {**quant_pointers, **pointers},
                     {**flags, **tiles}))
    # the decode GEMV with each prologue, at one row and at the most rows, bf16 and fp32
    for prologue, label in ((gemv.NONE, "linear"), (gemv.RMS_NORM, "rms_norm + linear"),
                            (gemv.SILU_MUL, "silu_and_mul + linear")):
        for rows, dtype in ((1, "bf16"), (gemv.MAX_ROWS, "bf16"), (1, "fp32")):
            config = gemv.CANDIDATES[rows][0]
            jobs.append((f"GEMV {label}, {rows} row(s), {dtype}", gemv._gemv_kernel, {"default": f"*{dtype}"},
                         dict(PROLOGUE=prologue, HAS_RESIDUAL=prologue == gemv.RMS_NORM, BLOCK_M=rows,
                              BLOCK_N=config.block_n, BLOCK_K=config.block_k)))
    for dtype in ("fp32", "bf16"):
        jobs.append((f"greedy tokens, {dtype} logits", greedy._greedy_kernel,
                     {"out_ptr": "*i64", "default": f"*{dtype}"}, dict(BLOCK=greedy.BLOCK)))
    # bf16 prefill on the engine's CUDA tiles (128 query rows, 64 keys, 8 warps; _launch)
    for head_dim_pad, g_pad in ((64, 1), (128, 4)):
        jobs.append((f"paged attention bf16 prefill, head_dim {head_dim_pad}",
                     paged_attention._paged_attention_kernel, index,
                     {**attention, "HEAD_DIM_PAD": head_dim_pad, "G_PAD": g_pad, "BLOCK_Q": 128 // g_pad,
                      "BLOCK_M": 128, "TILE_N": 64, "NUM_SPLITS": 1, "num_warps": 8}))
    # fp32 prefill (exact fp32 dots) on the engine's tiles for it (paged_attention.fp32_prefill_tiles)
    for head_dim_pad, g_pad in ((64, 1), (128, 4), (256, 1)):
        block_m, tile_n, num_warps = paged_attention.fp32_prefill_tiles(head_dim_pad, g_pad)
        jobs.append((f"paged attention fp32 prefill, head_dim {head_dim_pad}",
                     paged_attention._paged_attention_kernel, {**index, "default": "*fp32"},
                     {**attention, "HEAD_DIM_PAD": head_dim_pad, "G_PAD": g_pad, "BLOCK_Q": block_m // g_pad,
                      "BLOCK_M": block_m, "TILE_N": tile_n, "NUM_SPLITS": 1, "DOT_FP32": True,
                      "num_warps": num_warps}))
    for name, kernel, pointers, constexprs in jobs:
        resources = _compile(kernel, pointers, constexprs)
        print(f"ok  {name} (sm_{TARGET_ARCH}): {resources}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Backend dispatch: one small table of callables per backend, picked once by the model.

    ops = get_ops(select_backend(device), dims)   # dims: kernels.calibration.ModelDims
    ops.rms_norm(x, weight, eps, residual=None)       -> out | (out, residual_out)
    ops.rotary(q, k, positions, cos_sin_cache)        in place
    ops.silu_and_mul(x)                               -> [N, I]
    ops.store_kv(key, value, key_cache, value_cache, slot_mapping)   in place (quantizes for an
                                                      int8 / fp8 cache: kernels.kv_quant)
    ops.rotary_store_kv(q, k, v, positions, cos_sin_cache, key_cache, value_cache, slot_mapping)
                                                      rotary then store_kv in one launch, where
                                                      fused (Triton); None: the two calls
    ops.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                        cu_seqlens_q, max_seqlen_q, scale, out=None) -> out
    ops.rotary_store_attention(q, k, v, positions, cos_sin_cache, key_cache, value_cache,
                               slot_mapping, block_tables, seq_lens, cu_seqlens_q, scale)
                                                      -> out: a decode step's (one query per
                                                      sequence) rotary_store_kv then paged_attention
                                                      in one launch, q and k left unrotated, for a
                                                      cache of q's dtype (Triton); None: the two calls
    ops.pack_linear(w_t)                              -> weight handle, once at load
    ops.linear(x, weight)                             -> x @ w_t
    ops.pack_quant(rows)                              -> handle of GGUF blocks (kernels.quant), once at load
    ops.quant_linear(x, handle)                       -> x @ the blocks' values, transposed
    ops.norm_quant_linear(x, weight, eps, residual, handle) -> (quant_linear(rms_norm(x + residual)),
                                                      x + residual) in one call; None: not fused
    ops.norm_linear(x, weight, eps, residual, handle) -> (linear(rms_norm(x + residual)), x + residual)
                                                      in one call where measured faster (Triton,
                                                      kernels.gemv); None: the two calls
    ops.silu_and_mul_linear(x, handle)                -> linear(silu_and_mul(x), handle), likewise
    ops.decoder_stack(model)                          -> the model's layers as one compiled call
                                                      (quantized weights), or None; serves steps
                                                      of up to ops.stack_max_tokens tokens
    ops.argmax_rows(logits)                           -> each row's first argmax, or None when a
                                                      row's maximum is not finite; None: torch's
                                                      (engine.sampling.sampler.argmax_rows)

'triton' runs the Triton kernels (CUDA; CPU only under TRITON_INTERPRET=1, for tests). 'cpu' is
the production fp32 CPU path: for each op and size class, whichever of the compiled kernel
(``kernels.cpu``) and torch's own op was measured faster on this machine for the model's shapes
(``kernels.calibration``; without ``dims``, the compiled kernels everywhere). 'torch' runs the
pure-torch references: the fallback where the CPU kernels cannot be built, and the oracle the
other two are tested against. All backends share one contract per op; see each kernel module's
docstring.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from kernels.op_table import Ops as Ops  # re-exported: the model types its op table as kernels.ops.Ops
from kernels.op_table import compiled_ops as compiled_ops
from kernels.op_table import torch_ops

if TYPE_CHECKING:
    from kernels.calibration import ModelDims

BACKEND_ENV = "PDSERVE_ATTENTION_BACKEND"
BACKENDS = ("triton", "cpu", "torch")


def select_backend(device: torch.device | str, dtype: torch.dtype = torch.float32) -> str:
    """``$PDSERVE_ATTENTION_BACKEND`` if set; else 'triton' on CUDA, 'cpu' for fp32 on a CPU
    where the compiled kernels build, and 'torch' elsewhere."""
    forced = os.environ.get(BACKEND_ENV)
    if forced is not None:
        if forced not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV} must be one of {'|'.join(BACKENDS)}, got {forced!r}")
        return forced
    if torch.device(device).type == "cuda":
        return "triton"
    if dtype == torch.float32:
        from kernels import cpu

        if cpu.available():
            return "cpu"
    return "torch"


def get_ops(backend: str, dims: ModelDims | None = None) -> Ops:
    """The op table of ``backend`` ('triton', 'cpu' or 'torch'); for 'cpu', ``dims``
    (``kernels.calibration.ModelDims``) selects the measured mix, None the compiled kernels."""
    if backend == "torch":
        return torch_ops()
    if backend == "cpu":
        if dims is None:
            return compiled_ops()
        from kernels.calibration import calibrate, measured_ops

        return measured_ops(calibrate(dims))
    if backend == "triton":
        from kernels import gemv
        from kernels.activation import silu_and_mul
        from kernels.paged_attention import paged_attention, rotary_store_attention
        from kernels.quant_triton import pack as pack_quant
        from kernels.quant_triton import quant_linear
        from kernels.rms_norm import rms_norm
        from kernels.rotary import rotary
        from kernels.rotary_store_kv import rotary_store_kv
        from kernels.store_kv import store_kv

        quant_device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the interpreter
        return Ops(rms_norm=rms_norm, rotary=rotary, silu_and_mul=silu_and_mul,
                   store_kv=store_kv, paged_attention=paged_attention,
                   pack_linear=gemv.pack_linear, linear=gemv.linear, norm_linear=gemv.norm_linear,
                   silu_and_mul_linear=gemv.silu_and_mul_linear,
                   pack_quant=lambda rows: pack_quant(rows, quant_device), quant_linear=quant_linear,
                   rotary_store_kv=rotary_store_kv, rotary_store_attention=rotary_store_attention)
    raise ValueError(f"backend must be one of {'|'.join(BACKENDS)}, got {backend!r}")

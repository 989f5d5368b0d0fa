"""Compile before serving: every Triton kernel variant a step can launch, and torch's matmuls at
a few step sizes, so that no request pays a compile (on an H200 the first 2,000-token prompt
took 818 ms before this, the next ones 82 ms).

The Triton kernels pick their compiled variant by constexprs only (per-step integers are not
specialized on: ``kernels/paged_attention.py``), so the variants are few: the attention's query
tiles and split counts (``paged_attention.launch_variants``) and one each for the other ops at
the model's dtype, which any forward compiles. Nothing is stored: every slot is -1. The fused
decode attention is compiled on its own (``warm_up_fused_decode``): if it fails there, decode
steps take the two kernels it fuses.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from engine.kv_cache.storage import layer_kv
from engine.mathutils import cdiv
from engine.models.llama import AttentionMetadata, LlamaForCausalLM

log = logging.getLogger(__name__)


@torch.inference_mode()
def warm_up(model: LlamaForCausalLM, kv_cache: torch.Tensor, max_num_batched_tokens: int) -> float:
    """Run the attention variants and dummy prefills of 1, 17 and ``max_num_batched_tokens``
    tokens (at most the cache's capacity) on ``kv_cache`` without writing it. Returns seconds."""
    from kernels import paged_attention

    started = time.perf_counter()
    config, device = model.config, model.device
    key_cache, value_cache = layer_kv(kv_cache, 0)
    paged_attention.warm_up(model.dtype, key_cache, value_cache, config.num_heads, config.max_model_len)
    warm_up_fused_decode(model, key_cache, value_cache)
    block_size = kv_cache.shape[3]
    capacity = min(kv_cache.shape[0] * block_size, config.max_model_len)
    for num_tokens in sorted({1, min(17, capacity), min(max_num_batched_tokens, capacity)}):
        attn = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
            block_tables=torch.zeros(1, cdiv(num_tokens, block_size), dtype=torch.int32, device=device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
            cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
            max_seqlen_q=num_tokens)
        tokens = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        positions = torch.arange(num_tokens, dtype=torch.int64, device=device)
        model.compute_logits(model.forward(tokens, positions, attn, kv_cache)[-1:])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def warm_up_fused_decode(model: LlamaForCausalLM, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Compile the fused decode attention (``kernels.paged_attention.rotary_store_attention``)
    where the model's decode steps take it. If it fails to compile or launch, the model's
    decode steps take ``rotary_store_kv`` and ``paged_attention`` instead (the same result, one
    launch more per layer) and the error is logged: a kernel variant first compiled on this
    device must not take the engine down. Returns whether decode steps take the fused kernel."""
    from kernels import paged_attention

    if model.ops.rotary_store_attention is None or key_cache.dtype != model.dtype:
        return False
    try:
        paged_attention.warm_up_fused(key_cache, value_cache, model.config.num_heads,
                                      model.config.max_model_len)
    except Exception:  # noqa: BLE001 - any failure of the fused variant: the two kernels serve
        log.exception("the fused decode attention (rotary_store_attention) failed to compile or "
                      "launch; decode steps run rotary_store_kv + paged_attention instead")
        model.ops = dataclasses.replace(model.ops, rotary_store_attention=None)
        return False
    return True


def choose_decode_matmuls(model: LlamaForCausalLM, rows: Sequence[int] | None = None) -> list[str]:
    """Time each decode matmul of the model's (q/k/v, o, gate/up, down, the LM head) as the fused
    Triton GEMV against the separate ops at each row bucket, and keep the faster per weight
    (``kernels.gemv.choose``; the runner calls this on CUDA under ``$PDSERVE_TRITON_GEMV=auto``).
    A model whose weights are not the Triton backend's dense ones has nothing to choose. If the
    timing fails, every matmul takes the separate ops and the error is logged: an optimisation
    first compiled on this device must not take the engine down. ``rows``: the row counts to time
    (default ``kernels.gemv.ROW_BUCKETS``). Returns one line per matmul and row count, for the log."""
    from kernels import gemv

    layers = model.layers
    if not layers or not isinstance(layers[0].qkv_weight, gemv.DenseWeight):
        return []
    kinds: list[tuple[str, list[Any], int, torch.Tensor | None]] = [
        ("qkv", [layer.qkv_weight for layer in layers], gemv.RMS_NORM, layers[0].input_norm),
        ("o", [layer.o_weight for layer in layers], gemv.NONE, None),
        ("gate_up", [layer.gate_up_weight for layer in layers], gemv.RMS_NORM, layers[0].post_attention_norm),
        ("down", [layer.down_weight for layer in layers], gemv.SILU_MUL, None),
        ("lm_head", [model.lm_head], gemv.NONE, None),
    ]
    lines = []
    try:
        for name, weights, prologue, norm in kinds:
            for choice in gemv.choose(weights, prologue, norm, model.config.rms_norm_eps,
                                      rows or gemv.ROW_BUCKETS):
                times = " ".join(f"{key} {seconds * 1e6:.1f}" for key, seconds in choice.seconds.items())
                picked = "unfused" if choice.config is None else f"{choice.config.block_n}x{choice.config.block_k}"
                lines.append(f"{name} rows {choice.num_rows}: {picked} (us per call: {times})")
    except Exception:  # noqa: BLE001 - any failure: the separate ops serve
        log.exception("timing the fused decode GEMV failed; every matmul takes the separate ops")
        for _, weights, _, _ in kinds:
            for weight in weights:
                weight.configs.clear()
        return ["failed: every matmul takes the separate ops (see the log)"]
    return lines

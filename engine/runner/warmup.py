"""Compile before serving: every Triton kernel variant a step can launch, and torch's matmuls at
a few step sizes, so that no request pays a compile (on an H200 the first 2,000-token prompt
took 818 ms before this, the next ones 82 ms).

The Triton kernels pick their compiled variant by constexprs only (per-step integers are not
specialized on: ``kernels/paged_attention.py``), so the variants are few: the attention's query
tiles and split counts (``paged_attention.launch_variants``) and one each for the other ops at
the model's dtype, which any forward compiles. Nothing is stored: every slot is -1.
"""

from __future__ import annotations

import time

import torch

from engine.kv_cache.storage import layer_kv
from engine.mathutils import cdiv
from engine.models.llama import AttentionMetadata, LlamaForCausalLM


@torch.inference_mode()
def warm_up(model: LlamaForCausalLM, kv_cache: torch.Tensor, max_num_batched_tokens: int) -> float:
    """Run the attention variants and dummy prefills of 1, 17 and ``max_num_batched_tokens``
    tokens (at most the cache's capacity) on ``kv_cache`` without writing it. Returns seconds."""
    from kernels import paged_attention

    started = time.perf_counter()
    config, device = model.config, model.device
    key_cache, value_cache = layer_kv(kv_cache, 0)
    paged_attention.warm_up(model.dtype, key_cache, value_cache, config.num_heads, config.max_model_len)
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

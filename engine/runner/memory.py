"""The KV cache's size on CUDA: a fraction of the GPU's memory, less the weights and the
activation peak of the largest step, measured by running one.

    budget = total * gpu_memory_utilization - peak
    peak   = torch's allocated bytes at the top of a dummy step of max_num_batched_tokens tokens
             (in sequences of at most max_model_len)
             (the weights are allocated by then, so they are in it) whose logits are taken for
             max_num_seqs rows and soft-maxed (what a full decode batch samples from)

The budget must also fit what is free on the device now, with the activations' share on top:
another process on the GPU (a second worker) holds memory this one cannot use. ``pdserve up``
divides the fraction among the engine processes that share one GPU.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from engine.config import CacheConfig, ConfigError, ModelConfig
from engine.kv_cache.storage import allocate_kv_cache, bytes_per_block
from engine.mathutils import cdiv
from engine.models.llama import AttentionMetadata, LlamaForCausalLM

log = logging.getLogger(__name__)
GIB = 2**30


def kv_cache_budget(total_bytes: int, free_bytes: int, utilization: float, peak_bytes: int,
                    activation_bytes: int) -> int:
    """Bytes for the KV cache (pure: the numbers come from ``profile_gpu_memory``).

    total_bytes / free_bytes: the device's (``torch.cuda.mem_get_info``), free measured after the
    profile with the allocator's cache emptied; peak_bytes: this process's allocated peak during
    the profile, weights included; activation_bytes: the part of the peak the steps allocate
    again (peak less what stays resident). ConfigError, naming what to change, when nothing fits."""
    budget = int(total_bytes * utilization) - peak_bytes
    if budget <= 0:
        raise ConfigError(
            f"gpu_memory_utilization {utilization} gives {total_bytes * utilization / GIB:.2f} GiB, but the "
            f"weights and the activation peak take {peak_bytes / GIB:.2f} GiB: raise "
            f"--gpu-memory-utilization or lower --max-num-batched-tokens / --max-num-seqs")
    if budget + activation_bytes > free_bytes:
        raise ConfigError(
            f"a KV cache of {budget / GIB:.2f} GiB (gpu_memory_utilization {utilization}) and "
            f"{activation_bytes / GIB:.2f} GiB of activations do not fit the {free_bytes / GIB:.2f} GiB "
            f"free on the GPU (another process holds memory?): lower --gpu-memory-utilization, or set "
            f"--kv-cache-memory / --num-kv-blocks")
    return budget


def dummy_step(num_tokens: int, max_model_len: int, block_size: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(tokens, positions, metadata) of a prefill step of ``num_tokens`` tokens that stores
    nothing (every slot -1): sequences of at most ``max_model_len`` tokens, as the scheduler
    would build it (a position past max_model_len would read past the rotary table), each
    reading blocks 0.. of a cache of ``cdiv(min(num_tokens, max_model_len), block_size)`` blocks."""
    longest = min(num_tokens, max_model_len)
    lengths = [longest] * (num_tokens // longest) + ([num_tokens % longest] if num_tokens % longest else [])
    cu_seqlens = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths])
    attn = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        block_tables=torch.arange(cdiv(longest, block_size), dtype=torch.int32).repeat(len(lengths), 1).to(device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        cu_seqlens_q=cu_seqlens.to(device), max_seqlen_q=longest)
    return torch.zeros(num_tokens, dtype=torch.int64, device=device), positions.to(device), attn


@torch.inference_mode()
def profile_gpu_memory(model: LlamaForCausalLM, cache: CacheConfig, max_num_batched_tokens: int,
                       max_num_seqs: int) -> tuple[int, int]:
    """(peak, activation) bytes of the largest step, run on dummy tokens over a scratch cache
    (``dummy_step``: nothing is stored)."""
    device = model.device
    num_tokens = max(max_num_batched_tokens, max_num_seqs)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    resident = torch.cuda.memory_allocated(device)
    tokens, positions, attn = dummy_step(num_tokens, model.config.max_model_len, cache.block_size, device)
    scratch = _scratch_cache(model.config, cache, attn.block_tables.shape[1], device)
    hidden = model.forward(tokens, positions, attn, scratch)
    torch.softmax(model.compute_logits(hidden[:max_num_seqs]), dim=-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - scratch.numel() * scratch.element_size()
    del scratch, hidden
    torch.cuda.empty_cache()
    return peak, peak - resident


def gpu_kv_blocks(model: LlamaForCausalLM, cache: CacheConfig, max_num_batched_tokens: int,
                  max_num_seqs: int) -> int:
    """How many KV blocks ``cache.gpu_memory_utilization`` of the GPU holds next to ``model``."""
    assert cache.gpu_memory_utilization is not None
    peak, activation = profile_gpu_memory(model, cache, max_num_batched_tokens, max_num_seqs)
    free, total = torch.cuda.mem_get_info(model.device)
    budget = kv_cache_budget(total, free, cache.gpu_memory_utilization, peak, activation)
    num_blocks = budget // bytes_per_block(model.config, cache)
    log.info("KV cache: %d blocks (%.2f GiB) from gpu_memory_utilization %.2f of %.1f GiB; weights and "
             "activation peak %.2f GiB", num_blocks, budget / GIB, cache.gpu_memory_utilization,
             total / GIB, peak / GIB)
    return num_blocks


def _scratch_cache(config: ModelConfig, cache: CacheConfig, num_blocks: int,
                   device: torch.device) -> torch.Tensor:
    return allocate_kv_cache(config, replace(cache, num_blocks=num_blocks), device)

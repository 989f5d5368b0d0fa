"""The KV cache's share of GPU memory (engine/runner/memory.py): the pure budget, its refusals.
The profile itself (a dummy step on CUDA) runs where CUDA is present."""

from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError
from engine.runner.memory import GIB, kv_cache_budget


def test_the_budget_is_the_fraction_less_the_peak():
    # an H200-sized device: 140 GiB, 0.9 of it, 4 GiB of weights + 2 GiB of activations at the peak
    assert kv_cache_budget(140 * GIB, 139 * GIB, 0.9, 6 * GIB, 2 * GIB) == int(140 * GIB * 0.9) - 6 * GIB


def test_a_fraction_too_small_for_the_weights_names_the_flags():
    with pytest.raises(ConfigError, match=r"gives 1\.40 GiB, but the weights and the activation peak take "
                                          r"6\.00 GiB: raise --gpu-memory-utilization"):
        kv_cache_budget(140 * GIB, 139 * GIB, 0.01, 6 * GIB, 2 * GIB)


def test_memory_another_process_holds_is_not_taken():
    # a second worker on the same GPU already holds 100 GiB: 0.9 of the device no longer fits
    with pytest.raises(ConfigError, match=r"do not fit the 40\.00 GiB free on the GPU .* lower "
                                          r"--gpu-memory-utilization"):
        kv_cache_budget(140 * GIB, 40 * GIB, 0.9, 6 * GIB, 2 * GIB)
    assert kv_cache_budget(140 * GIB, 40 * GIB, 0.25, 6 * GIB, 2 * GIB) == int(140 * GIB * 0.25) - 6 * GIB


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="profiles a step on a CUDA device")
def test_the_profile_sees_the_weights_and_a_step(tmp_path):
    from engine.config import CacheConfig
    from engine.models.llama import LlamaForCausalLM
    from engine.runner.memory import gpu_kv_blocks
    from kernels.ops import get_ops
    from tests.unit.test_cuda_graphs import CONFIG, random_weights

    model = LlamaForCausalLM(CONFIG, random_weights(CONFIG), get_ops("triton"), "cuda")
    blocks = gpu_kv_blocks(model, CacheConfig(block_size=16, gpu_memory_utilization=0.05), 512, 16)
    _, total = torch.cuda.mem_get_info()
    block_bytes = 2 * CONFIG.num_layers * 16 * CONFIG.num_kv_heads * CONFIG.head_dim * 4
    assert 0 < blocks and blocks * block_bytes <= 0.05 * total


def test_the_profile_step_keeps_every_position_inside_max_model_len():
    # max_num_batched_tokens (150) past max_model_len (64): on an H100 one 8192-token sequence
    # with max_model_len 4096 read past the rotary table (an illegal memory access)
    from engine.models.llama import LlamaForCausalLM
    from engine.runner.memory import dummy_step
    from kernels.ops import get_ops
    from tests.unit.test_cuda_graphs import CONFIG, random_weights

    tokens, positions, attn = dummy_step(150, CONFIG.max_model_len, 4, torch.device("cpu"))
    assert attn.seq_lens.tolist() == [64, 64, 22] and attn.cu_seqlens_q.tolist() == [0, 64, 128, 150]
    assert positions.tolist() == [*range(64), *range(64), *range(22)] and len(tokens) == 150
    assert attn.block_tables.shape == (3, 16) and attn.max_seqlen_q == 64
    assert (attn.slot_mapping == -1).all()
    model = LlamaForCausalLM(CONFIG, random_weights(CONFIG), get_ops("torch"), "cpu")
    from engine.config import CacheConfig
    from engine.kv_cache.storage import allocate_kv_cache

    scratch = allocate_kv_cache(CONFIG, CacheConfig(block_size=4, num_blocks=16), torch.device("cpu"))
    hidden = model.forward(tokens, positions, attn, scratch)
    assert hidden.shape == (150, CONFIG.hidden_size) and torch.isfinite(hidden).all()
    assert not scratch.any()  # nothing stored
    short = dummy_step(10, 64, 4, torch.device("cpu"))[2]
    assert short.seq_lens.tolist() == [10] and short.block_tables.shape == (1, 3)

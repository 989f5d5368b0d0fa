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

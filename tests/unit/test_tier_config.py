"""The host tier's settings and cost model: --cpu-offload-gb validation and sizing, and the
measured load-versus-recompute decision (engine/kv_cache/tiers/load_cost.py)."""

from __future__ import annotations

import pytest

from engine.args import EngineArgs
from engine.config import CacheConfig, ConfigError, ModelConfig, Role
from engine.kv_cache.storage import host_pool_num_blocks
from engine.kv_cache.tiers.load_cost import LoadCostDefaults, LoadCostModel

MODEL = ModelConfig(architecture="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan")])
def test_cpu_offload_gb_must_be_finite_and_not_negative(bad):
    with pytest.raises(ConfigError, match="cpu_offload_gb must be a finite number >= 0"):
        EngineArgs(cpu_offload_gb=bad).build(MODEL, Role.COLOCATED)
    with pytest.raises(ConfigError, match="cpu_offload_bytes must be >= 0"):
        CacheConfig(cpu_offload_bytes=-1)


def test_host_pool_size():
    assert EngineArgs(cpu_offload_gb=0.5).build(MODEL, Role.DECODE).cache.cpu_offload_bytes == 2**29
    assert host_pool_num_blocks(CacheConfig(cpu_offload_bytes=10_000), 1_000, 64) == 10
    assert host_pool_num_blocks(CacheConfig(cpu_offload_bytes=0), 1_000, 64) == 0  # off
    assert host_pool_num_blocks(CacheConfig(cpu_offload_bytes=999), 1_000, 64) == 0  # fits no block: off
    # Default: twice the device pool, unless a quarter of free memory is less.
    assert host_pool_num_blocks(CacheConfig(), 1_000, 64) == 128
    assert 0 < host_pool_num_blocks(CacheConfig(), 2**30, 2**20) < 2**20


def test_load_only_when_measured_faster_than_recompute():
    cost = LoadCostModel(16, LoadCostDefaults(load_us_per_block=200.0, prefill_tok_s=1000.0, smoothing=0.5))
    assert cost.recompute_us_per_block == 16_000.0
    assert cost.should_load(3) and not cost.should_load(0)
    cost.observe_load(2, 0.1)  # 50 ms per block: the average moves halfway
    assert cost.load_us_per_block == pytest.approx(25_100.0)
    assert not cost.should_load(3)
    cost.observe_prefill(100, 1.0)  # 100 tok/s: recompute now costs 160 ms per block
    assert cost.prefill_tok_s == pytest.approx(550.0)
    assert cost.should_load(3)
    cost.observe_load(0, 1.0)
    cost.observe_prefill(10, 0.0)  # nothing to learn from empty or instant observations
    assert (cost.load_us_per_block, cost.prefill_tok_s) == (pytest.approx(25_100.0), pytest.approx(550.0))
    with pytest.raises(ValueError, match="block_size must be positive"):
        LoadCostModel(0)

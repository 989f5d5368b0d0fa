"""The int8 / fp8 KV cache outside the kernels: its size, its compatibility hash, the packed
bytes of a transfer, the kvstore keyed by compat, and the host tier's round trip in the real
engine. A quantized block is the same contiguous region as before, only smaller, with the
row scales inside it; nothing that moves blocks may mix it up with a float one."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch

from engine.args import EngineArgs
from engine.config import CacheConfig, ModelConfig, Role
from engine.core import EngineCore
from engine.kv_cache.hashing import BlockHash
from engine.kv_cache.quant_format import bytes_per_token
from engine.kv_cache.storage import allocate_kv_cache, bytes_per_block
from engine.kv_cache.tiers.host_tier import HostTier
from engine.kv_transfer.base import KVCompat, KVRegion, KVTransferError
from engine.kv_transfer.packing import iter_chunks, pack_blocks, write_packed_range
from engine.sampling_params import SamplingParams
from kernels.kv_quant import quantize_rows
from services.kvstore.region import block_bytes_of
from services.kvstore.store import BlockStore, KVStoreConfig
from tests.engine_runs import run_alone

# SmolLM2-135M's KV shape: 30 layers, 3 KV heads, head_dim 64
SMOL = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                   num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, name="SmolLM2-135M-Instruct")


def test_bytes_per_token_int8_is_fp32_over_3_76():
    fp32 = bytes_per_token("float32", 30, 3, 64, 4)
    int8 = bytes_per_token("int8", 30, 3, 64, 1)
    assert (fp32, int8) == (46080, 12240)  # 30 x 2 x 3 x (64 codes + 4 scale bytes)
    assert bytes_per_block(SMOL, CacheConfig(dtype="int8")) == 16 * int8
    assert bytes_per_block(SMOL, CacheConfig(dtype="float8_e4m3fn")) == 16 * int8
    assert bytes_per_block(SMOL, CacheConfig(dtype="float32")) == 16 * fp32
    assert round(fp32 / int8, 3) == 3.765


def test_compat_of_a_quantized_cache_names_its_dtype_and_refuses_a_float_peer():
    cache = allocate_kv_cache(SMOL, CacheConfig(num_blocks=2, dtype="int8"))
    assert tuple(cache.shape) == (2, 30, 2, 16, 3, 68) and cache.dtype == torch.int8
    compat = KVCompat.from_kv_cache(SMOL.name, cache)
    assert (compat.dtype, compat.head_dim, compat.block_shape) == ("int8", 64, (30, 2, 16, 3, 68))
    assert KVRegion.of(cache).block_bytes == bytes_per_block(SMOL, CacheConfig(dtype="int8"))
    fp32 = KVCompat.from_kv_cache(SMOL.name, allocate_kv_cache(SMOL, CacheConfig(num_blocks=2)))
    fp8 = KVCompat.from_kv_cache(SMOL.name, allocate_kv_cache(SMOL, CacheConfig(num_blocks=2,
                                                                                dtype="float8_e4m3fn")))
    assert len({compat.hash, fp32.hash, fp8.hash}) == 3
    with pytest.raises(KVTransferError, match="dtype: receiver='int8' sender='float32'") as err:
        compat.check_matches(fp32, sides=("receiver", "sender"))
    assert "head_dim" not in str(err.value) and "--kv-cache-dtype" in str(err.value)


def test_a_bf16_cache_is_half_of_fp32_and_refuses_a_float32_peer():
    fp32 = bytes_per_token("float32", 30, 3, 64, 4)
    assert bytes_per_token("bfloat16", 30, 3, 64, 2) * 2 == fp32
    assert bytes_per_block(SMOL, CacheConfig(dtype="bfloat16")) * 2 == bytes_per_block(SMOL, CacheConfig())
    cache = allocate_kv_cache(SMOL, CacheConfig(num_blocks=2, dtype="bfloat16"))
    assert tuple(cache.shape) == (2, 30, 2, 16, 3, 64) and cache.dtype == torch.bfloat16
    bf16 = KVCompat.from_kv_cache(SMOL.name, cache)
    assert (bf16.dtype, bf16.head_dim, bf16.block_shape) == ("bfloat16", 64, (30, 2, 16, 3, 64))
    float32 = KVCompat.from_kv_cache(SMOL.name, allocate_kv_cache(SMOL, CacheConfig(num_blocks=2)))
    assert bf16.hash != float32.hash
    with pytest.raises(KVTransferError, match="dtype: receiver='float32' sender='bfloat16'"):
        float32.check_matches(bf16, sides=("receiver", "sender"))


def test_packed_blocks_carry_codes_and_scales_exactly():
    gen = torch.Generator().manual_seed(0)
    src = quantize_rows(torch.randn(6, 2, 2, 4, 3, 64, generator=gen), torch.int8)
    dst = torch.zeros_like(src)
    packed = pack_blocks(src, [4, 1, 2])
    assert packed.numel() == 3 * src[0].numel()  # 1 byte per element: codes and scale bytes
    for offset, chunk in iter_chunks(packed, 1000):  # chunks that split rows and scales
        write_packed_range(dst, [0, 5, 3], offset, chunk)
    assert torch.equal(dst[[0, 5, 3]], src[[4, 1, 2]])


def _hash(i: int) -> BlockHash:
    return BlockHash(hashlib.sha256(str(i).encode()).digest())


def test_the_kvstore_keeps_int8_and_fp32_blocks_apart():
    fp32 = KVCompat("tiny", "float32", 4, 2, 1, 8)
    int8 = dataclasses.replace(fp32, dtype="int8")
    assert (block_bytes_of(fp32), block_bytes_of(int8)) == (2 * 2 * 4 * 8 * 4, 2 * 2 * 4 * 12)
    store = BlockStore(KVStoreConfig(capacity_bytes=1 << 20))
    store.register(fp32)
    store.register(int8)
    store.put(fp32.hash, [_hash(1)], None, [1, 2, 3, 4], bytes(block_bytes_of(fp32)))
    assert store.lookup(fp32.hash, [_hash(1)]) == (1, [True])
    assert store.lookup(int8.hash, [_hash(1)]) == (0, [False])  # same tokens, other format: a miss
    with pytest.raises(ValueError):
        store.put(int8.hash, [_hash(1)], None, [1, 2, 3, 4], bytes(block_bytes_of(fp32)))


BS = 8
PROMPT_A = [(7 * i + 3) % 4000 + 100 for i in range(28)]  # 3 full blocks + 4 tokens
PROMPT_B = [(11 * i + 5) % 4000 + 200 for i in range(28)]


@pytest.mark.slow
def test_int8_blocks_evicted_to_the_host_tier_come_back_exactly(loaded_model):
    """A pool of 4 int8 blocks: B evicts A to the host tier; A's greedy tokens from the host
    tier equal its cold ones (the host copy holds the codes and scales byte for byte)."""
    block_bytes = 30 * 2 * BS * 3 * 68
    args = EngineArgs(block_size=BS, num_kv_blocks=4, max_num_batched_tokens=64, kv_cache_dtype="int8",
                      cpu_offload_gb=16 * block_bytes / 2**30)
    core = EngineCore(args.build(loaded_model.config, Role.COLOCATED), loaded_model)
    assert isinstance(core.host_tier, HostTier) and core.runner.kv_cache.dtype == torch.int8
    assert core.host_tier.host_pool.kv_cache.dtype == torch.int8
    params = SamplingParams(temperature=0.0, max_tokens=3)

    def run(request_id: str, prompt: list[int]) -> tuple[list[int], int]:
        return run_alone(core, request_id, prompt, params)

    cold_a, hit = run("a0", PROMPT_A)
    assert hit == 0
    cold_b, _ = run("b0", PROMPT_B)  # evicts A's blocks to the host
    assert run("a1", PROMPT_A) == (cold_a, 3 * BS)  # from the host tier
    assert run("b1", PROMPT_B) == (cold_b, 3 * BS)


def test_a_quantized_cache_on_the_cpu_backend_uses_the_compiled_store_and_attention():
    from engine.runner.model_runner import kv_quant_ops
    from kernels.cpu import available
    from kernels.ops import compiled_ops, get_ops

    torch_ops = get_ops("torch")
    assert kv_quant_ops(torch_ops, "torch") is torch_ops  # the references read int8 as they are
    if not available():
        pytest.skip("no compiled CPU kernels here")
    ops = kv_quant_ops(torch_ops, "cpu")  # whatever the calibration picked for fp32
    compiled = compiled_ops()
    assert (ops.store_kv, ops.paged_attention) == (compiled.store_kv, compiled.paged_attention)
    assert ops.linear is torch_ops.linear

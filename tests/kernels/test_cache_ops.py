"""store_kv and the block copies, on strided views of the engine's 6-d cache."""

from __future__ import annotations

import pytest
import torch

from kernels.block_copy import (
    copy_blocks,
    copy_blocks_ref,
    gather_blocks,
    gather_blocks_ref,
    scatter_blocks,
    scatter_blocks_ref,
)
from kernels.store_kv import store_kv, store_kv_ref
from tests.kernels.helpers import DEVICE, make_kv_cache, requires_triton

LAYER = 1


def test_store_kv_reference_writes_slots_and_skips_padding():
    kv_cache = make_kv_cache(6, 4, 2, 8, torch.float32)
    before = kv_cache.clone()
    key, value = torch.randn(3, 2, 8, device=DEVICE), torch.randn(3, 2, 8, device=DEVICE)
    slots = torch.tensor([9, -1, 20], device=DEVICE)  # block 2 offset 1; padding; block 5 offset 0
    store_kv_ref(key, value, kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1], slots)
    assert torch.equal(kv_cache[2, LAYER, 0, 1], key[0]) and torch.equal(kv_cache[2, LAYER, 1, 1], value[0])
    assert torch.equal(kv_cache[5, LAYER, 0, 0], key[2]) and torch.equal(kv_cache[5, LAYER, 1, 0], value[2])
    kv_cache[2, LAYER, :, 1] = before[2, LAYER, :, 1]
    kv_cache[5, LAYER, :, 0] = before[5, LAYER, :, 0]
    assert torch.equal(kv_cache, before)  # nothing else moved, other layers untouched


@requires_triton
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_triton_matches_reference(block_size, dtype):
    kv_cache = make_kv_cache(8, block_size, 3, 16, dtype)
    expected = kv_cache.clone()
    key, value = torch.randn(2, 11, 3, 16, device=DEVICE).to(dtype)
    slots = torch.randperm(8 * block_size)[:11].to(DEVICE)
    slots[[2, 7]] = -1
    store_kv(key, value, kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1], slots)
    store_kv_ref(key, value, expected[:, LAYER, 0], expected[:, LAYER, 1], slots)
    assert torch.equal(kv_cache, expected)


@requires_triton
def test_store_kv_triton_casts_to_cache_dtype():
    kv_cache = make_kv_cache(2, 16, 1, 16, torch.float16)
    expected = kv_cache.clone()
    key, value = torch.randn(2, 3, 1, 16, device=DEVICE)
    slots = torch.tensor([0, 17, 31], device=DEVICE)
    store_kv(key, value, kv_cache[:, 0, 0], kv_cache[:, 0, 1], slots)
    store_kv_ref(key, value, expected[:, 0, 0], expected[:, 0, 1], slots)
    assert torch.equal(kv_cache, expected)


def test_block_copy_references_round_trip():
    kv_cache = make_kv_cache(10, 4, 2, 8, torch.float32)
    src = torch.tensor([7, 2, 4], device=DEVICE)
    packed = gather_blocks_ref(kv_cache, src)
    assert packed.shape == (3, kv_cache[0].numel()) and packed.is_contiguous()
    assert torch.equal(packed[1], kv_cache[2].flatten())
    dst = torch.tensor([0, 9, 5], device=DEVICE)
    scatter_blocks_ref(packed, kv_cache, dst)
    assert torch.equal(kv_cache[dst], kv_cache[src])
    copy_blocks_ref(kv_cache, torch.tensor([1], device=DEVICE), torch.tensor([3], device=DEVICE))
    assert torch.equal(kv_cache[3], kv_cache[1])


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_block_copy_triton_matches_reference(dtype):
    kv_cache = make_kv_cache(12, 16, 2, 16, dtype, num_layers=3)
    src = torch.tensor([11, 0, 5, 6], device=DEVICE)
    packed = gather_blocks(kv_cache, src)
    assert torch.equal(packed, gather_blocks_ref(kv_cache, src))

    dst = torch.tensor([1, 3, 9, 2], device=DEVICE)
    ours, ref = kv_cache.clone(), kv_cache.clone()
    scatter_blocks(packed, ours, dst)
    scatter_blocks_ref(packed, ref, dst)
    assert torch.equal(ours, ref)

    copy_blocks(ours, torch.tensor([4, 7], device=DEVICE), torch.tensor([8, 10], device=DEVICE))
    copy_blocks_ref(ref, torch.tensor([4, 7], device=DEVICE), torch.tensor([8, 10], device=DEVICE))
    assert torch.equal(ours, ref)


@requires_triton
def test_gather_blocks_triton_on_strided_block_dim():
    # blocks spaced apart (stride(0) > block_numel), each still contiguous
    base = torch.randn(6, 2 * 64, device=DEVICE)
    kv_cache = base[:, :64].view(6, 2, 2, 16)
    ids = torch.tensor([5, 1], device=DEVICE)
    assert torch.equal(gather_blocks(kv_cache, ids), gather_blocks_ref(kv_cache, ids))

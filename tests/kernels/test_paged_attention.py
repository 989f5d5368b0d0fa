"""Paged attention: the torch reference against a dense SDPA oracle, and the Triton kernel
against the reference, over ragged batches mixing every query shape the engine produces."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels.paged_attention import paged_attention, paged_attention_ref
from tests.kernels.helpers import (
    DEVICE,
    assert_close,
    dense_attention,
    draw_attention_batch,
    make_attention_case,
    requires_triton,
)

# (seq_lens, query_lens): each batch mixes decode (q_len 1), a single-token context, chunks that
# end exactly on a block boundary (64, 32 with block sizes 16 and 32), prefill on a cached
# prefix, whole-prompt prefill (q_len == seq_len) and spec verification (q_len 4).
MIXED = ([37, 1, 64, 50, 24, 90, 16], [1, 1, 32, 20, 24, 4, 1])
DECODE_RAGGED = ([1, 300, 16, 33, 129], [1, 1, 1, 1, 1])
GQA = [(4, 4), (6, 2), (8, 1)]  # (num_heads, num_kv_heads): ratios 1, 3 and 8


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("lens", [MIXED, DECODE_RAGGED], ids=["mixed", "decode"])
def test_reference_matches_dense_sdpa(lens, num_heads, num_kv_heads, block_size):
    case = make_attention_case(*lens, num_heads, num_kv_heads, 32, block_size)
    assert_close(paged_attention_ref(*case.args()), dense_attention(case), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_matches_dense_sdpa_half(dtype):
    case = make_attention_case(*MIXED, 6, 2, 32, 16, dtype)
    out = paged_attention_ref(*case.args())
    assert out.dtype == dtype
    assert_close(out, dense_attention(case), dtype)


@requires_triton
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
def test_triton_matches_reference_mixed(num_heads, num_kv_heads, block_size):
    case = make_attention_case(*MIXED, num_heads, num_kv_heads, 32, block_size)
    assert_close(paged_attention(*case.args()), paged_attention_ref(*case.args()), torch.float32)


@requires_triton
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
def test_triton_matches_reference_decode_ragged(num_heads, num_kv_heads):
    case = make_attention_case(*DECODE_RAGGED, num_heads, num_kv_heads, 64, 16)
    assert_close(paged_attention(*case.args()), paged_attention_ref(*case.args()), torch.float32)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_matches_reference_half(dtype):
    case = make_attention_case(*MIXED, 6, 2, 64, 16, dtype)
    out = paged_attention(*case.args())
    assert out.dtype == dtype
    assert_close(out, paged_attention_ref(*case.args()), dtype)


@requires_triton
@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_split_kv(num_splits, dtype):
    # decode and spec verification over long contexts; 8 splits leave some splits empty for the
    # short sequences (they must contribute nothing)
    case = make_attention_case([300, 1, 200, 47], [1, 1, 4, 2], 6, 2, 32, 16, dtype)
    out = paged_attention(*case.args(), num_splits=num_splits)
    assert_close(out, paged_attention_ref(*case.args()), dtype)


@requires_triton
def test_triton_cache_dtype_differs_from_query():
    # e.g. an fp32 model over a bf16 cache: K/V tiles are cast to the query dtype after loading
    case = make_attention_case(*MIXED, 6, 2, 32, 16, torch.bfloat16)
    case.query = case.query.float()
    out = paged_attention(*case.args())
    assert out.dtype == torch.float32
    assert_close(out, paged_attention_ref(*case.args()), torch.float32)


@requires_triton
@pytest.mark.parametrize("tile_n", [16, 64])
def test_triton_tile_smaller_and_larger_than_block(tile_n):
    case = make_attention_case(*MIXED, 6, 2, 32, 32)
    out = paged_attention(*case.args(), tile_n=tile_n)
    assert_close(out, paged_attention_ref(*case.args()), torch.float32)


@requires_triton
def test_triton_strided_query_and_out():
    # query as the engine slices it from a fused qkv projection; out a view into a wider buffer
    case = make_attention_case(*MIXED, 6, 2, 32, 16)
    num_tokens = case.query.shape[0]
    qkv = torch.randn(num_tokens, 10 * 32, device=DEVICE)
    qkv[:, : 6 * 32] = case.query.reshape(num_tokens, -1)
    case.query = qkv[:, : 6 * 32].view(num_tokens, 6, 32)
    wide = torch.full((num_tokens, 8, 32), 7.0, device=DEVICE)
    returned = paged_attention(*case.args(), out=wide[:, 1:7])
    assert returned.data_ptr() == wide[:, 1:7].data_ptr()
    assert_close(wide[:, 1:7], paged_attention_ref(*case.args()), torch.float32)
    assert bool((wide[:, 0] == 7).all()) and bool((wide[:, 7] == 7).all())


@requires_triton
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_triton_matches_reference_random_batches(data):
    batch = draw_attention_batch(data, long_query=17, head_groups=[(1, 1), (2, 3), (1, 8), (3, 2)],
                                 block_sizes=[16, 32])
    num_splits = data.draw(st.sampled_from([1, 1, 4]))
    case = make_attention_case(head_dim=16, **batch)
    assert_close(paged_attention(*case.args(), num_splits=num_splits),
                 paged_attention_ref(*case.args()), torch.float32)


@pytest.mark.parametrize("impl", [paged_attention_ref, pytest.param(paged_attention, marks=requires_triton)])
def test_writes_into_out_and_skips_empty_queries(impl):
    # a sequence with zero query tokens this step contributes no rows and is not an error
    case = make_attention_case([20, 9, 33], [2, 0, 1], 4, 2, 32, 16)
    out = torch.zeros_like(case.query)
    assert impl(*case.args(), out=out) is out
    assert_close(out, dense_attention(case), torch.float32)


def test_launch_variants_cover_every_tile_and_split(monkeypatch):
    from kernels import paged_attention as module

    monkeypatch.setattr(module, "_num_sms", lambda device: 132)  # an H100's; pure host code below
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert module.launch_variants(9, 3, cpu, 2048) == [(1, 1), (17, 1)]  # query tiles of 16 and 64 rows
    for heads, kv_heads in ((32, 32), (9, 3), (32, 8)):
        g_pad = 1 << (heads // kv_heads - 1).bit_length()
        variants = module.launch_variants(heads, kv_heads, cuda, 8192)
        tiles = {module._block_m(q, g_pad, cuda) for q in range(1, 600)}
        assert tiles == {module._block_m(q, g_pad, cuda) for q, s in variants if s == 1}
        # every split count the heuristic can choose for a short query is a warmed one
        splits = {module._auto_num_splits(cuda, programs, context, 1) for programs in range(1, 300)
                  for context in range(16, 8193, 16)}
        assert splits <= {s for _, s in variants} and 1 in splits and 16 in splits
    assert module.launch_variants(32, 32, cuda, 8192) == [(1, 1), (65, 1), (129, 1), (1, 2), (1, 4), (1, 8),
                                                          (1, 16)]


@requires_triton
def test_warm_up_compiles_each_variant_on_a_small_cache():
    from kernels.paged_attention import warm_up, warm_up_fused

    cache = torch.zeros(4, 1, 2, 8, 3, 64, device=DEVICE)
    unfused = 2 if DEVICE.type == "cpu" else 3  # query tiles of 16, 64 (and 128 rows on CUDA)
    assert warm_up(torch.float32, cache[:, 0, 0], cache[:, 0, 1], 9, 128) == unfused
    assert warm_up(torch.bfloat16, cache[:, 0, 0], cache[:, 0, 1], 9, 128) == unfused
    # the fused decode variant (rotary_store_attention): one per single-query tile (unsplit here)
    assert warm_up_fused(cache[:, 0, 0], cache[:, 0, 1], 9, 128) == 1
    assert torch.count_nonzero(cache) == 0  # nothing stored

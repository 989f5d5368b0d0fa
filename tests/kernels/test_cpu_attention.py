"""The compiled CPU paged attention (kernels/cpu/attention.py) against the torch reference, over
ragged batches mixing decode, spec verification, chunked prefill and whole prompts, GQA ratios,
block sizes, strided layer views and junk block-table entries; and its argument checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels.cpu import CpuKernelsUnavailable, library
from kernels.kv_quant import quantize_rows
from kernels.paged_attention_ref import paged_attention_ref
from tests.kernels.helpers import draw_attention_batch

try:
    library("attention")
except CpuKernelsUnavailable as exc:  # no C++ compiler here: the engine falls back to the reference
    pytest.skip(str(exc), allow_module_level=True)

from kernels.cpu import attention  # noqa: E402
from kernels.cpu.attention import paged_attention  # noqa: E402
from kernels.cpu.linear import LANES  # noqa: E402  (the vector width of this ISA's build)

GQA = [(4, 4), (9, 3), (8, 1)]  # (num_heads, num_kv_heads): group 1, 3 (SmolLM2) and 8
DECODE_RAGGED = ([1, 300, 16, 33, 129, 17], [1] * 6)
# decode, a single-token context, a chunk ending on a block boundary, prefill on a cached prefix,
# whole-prompt prefill (q_len == seq_len, 24 rows: a 16-row and an 8-row tile), spec verification (4)
MIXED = ([37, 1, 64, 50, 24, 90, 16], [1, 1, 32, 20, 24, 4, 1])
SPEC_VERIFY = ([42, 43, 44, 45, 46, 47, 48], [2, 3, 4, 5, 6, 7, 8])


def make_case(seq_lens: list[int], query_lens: list[int], num_heads: int, num_kv_heads: int,
              head_dim: int = 64, block_size: int = 16, seed: int = 0,
              index_dtype: torch.dtype = torch.int32) -> tuple:
    """Arguments of paged_attention: K/V are the layer-1 views of a 3-layer engine-layout cache,
    block ids are shuffled, and table entries past each sequence's last block hold -1, an id
    past the cache, or a stale id of another sequence's block."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    kv_cache = torch.randn(num_blocks, 3, 2, block_size, num_kv_heads, head_dim, generator=gen)
    ids = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 2), -1, dtype=index_dtype)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = ids[used:used + n]
        block_tables[i, n + 1] = [10**6, int(ids[0])][i % 2]
        used += n
    cu_seqlens_q = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=index_dtype)
    query = torch.randn(int(cu_seqlens_q[-1]), num_heads, head_dim, generator=gen)
    return (query, kv_cache[:, 1, 0], kv_cache[:, 1, 1], block_tables,
            torch.tensor(seq_lens, dtype=index_dtype), cu_seqlens_q, max(max(query_lens), 1),
            head_dim ** -0.5)


def assert_matches_reference(args: tuple, out: torch.Tensor | None = None) -> None:
    actual = paged_attention(*args, out=out)
    torch.testing.assert_close(actual, paged_attention_ref(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("lens", [DECODE_RAGGED, MIXED, SPEC_VERIFY], ids=["decode", "mixed", "verify"])
def test_matches_reference(lens, num_heads, num_kv_heads, block_size):
    assert_matches_reference(make_case(*lens, num_heads, num_kv_heads, block_size=block_size))


@pytest.mark.parametrize("head_dim", [16, 32, 80, 128])  # 64 above; 128 unrolled, the others a loop
def test_head_dims(head_dim):
    assert_matches_reference(make_case(*MIXED, 6, 2, head_dim=head_dim))


def test_whole_prompts_and_empty_queries():
    # q_len == seq_len with a partial last row tile (13 = 8 + 5) and a partial last block; a
    # sequence with no query this step (its table is never read)
    args = make_case([13, 70, 9, 5], [13, 70, 0, 5], 9, 3)
    args[3][2] = -7
    assert_matches_reference(args)


def test_int64_indices():
    assert_matches_reference(make_case(*MIXED, 9, 3, index_dtype=torch.int64))


def test_stale_entries_past_the_end_are_never_read():
    args = make_case(*MIXED, 9, 3)
    first = paged_attention(*args)
    block_tables = args[3].clone()
    for i, seq_len in enumerate(args[4].tolist()):
        block_tables[i, -(-seq_len // 16):] = i  # valid ids, other sequences' blocks
    second = paged_attention(*args[:3], block_tables, *args[4:])
    assert torch.equal(first, second)


def test_strided_query_and_out():
    # query sliced from a fused qkv projection; out a view into a wider buffer, returned as is
    query, *rest = make_case(*MIXED, 6, 2, head_dim=32)
    num_tokens = query.shape[0]
    qkv = torch.randn(num_tokens, 10 * 32)
    qkv[:, : 6 * 32] = query.reshape(num_tokens, -1)
    strided = qkv[:, : 6 * 32].view(num_tokens, 6, 32)
    wide = torch.full((num_tokens, 8, 32), 7.0)
    returned = paged_attention(strided, *rest, out=wide[:, 1:7])
    assert returned.data_ptr() == wide[:, 1:7].data_ptr()
    torch.testing.assert_close(wide[:, 1:7], paged_attention_ref(query, *rest), rtol=1e-5, atol=1e-5)
    assert bool((wide[:, 0] == 7).all()) and bool((wide[:, 7] == 7).all())


def test_kernel_handles_long_queries():
    # the wrapper sends these to SDPA, but the op itself is correct for any q_len
    args = make_case([150, 300, 40], [150, 70, 3], 9, 3)
    out = torch.empty_like(args[0])
    library("attention").paged_attention(*args, out, -1)
    torch.testing.assert_close(out, paged_attention_ref(*args), rtol=1e-5, atol=1e-5)


def test_long_queries_routed_to_sdpa(monkeypatch):
    # with the threshold at 16, the 32- and 20-token chunks go to the reference, the rest here
    monkeypatch.setattr(attention, "LONG_QUERY_THRESHOLD", 16)
    assert_matches_reference(make_case(*MIXED, 9, 3))


# Queries per item (rows x the group) on both sides of the multi-query step's threshold (8) and
# of the 16-row item: 1, 7, 8, 9 rows (with group 1: 7 queries take the per-query step, 8 and 9
# the multi-query one; group 3: 21-27 queries, padded to 24 / 48 in scratch), 15-17 rows (17: a
# 16-row item and a 1-row one), whole prompts; partial blocks at both ends of each chunk.
MULTI_QUERY = ([40, 41, 45, 53, 29, 7, 60, 61, 17], [1, 7, 8, 9, 5, 7, 15, 16, 17])


@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_query_lengths_around_the_multi_query_step(num_heads, num_kv_heads, num_threads):
    torch.set_num_threads(num_threads)
    seq_lens, query_lens = MULTI_QUERY
    assert_matches_reference(make_case(seq_lens, query_lens, num_heads, num_kv_heads))
    assert_matches_reference(make_case(seq_lens, query_lens, num_heads, num_kv_heads, block_size=8))


@pytest.mark.parametrize("num_threads", [1, 2])
def test_prompt_chunk_on_a_long_cached_prefix(num_threads):
    # the prefix-hit shape of loadtests/bench_prefix.py, shorter: 112 new tokens on 1,900 cached
    # (a partial last block), next to a decode of the same context
    torch.set_num_threads(num_threads)
    assert_matches_reference(make_case([2012, 2012], [112, 1], 9, 3))


def test_two_threads_and_split_kv():
    # sequences over 1-2k keys split their keys at every 512 (decode and an 8-row verify tile),
    # the segments run on both threads and merge after
    torch.set_num_threads(2)  # the autouse fixture restores it
    assert_matches_reference(make_case([1100], [1], 9, 3))
    assert_matches_reference(make_case([900, 2000], [8, 1], 9, 3))
    assert_matches_reference(make_case(*DECODE_RAGGED, 9, 3))


def rows_one_at_a_time(args: tuple) -> torch.Tensor:
    """Every query row of the first sequence of args computed alone, as a decode step at its
    position (one row per call: the per-query step unless the group alone has 8 queries)."""
    query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, _, scale = args
    seq_len, q_len = int(seq_lens[0]), int(cu_seqlens_q[1])
    rows = [paged_attention(query[i:i + 1], key_cache, value_cache, block_tables[:1],
                            torch.tensor([seq_len - q_len + i + 1], dtype=seq_lens.dtype),
                            torch.tensor([0, 1], dtype=cu_seqlens_q.dtype), 1, scale)
            for i in range(q_len)]
    return torch.cat(rows)


# A token's attention output must not depend on which step served it: greedy decoding with
# speculation (a 4-6 row verification item), after a preemption (its tokens recomputed in a
# 16-row prompt chunk) and alone must see the same bits, or int8 activations (--weight-format
# q4/auto) round the last-ulp differences into different codes and change the tokens.
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("head_dim", [64, 128, 80])  # the two unrolled widths and the loop
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
def test_rows_of_an_item_equal_the_same_rows_alone(cache_dtype, head_dim, num_heads, num_kv_heads):
    # the last two pass a split-KV boundary (512 keys): inside the item, or between its rows
    for seq_len, q_len, block_size in [(47, 5, 16), (61, 16, 8), (203, 7, 32), (1100, 16, 16), (520, 12, 8)]:
        args = make_case([seq_len], [q_len], num_heads, num_kv_heads, head_dim=head_dim, block_size=block_size)
        if cache_dtype is torch.bfloat16:
            args = (args[0], args[1].bfloat16(), args[2].bfloat16(), *args[3:])
        elif cache_dtype is torch.int8:
            args = (args[0], *quantized_caches(args[1], args[2]), *args[3:])
        together = paged_attention(*args)
        assert torch.equal(together, rows_one_at_a_time(args)), (seq_len, q_len, block_size)
        torch.set_num_threads(2)  # the autouse fixture restores it: other items, other threads
        assert torch.equal(paged_attention(*args), together), (seq_len, q_len, block_size)
        torch.set_num_threads(1)


def quantized_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows with their fp32 scale bytes, in the layout of kernels/kv_quant.py."""
    return quantize_rows(key_cache, torch.int8), quantize_rows(value_cache, torch.int8)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_batches(data):
    batch = draw_attention_batch(data, long_query=9, head_groups=[(1, 1), (2, 3), (1, 8), (3, 3)],
                                 block_sizes=[8, 16, 32])
    assert_matches_reference(make_case(head_dim=32, **batch))


def _bad(index: int, value):
    def change(args: tuple) -> tuple:
        args = list(args)
        args[index] = value(args) if callable(value) else value
        return tuple(args)
    return change


def _table_entry(row: int, col: int, value: int):
    def change(args: tuple) -> tuple:
        args[3][row, col] = value
        return args
    return change


BAD_ARGUMENTS = {
    "query float64": (_bad(0, lambda a: a[0].double()), "query must be float32"),
    "key_cache float16": (_bad(1, lambda a: a[1].half()), "key_cache must be float32, bfloat16, int8"),
    "value_cache dtype": (_bad(2, lambda a: a[2].bfloat16()), "value_cache must have the dtype of key_cache"),
    "value_cache shape": (_bad(2, lambda a: a[2][:, :8]), "value_cache must have the shape of key_cache"),
    "head_dim 18": (lambda a: (a[0][..., :18],) + (a[1][..., :18], a[2][..., :18]) + a[3:],
                    f"head_dim must be a multiple of {LANES}"),
    "heads vs kv heads": (_bad(0, lambda a: a[0][:, :5]), r"num_heads \(5\) must be a multiple"),
    "block_tables float": (_bad(3, lambda a: a[3].float()), "block_tables must be int32 or int64"),
    "seq_lens length": (_bad(4, lambda a: a[4][:2]), "seq_lens must have one entry per block_tables row"),
    "cu_seqlens_q end": (_bad(5, lambda a: a[5].clone().fill_(0)), "cu_seqlens_q must start at 0 and end"),
    "q_len > seq_len": (_bad(4, lambda a: torch.tensor([37, 1, 30], dtype=torch.int32)),
                        "sequence 2: query length 32 .* must be in 0..min"),
    "q_len > max_seqlen_q": (_bad(6, 20), r"sequence 2: query length 32 .*max_seqlen_q=20"),
    "seq_len beyond block_tables": (_bad(4, lambda a: torch.tensor([37, 1, 900], dtype=torch.int32)),
                                    "sequence 2: seq_len 900 exceeds block_tables capacity"),
    "block id out of range": (_table_entry(0, 1, 999), r"block_tables\[0, 1\] = 999 is not a block id"),
    "negative block id": (_table_entry(2, 0, -1), r"block_tables\[2, 0\] = -1 is not a block id"),
    "scale": (_bad(7, 0.0), "scale must be positive"),
}


@pytest.mark.parametrize("name", list(BAD_ARGUMENTS))
def test_bad_arguments_raise_naming_the_argument(name):
    change, message = BAD_ARGUMENTS[name]
    args = change(make_case([37, 1, 64], [1, 1, 32], 6, 2))
    with pytest.raises(ValueError, match=message):
        paged_attention(*args)


def test_bad_out_raises():
    args = make_case([37], [1], 6, 2)
    with pytest.raises(ValueError, match="out must have the shape of query"):
        paged_attention(*args, out=torch.empty(2, 6, 64))

"""Unified paged attention in Triton: decode, chunked prefill, prefill on a cached prefix and
speculative verification in one kernel (every sequence has query length >= 1).

The contract (shapes, causality, GQA) is in :mod:`kernels.paged_attention_ref`, whose
``paged_attention_ref`` is re-exported here.

Work decomposition. Program (tile, kv_head, split) owns BLOCK_Q consecutive query tokens of one
sequence and all G = num_heads // num_kv_heads query heads that read ``kv_head``, stacked as
BLOCK_M = BLOCK_Q * G_PAD rows, so each K/V tile loaded from the cache serves the whole GQA group::

    row r of the tile:  query token q_start + r // G_PAD,  head kv_head * G + r % G_PAD

Tiles are numbered per sequence from ``cu_seqlens_q[i] // BLOCK_Q + i`` (an upper bound on the
tiles of the sequences before i, so the grid needs no host-side prefix sum); a program finds its
sequence by binary search and exits if its tile is past the sequence's queries.

Keys are walked TILE_N at a time with online softmax (fp32, exp2 domain). Each key position n
maps to its cache slot through the block table (block_tables[seq, n // block_size]), so TILE_N
may be larger or smaller than block_size.

Split-KV (flash decoding): with NUM_SPLITS > 1, split s walks only its share of the key tiles and
writes an unnormalised partial (acc, max, sum) to fp32 workspace; ``_reduce_splits_kernel``
merges the partials. Used when there are too few (tile, kv_head) programs to fill the GPU.

Decode steps (``rotary_store_attention``, ROPE_STORE): every sequence has one query token, so a
program's rows are that token's heads of one GQA group. The program rotates its q rows in
registers, and the split that walks the last key tile first rotates the token's key of
``kv_head`` and stores it and the value in the token's slot, then reads them back from the cache
like every other key: what ``rotary_store_kv`` then ``paged_attention`` do, one launch fewer per
layer (a decode layer's launches are what a batch-1 step on a GPU waits for).

Quantized cache (int8 or float8_e4m3fn rows: head_dim codes then an fp32 scale, see
``kernels.kv_quant``): the codes are loaded through a uint8 view of the cache and the scales
through a float32 view of the same memory (row at byte r: scale at float (r + head_dim) / 4);
each K/V tile is dequantized in registers right after its load, the rest is unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch

from kernels._triton import check_launchable, is_interpreter, tl, triton
from kernels.kv_quant import QUANT_DTYPES, SCALE_BYTES, check_scale_alignment
from kernels.paged_attention_ref import check_attention_args, paged_attention_ref

__all__ = ["paged_attention", "paged_attention_ref", "rotary_store_attention",
           "rotary_store_attention_ref"]

_LOG2E = 1.4426950408889634
_NEG_BIG = tl.constexpr(-1.0e30)  # running-max start: finite, so fully masked rows give exp2(-inf) = 0, not NaN


@triton.jit
def _find_seq(  # type: ignore[no-untyped-def]  # JIT kernel (kernels/_triton.py)
    cu_seqlens_q_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr,
):
    """Largest i with cu_seqlens_q[i] // BLOCK_Q + i <= tile."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _decode_codes(codes, QUANT: tl.constexpr):  # type: ignore[no-untyped-def]  # JIT kernel (kernels/_triton.py)
    """uint8 code bit patterns -> fp32 (before the row scale). QUANT 1: int8; 2: float8_e4m3fn,
    decoded by its bits: normals are (e + 120) << 23 | m << 20 as fp32, subnormals m * 2^-9."""
    if QUANT == 1:
        return codes.to(tl.int8, bitcast=True).to(tl.float32)
    x = codes.to(tl.int32)
    mag = x & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    value = tl.where(mag >= 8, normal, (mag & 7).to(tl.float32) * 0.001953125)
    return tl.where((x & 0x80) != 0, -value, value)


@triton.jit
def _rotate(x, x_other, cos, sin, is_lo):  # type: ignore[no-untyped-def]  # JIT kernel (kernels/_triton.py)
    """Rotate-half rotary on fp32 rows (``kernels.rotary``'s formulas, term for term):
    ``x_other`` is each column's partner in the other half; ``is_lo``: the column is in the first."""
    return tl.where(is_lo, x * cos - x_other * sin, x * cos + x_other * sin)


# num_seqs and the block table's row stride change from step to step: Triton would compile a
# variant for each value class (== 1, % 16 == 0) it sees, so a request could pay a compile; the
# constexprs alone pick a variant, and ``warm_up`` compiles every one the engine can launch.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention_kernel(  # type: ignore[no-untyped-def]  # JIT kernel (kernels/_triton.py)
    out_ptr, part_acc_ptr, part_ml_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr,
    k_new_ptr, v_new_ptr, positions_ptr, cos_sin_ptr, slot_ptr,
    num_seqs, num_heads, group, head_dim, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_co, stride_ch, stride_bt,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_FP32: tl.constexpr, QUANT: tl.constexpr,
    ROPE_STORE: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq(cu_seqlens_q_ptr, num_seqs, tile, BLOCK_Q)
    q_begin = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_begin
    q_start = (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q  # first query (within seq) of this tile
    if q_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # query j of the sequence sits at position context_len + j

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_start + offs_m // G_PAD
    g = offs_m % G_PAD
    head = kv_head * group + g
    row_valid = (q_idx < q_len) & (g < group)
    q_pos = context_len + q_idx
    token = (q_begin + q_idx).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = offs_d < head_dim
    q_mask = row_valid[:, None] & d_valid[None, :]
    q_rows = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_rows + offs_d[None, :], mask=q_mask, other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]

    # Keys this tile can see: 0 .. position of its last query; this split walks a share of them.
    kv_len = context_len + tl.minimum(q_start + BLOCK_Q, q_len)
    num_kv_tiles = tl.cdiv(kv_len, TILE_N)
    tiles_per_split = tl.cdiv(num_kv_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_kv_tiles)

    if ROPE_STORE:  # a decode step: this sequence's one query token is q_begin (module docstring)
        half = head_dim // 2
        is_lo = offs_d < half
        partner = tl.where(is_lo, offs_d + half, offs_d - half)
        freq = tl.where(is_lo, offs_d, offs_d - half)
        pos = tl.load(positions_ptr + q_begin).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * stride_cs + freq, mask=d_valid, other=0.0)
        sin = tl.load(cos_sin_ptr + pos * stride_cs + half + freq, mask=d_valid, other=0.0)
        q_other = tl.load(q_rows + partner[None, :], mask=q_mask, other=0.0).to(tl.float32)
        q = _rotate(q.to(tl.float32), q_other, cos[None, :], sin[None, :], is_lo[None, :]).to(q.dtype)
        slot = tl.load(slot_ptr + q_begin).to(tl.int64)
        # The split that walks the last key tile stores the new key and value, then reads them
        # back from the cache like every other key (the barrier orders its threads' writes and
        # reads); no other program reads that position.
        if (split == (num_kv_tiles - 1) // tiles_per_split) & (slot >= 0):
            k_row = k_new_ptr + q_begin.to(tl.int64) * stride_kt + kv_head * stride_kh
            k = tl.load(k_row + offs_d, mask=d_valid, other=0.0)
            k_other = tl.load(k_row + partner, mask=d_valid, other=0.0).to(tl.float32)
            k = _rotate(k.to(tl.float32), k_other, cos, sin, is_lo).to(k.dtype)
            v = tl.load(v_new_ptr + q_begin.to(tl.int64) * stride_vt + kv_head * stride_vh + offs_d,
                        mask=d_valid, other=0.0)
            dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co + kv_head * stride_ch
            tl.store(k_cache_ptr + dst + offs_d, k.to(k_cache_ptr.dtype.element_ty), mask=d_valid)
            tl.store(v_cache_ptr + dst + offs_d, v.to(v_cache_ptr.dtype.element_ty), mask=d_valid)
        tl.debug_barrier()

    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    block_table = block_tables_ptr + seq * stride_bt
    for kv_tile in range(tile_lo, tile_hi):
        offs_n = kv_tile * TILE_N + tl.arange(0, TILE_N)  # key positions
        n_valid = offs_n < kv_len
        block_ids = tl.load(block_table + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        slots = block_ids * stride_cb + (offs_n % BLOCK_SIZE) * stride_co + kv_head * stride_ch
        kv_mask = n_valid[None, :] & d_valid[:, None]
        k = tl.load(k_cache_ptr + slots[None, :] + offs_d[:, None], mask=kv_mask, other=0)
        if QUANT != 0:
            k_scale = tl.load(k_scale_ptr + (slots + head_dim) // 4, mask=n_valid, other=0.0)
            k = _decode_codes(k, QUANT) * k_scale[None, :]
        if DOT_FP32:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k.to(q.dtype))
        s = s * scale_log2  # [BLOCK_M, TILE_N]
        is_visible = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        s = tl.where(is_visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + slots[:, None] + offs_d[None, :], mask=n_valid[:, None] & d_valid[None, :], other=0)
        if QUANT != 0:
            v_scale = tl.load(v_scale_ptr + (slots + head_dim) // 4, mask=n_valid, other=0.0)
            v = _decode_codes(v, QUANT) * v_scale[:, None]
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # workspace rows: (token, head, split); acc: [.., HEAD_DIM_PAD], (max, sum): [.., 2]
        part = (token * num_heads + head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc,
                 mask=row_valid[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_valid)


@triton.jit
def _reduce_splits_kernel(  # type: ignore[no-untyped-def]  # JIT kernel (kernels/_triton.py)
    out_ptr, part_acc_ptr, part_ml_ptr, num_heads, head_dim, stride_ot, stride_oh,
    HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    # One program per (token, head): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_valid = offs_s < NUM_SPLITS
    part = (token * num_heads + head) * NUM_SPLITS + offs_s
    m = tl.load(part_ml_ptr + part * 2, mask=s_valid, other=_NEG_BIG)
    lse = tl.load(part_ml_ptr + part * 2 + 1, mask=s_valid, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :],
                  mask=s_valid[:, None], other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))
    total = tl.sum(w * lse, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < head_dim)


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    # fp32 inputs: exact fp32 products (no TF32), to meet the 1e-4 tolerance of the reference.
    # bf16 under the interpreter: Triton 3.9's interpreter computes bf16 tl.dot wrongly, so it
    # takes the fp32 path there; on CUDA bf16 uses the tensor cores like fp16.
    return dtype == torch.float32 or (dtype == torch.bfloat16 and is_interpreter())


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


SPLIT_MIN_CONTEXT = 2048  # a block table of fewer token slots never splits the keys


def _auto_num_splits(device: torch.device, num_programs: int, max_context: int,
                     max_seqlen_q: int) -> int:
    """Split the keys only when few programs would leave SMs idle over a long context.

    max_context is the block table's capacity (a host-side upper bound: reading seq_lens would
    cost a device sync); splits past a sequence's real length exit at once."""
    sms = _num_sms(device)
    if (device.type != "cuda" or max_seqlen_q > 16 or num_programs >= sms
            or max_context < SPLIT_MIN_CONTEXT):
        return 1
    wanted = triton.cdiv(2 * sms, num_programs)
    most = min(16, triton.next_power_of_2(wanted), max_context // 512)
    return 1 << (most.bit_length() - 1)  # a power of two: the variants warm_up compiles


def decode_num_splits(device: torch.device, num_seqs: int, num_kv_heads: int, max_context: int) -> int:
    """The key splits a decode step (one query per sequence) of ``num_seqs`` sequences over a
    block table of ``max_context`` token slots launches with (``_launch``'s choice)."""
    return _auto_num_splits(device, num_seqs * num_kv_heads, max_context, 1)


def _block_m(max_seqlen_q: int, g_pad: int, device: torch.device) -> int:
    """Rows of a program's query tile: a decode's GQA group, or up to 128 query rows."""
    if max_seqlen_q == 1:
        return max(16, g_pad)
    rows = max_seqlen_q * g_pad
    return max(g_pad, 128 if device.type == "cuda" and rows >= 128 else 64 if rows >= 64 else 16)


def fp32_prefill_tiles(head_dim_pad: int, g_pad: int) -> tuple[int, int, int]:
    """(BLOCK_M, TILE_N, num_warps) of a CUDA launch with exact fp32 dots over a query tile of
    64 rows or more (a prefill). Those dots run on the FMA units with their tiles in registers:
    the bf16 tiles spilled on sm_90 (128 x 64 on 8 warps: 1.9 KB per thread at head_dim 64,
    6.1 KB at 128; 64 x 64 on 4 warps: 2.1 KB and 30 KB); 64 x 32 on 8 warps (32 x 32 past
    head_dim 128) spill nothing (``kernels.compile_check``)."""
    return max(g_pad, 64 if head_dim_pad <= 128 else 32), 32, 8


def launch_variants(num_heads: int, num_kv_heads: int, device: torch.device,
                    max_model_len: int) -> list[tuple[int, int]]:
    """(max_seqlen_q, num_splits) pairs that reach every compiled variant the engine can launch
    for one model and cache: each distinct query tile (``_block_m``) unsplit, and each split
    count ``_auto_num_splits`` can pick for the short-query steps over a long context."""
    g_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    by_tile: dict[int, int] = {}
    for q_len in (1, 2, 64 // g_pad + 1, 128 // g_pad + 1):
        by_tile.setdefault(_block_m(q_len, g_pad, device), q_len)
    variants = [(q_len, 1) for q_len in by_tile.values()]
    splits = 2
    while device.type == "cuda" and max_model_len >= 2048 and splits <= min(16, max_model_len // 512):
        variants.append((1, splits))
        splits *= 2
    return variants


def warm_up(query_dtype: torch.dtype, key_cache: torch.Tensor, value_cache: torch.Tensor,
            num_heads: int, max_model_len: int) -> int:
    """Compile every variant of ``launch_variants`` now, on one 2-block sequence, so that no
    request pays a compile (``warm_up_fused`` compiles the fused decode variants). Returns how
    many variants were launched."""
    launched = 0
    for q_len, num_splits, case in _warm_up_cases(query_dtype, key_cache, num_heads, max_model_len):
        query, block_tables, seq_lens, cu_seqlens_q = case
        paged_attention(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, q_len,
                        1.0, num_splits=num_splits)
        launched += 1
    return launched


def warm_up_fused(key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int,
                  max_model_len: int) -> int:
    """Compile ``rotary_store_attention`` for each single-query variant of ``launch_variants``
    (the cache's dtype is the query's); it stores nothing (slot -1). Returns how many."""
    launched = 0
    head_dim, device = key_cache.shape[-1], key_cache.device
    for q_len, num_splits, case in _warm_up_cases(key_cache.dtype, key_cache, num_heads, max_model_len):
        if q_len != 1:
            continue
        query, block_tables, seq_lens, cu_seqlens_q = case
        key = torch.zeros(1, key_cache.shape[2], head_dim, dtype=key_cache.dtype, device=device)
        rotary_store_attention(query, key, key, torch.zeros(1, dtype=torch.int64, device=device),
                               torch.zeros(1, head_dim, dtype=torch.float32, device=device),
                               key_cache, value_cache, torch.full((1,), -1, dtype=torch.int64, device=device),
                               block_tables, seq_lens, cu_seqlens_q, 1.0, num_splits=num_splits)
        launched += 1
    return launched


def _warm_up_cases(query_dtype: torch.dtype, key_cache: torch.Tensor, num_heads: int,
                   max_model_len: int) -> Iterator[tuple[int, int, tuple[torch.Tensor, ...]]]:
    """(max_seqlen_q, num_splits, (query, block_tables, seq_lens, cu_seqlens_q)) of one 2-block
    sequence for each of ``launch_variants``."""
    _, block_size, num_kv_heads, row = key_cache.shape
    head_dim = row - SCALE_BYTES if key_cache.dtype in QUANT_DTYPES else row
    device = key_cache.device
    for q_len, num_splits in launch_variants(num_heads, num_kv_heads, device, max_model_len):
        seq_len = max(q_len, 2 * block_size)
        yield q_len, num_splits, (
            torch.zeros(q_len, num_heads, head_dim, dtype=query_dtype, device=device),
            torch.zeros(1, triton.cdiv(seq_len, block_size), dtype=torch.int32, device=device),
            torch.tensor([seq_len], dtype=torch.int32, device=device),
            torch.tensor([0, q_len], dtype=torch.int32, device=device))


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    max_seqlen_q: int, scale: float, out: torch.Tensor | None = None, *,
                    num_splits: int | None = None, tile_n: int | None = None) -> torch.Tensor:
    """Triton version of :func:`paged_attention_ref` (same contract).

    ``num_splits`` forces the split-KV path (None: chosen from the batch shape); ``tile_n`` sets
    the keys per inner step (None: 64 on CUDA, 32 in the interpreter). Neither changes results
    beyond rounding. Values (q_len <= seq_len etc.) are not checked here: that needs a sync.
    """
    check_attention_args(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q,
                         max_seqlen_q, scale, out)
    return _launch(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q,
                   scale, out, num_splits, tile_n, None)


def rotary_store_attention_ref(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                               key_cache: torch.Tensor, value_cache: torch.Tensor,
                               slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, scale: float,
                               out: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's attention with its rotary and KV store: ``rotary_store_kv_ref`` then
    ``paged_attention_ref`` with ``max_seqlen_q = 1``, except that ``query`` and ``key`` are left
    as they are. Every sequence has at most one query token, at position ``seq_len - 1``, and
    its ``slot_mapping`` entry is that position's cache slot (or < 0: not stored)."""
    from kernels.rotary_store_kv import rotary_store_kv_ref

    query = query.clone()
    rotary_store_kv_ref(query, key.clone(), value, positions, cos_sin_cache, key_cache, value_cache,
                        slot_mapping)
    return paged_attention_ref(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, 1,
                               scale, out)


def rotary_store_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                           key_cache: torch.Tensor, value_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, *, num_splits: int | None = None,
                           tile_n: int | None = None) -> torch.Tensor:
    """Triton version of :func:`rotary_store_attention_ref` in one launch (plus the split merge):
    a decode layer's ``rotary_store_kv`` and ``paged_attention`` fused. The cache must be
    unquantized and of the query's dtype (ValueError otherwise: use the two kernels)."""
    from kernels.rotary import check_rotary_args
    from kernels.store_kv import check_store_kv_args

    check_rotary_args(query, key, positions, cos_sin_cache)
    check_store_kv_args(key, value, key_cache, value_cache, slot_mapping)
    check_attention_args(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, 1,
                         scale, out)
    if key_cache.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(f"rotary_store_attention needs key_cache and value of the query's dtype "
                         f"{query.dtype}, got {key_cache.dtype} and {value.dtype}")
    if query.shape[0] != block_tables.shape[0]:
        raise ValueError(f"rotary_store_attention is for decode steps (one query per sequence): "
                         f"{query.shape[0]} query tokens for {block_tables.shape[0]} sequences")
    rope = (key, value, positions, cos_sin_cache, slot_mapping)
    return _launch(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, 1, scale,
                   out, num_splits, tile_n, rope)


def _launch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
            max_seqlen_q: int, scale: float, out: torch.Tensor | None, num_splits: int | None,
            tile_n: int | None, rope: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
    """The kernel launch of both entry points (arguments checked); ``rope``: (key, value,
    positions, cos_sin_cache, slot_mapping) to rotate and store first, in the same launch."""
    device = query.device
    check_launchable(device)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = block_tables.shape[0]
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    block_m = _block_m(max_seqlen_q, g_pad, device)
    num_warps = 8 if block_m >= 128 else 4
    dot_fp32 = _dot_in_fp32(query.dtype)
    if device.type == "cuda" and dot_fp32 and block_m >= 64:
        block_m, fp32_tile_n, num_warps = fp32_prefill_tiles(head_dim_pad, g_pad)
        tile_n = tile_n or fp32_tile_n
    block_q = block_m // g_pad
    num_q_tiles = num_tokens // block_q + num_seqs  # upper bound, see module docstring
    if tile_n is None:
        tile_n = 64 if device.type == "cuda" else 32
    if tile_n < 16 or tile_n & (tile_n - 1):
        raise ValueError(f"tile_n must be a power of two >= 16, got {tile_n}")
    if num_splits is None:
        num_splits = _auto_num_splits(device, min(num_q_tiles, num_tokens) * num_kv_heads,
                                      block_tables.shape[1] * block_size, max_seqlen_q)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")

    if num_splits > 1:
        part_acc = torch.empty((num_tokens, num_heads, num_splits, head_dim_pad), dtype=torch.float32,
                               device=device)
        part_ml = torch.empty((num_tokens, num_heads, num_splits, 2), dtype=torch.float32, device=device)
    else:
        part_acc = part_ml = out  # unused
    quant = QUANT_DTYPES.index(key_cache.dtype) + 1 if key_cache.dtype in QUANT_DTYPES else 0
    k_codes, v_codes, k_scales, v_scales = key_cache, value_cache, key_cache, value_cache
    if quant:
        check_scale_alignment(key_cache, head_dim)
        k_codes, v_codes = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
        k_scales, v_scales = key_cache.view(torch.float32), value_cache.view(torch.float32)
    if rope is None:
        key = value = positions = cos_sin = slots = out  # unused
        rope_strides = (0, 0, 0, 0, 0)
    else:
        key, value, positions, cos_sin, slots = rope
        rope_strides = (key.stride(0), key.stride(1), value.stride(0), value.stride(1), cos_sin.stride(0))
    _paged_attention_kernel[(num_q_tiles, num_kv_heads, num_splits)](
        out, part_acc, part_ml,
        query, k_codes, v_codes, k_scales, v_scales, block_tables, seq_lens, cu_seqlens_q,
        key, value, positions, cos_sin, slots,
        num_seqs, num_heads, group, head_dim, scale * _LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        *rope_strides,
        BLOCK_SIZE=block_size, HEAD_DIM_PAD=head_dim_pad, G_PAD=g_pad, BLOCK_Q=block_q,
        BLOCK_M=block_m, TILE_N=tile_n, NUM_SPLITS=num_splits,
        DOT_FP32=dot_fp32, QUANT=quant, ROPE_STORE=rope is not None,
        num_warps=num_warps,
    )
    if num_splits > 1:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            out, part_acc, part_ml, num_heads, head_dim, out.stride(0), out.stride(1),
            HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
    return out

"""Paged attention in pure torch: the reference for the Triton kernel and the CPU production path.

Contract (shared with ``kernels.paged_attention.paged_attention``)::

    query        [num_tokens, num_heads, head_dim]   tokens of all sequences, flattened;
                 sequence i owns rows cu_seqlens_q[i] : cu_seqlens_q[i + 1]
    key_cache    [num_blocks, block_size, num_kv_heads, head_dim]   strided view, read in place
    value_cache  same shape and strides as key_cache
    block_tables [num_seqs, max_blocks_per_seq]  int32 (int64 accepted); entries past a
                 sequence's last block may hold anything (-1, stale ids): they are masked
    seq_lens     [num_seqs]   context length INCLUDING this step's query tokens (their K/V are
                 already in the cache)
    cu_seqlens_q [num_seqs + 1]   cumulative query lengths, cu_seqlens_q[0] == 0
    out          [num_tokens, num_heads, head_dim] in query's dtype

    The q_len query tokens of sequence i sit at positions seq_len - q_len .. seq_len - 1, and
    the query at position p attends to keys 0..p (causal). Query head h reads KV head
    h // (num_heads // num_kv_heads) (GQA / MQA). Softmax and accumulation are fp32.

A quantized cache (int8 or float8_e4m3fn: rows of head_dim codes then an fp32 scale, see
``kernels.kv_quant``, so its last dim is head_dim + 4) is read through ``dequantize_rows``.

Every cache slot below seq_len must hold a finite value; slots past seq_len are never read by
the Triton kernel, but this reference multiplies them by a zero weight, so allocate the cache
with ``torch.zeros`` (not ``torch.empty``) to keep NaN bit patterns out of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._checks import FLOAT_DTYPES, INDEX_DTYPES, check_tensor
from kernels.kv_quant import QUANT_DTYPES, SCALE_BYTES, dequantize_rows


def check_attention_args(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         max_seqlen_q: int, scale: float, out: torch.Tensor | None) -> None:
    """Shapes, dtypes, devices and strides (no device-to-host reads)."""
    check_tensor("query", query, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_tokens, num_heads, head_dim = query.shape
    device = query.device
    # a quantized cache's rows are head_dim codes, then the fp32 scale's bytes
    is_quantized = getattr(key_cache, "dtype", None) in QUANT_DTYPES
    row_width = head_dim + SCALE_BYTES if is_quantized else head_dim
    check_tensor("key_cache", key_cache, shape=(None, None, None, row_width),
                 dtypes=FLOAT_DTYPES + QUANT_DTYPES, device=device, last_dim_contiguous=True)
    num_kv_heads = key_cache.shape[2]
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"query's num_heads ({num_heads}) must be a multiple of key_cache's "
                         f"num_kv_heads ({num_kv_heads})")
    check_tensor("value_cache", value_cache, shape=tuple(key_cache.shape), dtypes=(key_cache.dtype,),
                 device=device, last_dim_contiguous=True)
    if value_cache.stride() != key_cache.stride():
        raise ValueError(f"value_cache must have the strides of key_cache {key_cache.stride()}, "
                         f"got {value_cache.stride()}")
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, device=device)
    num_seqs = block_tables.shape[0]
    check_tensor("seq_lens", seq_lens, shape=(num_seqs,), dtypes=INDEX_DTYPES, device=device)
    check_tensor("cu_seqlens_q", cu_seqlens_q, shape=(num_seqs + 1,), dtypes=INDEX_DTYPES,
                 device=device)
    if not isinstance(max_seqlen_q, int) or max_seqlen_q < 1:
        raise ValueError(f"max_seqlen_q must be an int >= 1, got {max_seqlen_q!r}")
    if not isinstance(scale, (int, float)) or scale <= 0:
        raise ValueError(f"scale must be a positive float, got {scale!r}")
    if out is not None:
        check_tensor("out", out, shape=tuple(query.shape), dtypes=(query.dtype,), device=device,
                     last_dim_contiguous=True)


def check_attention_values(seq_lens: list[int], cu_seqlens_q: list[int], num_tokens: int,
                           max_seqlen_q: int, max_context: int) -> None:
    """Host-side value checks (the reference reads these lists anyway)."""
    if cu_seqlens_q[0] != 0 or cu_seqlens_q[-1] != num_tokens:
        raise ValueError(f"cu_seqlens_q must start at 0 and end at num_tokens ({num_tokens}), "
                         f"got {cu_seqlens_q}")
    for i, seq_len in enumerate(seq_lens):
        q_len = cu_seqlens_q[i + 1] - cu_seqlens_q[i]
        if not 0 <= q_len <= min(seq_len, max_seqlen_q):
            raise ValueError(f"sequence {i}: query length {q_len} must be in 0..min(seq_len={seq_len}, "
                             f"max_seqlen_q={max_seqlen_q})")
        if seq_len > max_context:
            raise ValueError(f"sequence {i}: seq_len {seq_len} exceeds block_tables capacity "
                             f"({max_context} = max_blocks_per_seq * block_size)")


def paged_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, max_seqlen_q: int, scale: float,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring. Sequences with one query token (decode) go through one padded
    batched matmul; longer queries (prefill chunks, spec verification) through SDPA per sequence."""
    check_attention_args(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q,
                         max_seqlen_q, scale, out)
    block_size = key_cache.shape[1]
    lens, cu = seq_lens.tolist(), cu_seqlens_q.tolist()
    check_attention_values(lens, cu, query.shape[0], max_seqlen_q, block_tables.shape[1] * block_size)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    decode_ids = [i for i in range(len(lens)) if cu[i + 1] - cu[i] == 1]
    if decode_ids:
        _decode(query, key_cache, value_cache, block_tables, seq_lens, cu, lens, decode_ids, scale, out)
    for i, seq_len in enumerate(lens):
        if cu[i + 1] - cu[i] > 1:
            extend_attention(query, key_cache, value_cache, block_tables[i], seq_len, cu[i], cu[i + 1], scale, out)
    return out


def _values(rows: torch.Tensor) -> torch.Tensor:
    """Cache rows as fp32 values (dequantized when the cache is quantized)."""
    return dequantize_rows(rows) if rows.dtype in QUANT_DTYPES else rows.float()


def _decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, cu: list[int], lens: list[int],
            decode_ids: list[int], scale: float, out: torch.Tensor) -> None:
    """All single-token queries at once: gather their blocks into [B, Hkv, L, head_dim] and
    attend with two batched matmuls over every (sequence, KV head)."""
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = query.shape[1] // num_kv_heads
    device = query.device
    ids = torch.tensor(decode_ids, device=device)
    rows = torch.tensor([cu[i] for i in decode_ids], device=device)
    max_len = max(lens[i] for i in decode_ids)
    num_blocks = -(-max_len // block_size)
    # rows of shorter sequences run past their last block: clamp those entries to any valid id
    blocks = block_tables.index_select(0, ids)[:, :num_blocks].long().clamp_(0, key_cache.shape[0] - 1)
    batch = len(decode_ids)
    # key positions at or past a sequence's length are padding: [B, 1, L]
    is_pad = (torch.arange(num_blocks * block_size, device=device)[None, :]
              >= seq_lens.index_select(0, ids)[:, None].long()).unsqueeze(1)
    q = query.index_select(0, rows).float().view(batch, num_kv_heads, group, -1)
    # Gather every KV head at once: [B, nblk, block_size, Hkv, D] -> [B, Hkv, L, D]
    k = _values(key_cache[blocks]).flatten(1, 2).transpose(1, 2)
    v = _values(value_cache[blocks]).flatten(1, 2).transpose(1, 2)
    scores = torch.matmul(q, k.transpose(2, 3)).mul_(scale)  # [B, Hkv, group, L]
    scores.masked_fill_(is_pad.unsqueeze(1), float("-inf"))
    res = torch.matmul(torch.softmax(scores, dim=-1), v)  # [B, Hkv, group, D]
    out.index_copy_(0, rows, res.reshape(batch, -1, res.shape[-1]).to(out.dtype))


def extend_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            block_table: torch.Tensor, seq_len: int, start: int, end: int, scale: float,
            out: torch.Tensor) -> None:
    """One sequence with q_len > 1: queries at positions seq_len-q_len.. attend causally."""
    block_size = key_cache.shape[1]
    q_len = end - start
    blocks = block_table[: -(-seq_len // block_size)].long()
    k = _values(key_cache.index_select(0, blocks).flatten(0, 1)[:seq_len])  # [S, num_kv_heads, head_dim]
    v = _values(value_cache.index_select(0, blocks).flatten(0, 1)[:seq_len])
    q = query[start:end].float()
    if q_len == seq_len:
        mask, causal = None, True
    else:
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]  # [Q, S]
        causal = False
    group = q.shape[1] // k.shape[1]
    if group > 1:  # expand KV heads: SDPA's fused CPU kernel does not take enable_gqa
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    # [1, H, S, D]: the fused CPU kernel wants a batch dimension
    res = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], attn_mask=mask,
                                         is_causal=causal, scale=scale)
    out[start:end] = res[0].transpose(0, 1).to(out.dtype)

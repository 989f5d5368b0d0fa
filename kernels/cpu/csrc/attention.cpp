// Paged attention on CPU, reading K/V rows in place from the block-paged cache (no gather).
//
// Contract: kernels/paged_attention_ref.py (module docstring); fp32 queries, and an fp32, a
// bfloat16 or a quantized cache (int8 or float8_e4m3fn rows: head_dim codes, then the row's fp32
// scale; see kernels/kv_quant.py). A bf16 or quantized cache's tiles are widened once into an fp32
// scratch tile (in registers, times the row's scale) that every query of the item then reads
// from L1: the group's queries share each conversion. One kernel serves every query length:
// decode (q_len 1), spec verification, chunked prefill on a prefix.
//
// Work item = (sequence, KV head, tile of up to kRowsPerItem query rows). The `group` query
// heads that share the KV head are processed together, so each K/V row is read from the cache
// once per item. Keys stream in tiles of at most kLanes that stay inside one block:
//
//   for each key tile [t0, t1):            (t1 <= last query position + 1: causal)
//     s[i][j]  = (q_i * scale * log2e) . K_j      one score per (query, key), -inf if masked
//     m_i, l_i, acc_i  <- online softmax update with p[i][j] = 2^(s[i][j] - m_i)
//     acc_i   += p[i][j] * V_j
//   out_i = acc_i / l_i
//
// Two inner steps compute the same thing, bit for bit (attention_tile.h says how). An item
// with fewer than kMinMultiQueries queries (decode, short spec verification) takes the
// per-query step below: kLanes dot products per query folded by a shuffle tree. An item with
// more (a prompt chunk: 16 rows x the group) takes the multi-query step of attention_tile.h:
// the K tile transposed once, then scores and P x V as register-blocked GEMMs over all its
// queries.
//
// Items go to threads through one atomic counter, longest first, so a long prefill chunk in a
// batch of decodes does not leave a thread idle behind a static split. An item whose keys pass
// kSegmentKeys splits them at every multiple of it (split-KV): the segments run as items of
// their own and their partial softmax results merge afterwards, always in segment order. The
// boundaries depend on nothing but the position, so a query gets the same bits whatever its
// batch, its item and the thread count (a batch-1 decode over 2k keys also gets 4 x its heads'
// items for the threads). Tiny batches (< kSerialCost) stay on the calling thread.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>

#include "attention_query.h"
#include "attention_rows.h"
#include "attention_tile.h"
#include "attention_work.h"
#include "vec.h"

namespace pdserve {
namespace {

// query rows (tokens) per work item: 16 x the group share each K/V pass (16 rows instead of 8
// took a third off the prefix-hit shape, 112 queries on 2k keys, whose items stream their
// head's K/V from L3; 32 gained nothing more)
constexpr int kRowsPerItem = 16;
constexpr int64_t kSerialCost = 8192;  // below this many (query head x key) dot products: one thread
constexpr int64_t kSegmentKeys = 512;  // split-KV boundaries (rounded up to a whole block)
constexpr int64_t kMinMultiQueries = 8;  // items with this many queries take the multi-query step

template <class R, int NV>
void attend(const Layout& L, const WorkItem& w, Scratch& s, Partials& partials) {
  using T = typename R::T;
  const int nv = NV ? NV : static_cast<int>(L.head_dim / kLanes);
  const int64_t row_bytes = L.head_dim * static_cast<int64_t>(sizeof(T)) + R::kScaleBytes;
  const T* key = static_cast<const T*>(L.key);
  const T* value = static_cast<const T*>(L.value);
  const int64_t group = L.group, nq = w.num_rows * group;  // query i = row (i / group), head (i % group)
  for (int64_t i = 0; i < nq; ++i) {
    const float* src = L.query + (w.first_token + i / group) * L.q_stride_token +
                       (w.kv_head * group + i % group) * L.q_stride_head;
    for (int c = 0; c < nv; ++c) {
      vstore(&s.q[i * L.head_dim + c * kLanes], vload(src + c * kLanes) * L.scale_log2);
      vstore(&s.acc[i * L.head_dim + c * kLanes], vfloat{});
    }
    s.m[i] = -INFINITY;
    s.l[i] = 0.f;
  }
  // Enough queries share each key tile: transpose it once and run them as small GEMMs.
  const bool is_multi_query = nq >= kMinMultiQueries;
  if (is_multi_query) init_padding(s.rows(), nq, round_up(nq, kQueryPad));
  const int64_t kv_end = w.key_end;
  for (int64_t t0 = w.key_begin; t0 < kv_end;) {
    const int64_t block_index = t0 / L.block_size, slot0 = t0 % L.block_size;
    const int64_t n = std::min<int64_t>({kLanes, L.block_size - slot0, kv_end - t0});
    const int64_t block = L.block_id(w.seq, block_index);
    const T* k_src = key + block * L.k_stride_block + slot0 * L.k_stride_slot + w.kv_head * L.k_stride_head;
    const T* v_src = value + block * L.v_stride_block + slot0 * L.v_stride_slot + w.kv_head * L.v_stride_head;
    const float *k_rows, *v_rows;
    int64_t k_stride, v_stride;
    if constexpr (std::is_same_v<R, F32Rows>) {
      k_rows = k_src, v_rows = v_src, k_stride = L.k_stride_slot, v_stride = L.v_stride_slot;
    } else {
      dequantize_tile<R>(k_src, L.k_stride_slot, n, nv, L.head_dim, s.k_tile.data());
      dequantize_tile<R>(v_src, L.v_stride_slot, n, nv, L.head_dim, s.v_tile.data());
      k_rows = s.k_tile.data(), v_rows = s.v_tile.data(), k_stride = v_stride = L.head_dim;
    }
    if (slot0 == 0 && t0 + L.block_size < kv_end) {
      const int64_t next = L.block_id(w.seq, block_index + 1);
      const int64_t next_rows = std::min(L.block_size, kv_end - t0 - L.block_size);
      prefetch_rows(key + next * L.k_stride_block + w.kv_head * L.k_stride_head, next_rows, L.k_stride_slot, row_bytes);
      prefetch_rows(value + next * L.v_stride_block + w.kv_head * L.v_stride_head, next_rows, L.v_stride_slot, row_bytes);
    }
    auto visible = [&](int64_t i) { return std::min(n, w.first_pos + i / group - t0 + 1); };  // causal
    if (is_multi_query) {
      transpose_tile(k_rows, k_stride, n, L.head_dim, s.kt.data());
      attend_tile_rows(s.rows(), nq, L.head_dim, s.kt.data(), n, v_rows, v_stride, visible);
    } else {
      attend_tile_per_query<NV>(s.rows(), nq, L.head_dim, nv, k_rows, k_stride, n, v_rows, v_stride, visible);
    }
    t0 += n;
  }
  if (w.partial >= 0) {
    const int64_t slot = w.partial * partials.max_queries;
    std::copy(s.m.begin(), s.m.begin() + nq, partials.m.get() + slot);
    std::copy(s.l.begin(), s.l.begin() + nq, partials.l.get() + slot);
    std::copy(s.acc.begin(), s.acc.begin() + nq * L.head_dim, partials.acc.get() + slot * L.head_dim);
    return;
  }
  for (int64_t i = 0; i < nq; ++i) {
    float* dst = L.out + (w.first_token + i / group) * L.o_stride_token +
                 (w.kv_head * group + i % group) * L.o_stride_head;
    const float inv = 1.f / s.l[i];  // l >= 1: key 0 is visible to every query
    for (int c = 0; c < nv; ++c) vstore(dst + c * kLanes, vload(&s.acc[i * L.head_dim + c * kLanes]) * inv);
  }
}

void check_float_tensor(const char* name, const at::Tensor& t, int64_t ndim) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got device ", t.device());
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat, name, " must be float32 on the CPU kernel path, got ",
                    t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == ndim, name, " must be ", ndim, "-d, got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.stride(-1) == 1, name, " must have stride 1 in its last dim, got strides ", t.strides());
}

// The cache: fp32, bfloat16, or a quantized dtype (int8, float8_e4m3fn) whose rows carry 4 scale bytes.
void check_cache_tensor(const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got device ", t.device());
  const auto type = t.scalar_type();
  TORCH_CHECK_VALUE(type == at::kFloat || type == at::kBFloat16 || type == at::kChar || type == at::kFloat8_e4m3fn,
                    name, " must be float32, bfloat16, int8 or float8_e4m3fn on the CPU kernel path, got ", type);
  TORCH_CHECK_VALUE(t.dim() == 4, name, " must be 4-d, got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.stride(-1) == 1, name, " must have stride 1 in its last dim, got strides ", t.strides());
}

void check_index_tensor(const char* name, const at::Tensor& t, int64_t ndim) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got device ", t.device());
  TORCH_CHECK_VALUE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name,
                    " must be int32 or int64, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == ndim, name, " must be ", ndim, "-d, got shape ", t.sizes());
}

// Sequences with q_len > max_kernel_q_len are validated but left to the caller (out untouched
// for their rows); pass a negative value to compute every sequence here.
void paged_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                     int64_t max_seqlen_q, double scale, const at::Tensor& out, int64_t max_kernel_q_len) {
  check_float_tensor("query", query, 3);
  check_cache_tensor("key_cache", key_cache);
  check_cache_tensor("value_cache", value_cache);
  check_float_tensor("out", out, 3);
  check_index_tensor("block_tables", block_tables, 2);
  check_index_tensor("seq_lens", seq_lens, 1);
  check_index_tensor("cu_seqlens_q", cu_seqlens_q, 1);
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2), num_seqs = block_tables.size(0);
  const int64_t max_blocks_per_seq = block_tables.size(1);
  const bool is_quantized = key_cache.scalar_type() == at::kChar || key_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK_VALUE(key_cache.size(3) == head_dim + (is_quantized ? 4 : 0), "key_cache must have head_dim ",
                    head_dim, " like query", is_quantized ? " plus 4 scale bytes (a quantized cache)" : "",
                    ", got shape ", key_cache.sizes());
  TORCH_CHECK_VALUE(value_cache.scalar_type() == key_cache.scalar_type(), "value_cache must have the dtype of "
                    "key_cache (", key_cache.scalar_type(), "), got ", value_cache.scalar_type());
  TORCH_CHECK_VALUE(value_cache.sizes() == key_cache.sizes(), "value_cache must have the shape of key_cache ",
                    key_cache.sizes(), ", got ", value_cache.sizes());
  TORCH_CHECK_VALUE(out.sizes() == query.sizes(), "out must have the shape of query ", query.sizes(), ", got ",
                    out.sizes());
  TORCH_CHECK_VALUE(head_dim % kLanes == 0 && head_dim <= kLanes * kMaxHeadVectors,
                    "query's head_dim must be a multiple of ", kLanes, " up to ", kLanes * kMaxHeadVectors,
                    " on the CPU kernel path, got ", head_dim);
  TORCH_CHECK_VALUE(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "query's num_heads (", num_heads,
                    ") must be a multiple of key_cache's num_kv_heads (", num_kv_heads, ")");
  TORCH_CHECK_VALUE(seq_lens.size(0) == num_seqs, "seq_lens must have one entry per block_tables row (",
                    num_seqs, "), got shape ", seq_lens.sizes());
  TORCH_CHECK_VALUE(cu_seqlens_q.size(0) == num_seqs + 1, "cu_seqlens_q must have num_seqs + 1 = ", num_seqs + 1,
                    " entries, got shape ", cu_seqlens_q.sizes());
  TORCH_CHECK_VALUE(max_seqlen_q >= 1, "max_seqlen_q must be >= 1, got ", max_seqlen_q);
  TORCH_CHECK_VALUE(scale > 0, "scale must be positive, got ", scale);

  const IndexView lens(seq_lens), cu(cu_seqlens_q);
  const Layout L{query.data_ptr<float>(), query.stride(0), query.stride(1),
                 key_cache.data_ptr(), value_cache.data_ptr(),
                 key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                 value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
                 out.data_ptr<float>(), out.stride(0), out.stride(1),
                 block_tables.data_ptr(), block_tables.stride(0), block_tables.stride(1),
                 block_tables.scalar_type() == at::kLong,
                 block_size, num_heads / num_kv_heads, head_dim,
                 static_cast<float>(scale * M_LOG2E)};

  TORCH_CHECK_VALUE(cu[0] == 0 && cu[num_seqs] == num_tokens, "cu_seqlens_q must start at 0 and end at "
                    "num_tokens (", num_tokens, "), got ", cu[0], " .. ", cu[num_seqs]);
  // Work items; one over more than one split-KV segment becomes one item per segment, each with
  // its Partials slot, merged after (split_firsts: the first segment of each, for the merge).
  const int64_t segment = round_up(kSegmentKeys, block_size);
  std::vector<WorkItem> items, split_firsts;
  std::vector<int64_t> split_counts;
  int64_t total_cost = 0, num_partials = 0;
  auto add_item = [&](const WorkItem& w) {
    total_cost += w.cost();
    if (w.key_end <= segment) return items.push_back(w);
    const int64_t count = (w.key_end + segment - 1) / segment;
    for (int64_t k = 0; k < count; ++k) {
      WorkItem part = w;
      part.key_begin = k * segment;
      part.key_end = std::min(w.key_end, (k + 1) * segment);
      part.partial = num_partials + k;
      items.push_back(part);
    }
    split_firsts.push_back(items[items.size() - count]);
    split_counts.push_back(count);
    num_partials += count;
  };
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t seq_len = lens[seq], q_len = cu[seq + 1] - cu[seq];
    TORCH_CHECK_VALUE(0 <= q_len && q_len <= seq_len && q_len <= max_seqlen_q, "sequence ", seq,
                      ": query length ", q_len, " (from cu_seqlens_q) must be in 0..min(seq_len=", seq_len,
                      ", max_seqlen_q=", max_seqlen_q, ")");
    TORCH_CHECK_VALUE(seq_len <= max_blocks_per_seq * block_size, "sequence ", seq, ": seq_len ", seq_len,
                      " exceeds block_tables capacity (", max_blocks_per_seq * block_size,
                      " = max_blocks_per_seq * block_size)");
    if (q_len == 0) continue;  // nothing reads its block table
    for (int64_t b = 0; b < (seq_len + block_size - 1) / block_size; ++b) {
      const int64_t block = L.block_id(seq, b);
      TORCH_CHECK_VALUE(0 <= block && block < num_blocks, "sequence ", seq, ": block_tables[", seq, ", ", b,
                        "] = ", block, " is not a block id of key_cache (0..", num_blocks - 1, ")");
    }
    if (max_kernel_q_len >= 0 && q_len > max_kernel_q_len) continue;
    for (int64_t row = 0; row < q_len; row += kRowsPerItem) {
      const int64_t num_rows = std::min<int64_t>(kRowsPerItem, q_len - row), first_pos = seq_len - q_len + row;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        // the last row sees keys 0 .. first_pos + num_rows - 1 (causal)
        add_item({seq, h, cu[seq] + row, first_pos, num_rows, 0, first_pos + num_rows, -1});
      }
    }
  }
  if (items.empty()) return;

  // scratch and split-KV slots for the longest item (a decode batch: one row), not kRowsPerItem
  int64_t max_rows = 0;
  for (const WorkItem& w : items) max_rows = std::max(max_rows, w.num_rows);
  const int64_t num_threads = at::get_num_threads(), max_queries = max_rows * L.group;
  const bool is_parallel = num_threads > 1 && total_cost * L.group >= kSerialCost;
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost() > b.cost(); });
  Partials partials(num_partials, max_queries, head_dim);

  auto run = [&](auto attend_fn) {
    const int64_t num_items = static_cast<int64_t>(items.size());
    if (!is_parallel) {
      Scratch scratch(max_queries, head_dim);
      for (const WorkItem& w : items) attend_fn(L, w, scratch, partials);
      return;
    }
    // one task per thread; each takes the next item (longest first) until none are left
    std::atomic<int64_t> next{0};
    at::parallel_for(0, num_threads, 1, [&](int64_t, int64_t) {
      Scratch scratch(max_queries, head_dim);
      for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) attend_fn(L, items[i], scratch, partials);
    });
  };
  auto run_rows = [&](auto rows) {
    using R = decltype(rows);
    switch (head_dim) {
      case 64: run(attend<R, 64 / kLanes>); break;
      case 128: run(attend<R, 128 / kLanes>); break;
      default: run(attend<R, 0>); break;
    }
  };
  switch (key_cache.scalar_type()) {
    case at::kChar: run_rows(Int8Rows{}); break;
    case at::kFloat8_e4m3fn: run_rows(Fp8Rows{}); break;
    case at::kBFloat16: run_rows(Bf16Rows{}); break;
    default: run_rows(F32Rows{}); break;
  }
  for (size_t k = 0; k < split_firsts.size(); ++k) merge_splits(L, split_firsts[k], split_counts[k], partials);
}

}  // namespace
}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(PDSERVE_NAMESPACE, m) {
  m.def(
      "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor cu_seqlens_q, int max_seqlen_q, float scale, Tensor(a!) out, "
      "int max_kernel_q_len) -> ()",
      &pdserve::paged_attention);
}
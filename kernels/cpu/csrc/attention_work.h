// The CPU paged attention's (attention.cpp) bookkeeping: the tensors' layout, a work item (a
// sequence, a KV head, a tile of query rows and the keys it reads), the scratch of a thread,
// and the merge of split-KV partial results. Anonymous namespace: one library per ISA.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "attention_tile.h"
#include "vec.h"

namespace pdserve {
namespace {

constexpr int kMaxHeadVectors = 256 / kLanes;  // head_dim up to 256

// Integer tensors may be int32 or int64; read one element either way.
struct IndexView {
  const void* data;
  int64_t stride;
  bool is_int64;

  explicit IndexView(const at::Tensor& t)  // 1-d
      : data(t.data_ptr()), stride(t.stride(0)), is_int64(t.scalar_type() == at::kLong) {}

  int64_t operator[](int64_t i) const {
    return is_int64 ? static_cast<const int64_t*>(data)[i * stride]
                    : static_cast<const int32_t*>(data)[i * stride];
  }
};

struct Layout {
  const float* query;  // [num_tokens, num_heads, head_dim]
  int64_t q_stride_token, q_stride_head;
  const void* key;  // [num_blocks, block_size, num_kv_heads, head_dim (+ 4 when quantized)]
  const void* value;
  int64_t k_stride_block, k_stride_slot, k_stride_head;
  int64_t v_stride_block, v_stride_slot, v_stride_head;
  float* out;
  int64_t o_stride_token, o_stride_head;
  const void* block_tables;
  int64_t bt_stride_seq, bt_stride_block;
  bool bt_is_int64;
  int64_t block_size, group, head_dim;
  float scale_log2;  // scale * log2(e): softmax runs in base 2

  int64_t block_id(int64_t seq, int64_t index) const {
    int64_t offset = seq * bt_stride_seq + index * bt_stride_block;
    return bt_is_int64 ? static_cast<const int64_t*>(block_tables)[offset]
                       : static_cast<const int32_t*>(block_tables)[offset];
  }
};

struct WorkItem {
  int64_t seq, kv_head;
  int64_t first_token;  // row in query/out of this item's first query token
  int64_t first_pos;    // its position in the sequence
  int64_t num_rows;
  int64_t key_begin, key_end;  // keys this item reads; key_begin is a multiple of block_size
  int64_t partial;             // -1: write `out`; else its slot in Partials (split-KV)
  int64_t cost() const { return num_rows * (key_end - key_begin); }
};

// Split-KV results: unnormalised accumulators with their running max and sum, per query (left
// uninitialised: each slot's queries are written by its item before the merge reads them).
struct Partials {
  int64_t max_queries, head_dim;
  std::unique_ptr<float[]> acc, m, l;
  Partials(int64_t num_slots, int64_t max_queries, int64_t head_dim)
      : max_queries(max_queries), head_dim(head_dim), acc(new float[num_slots * max_queries * head_dim]),
        m(new float[num_slots * max_queries]), l(new float[num_slots * max_queries]) {}
};

// Scratch of one thread, reused across its items: num_rows * group queries (padded to
// kQueryPad for the multi-query step), one K and one V tile of kLanes rows (a quantized cache's
// tiles, dequantized), the K tile transposed, and the tile's P and corrections per query.
struct Scratch {
  std::vector<float> q, acc, m, l, k_tile, v_tile, kt, p, corr;
  explicit Scratch(int64_t max_queries, int64_t head_dim)
      : q(round_up(max_queries, kQueryPad) * head_dim), acc(round_up(max_queries, kQueryPad) * head_dim),
        m(round_up(max_queries, kQueryPad)), l(round_up(max_queries, kQueryPad)), k_tile(kLanes * head_dim),
        v_tile(kLanes * head_dim), kt(kLanes * head_dim), p(round_up(max_queries, kQueryPad) * kLanes),
        corr(round_up(max_queries, kQueryPad)) {}
  TileRows rows() { return {q.data(), acc.data(), m.data(), l.data(), p.data(), corr.data()}; }
};

// Combine the num_splits partial results of one (sequence, KV head, rows) that split its keys:
// out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M), M = max_s m_s. A split past a query's
// position saw no keys (m = -inf, weight 0); the first split holds key 0, so M is finite.
void merge_splits(const Layout& L, const WorkItem& w, int64_t num_splits, const Partials& partials) {
  const int64_t nq = w.num_rows * L.group, nv = L.head_dim / kLanes;
  for (int64_t i = 0; i < nq; ++i) {
    float m_max = -INFINITY, l_sum = 0.f;
    for (int64_t k = 0; k < num_splits; ++k) m_max = std::max(m_max, partials.m[(w.partial + k) * partials.max_queries + i]);
    vfloat acc[kMaxHeadVectors] = {};
    for (int64_t k = 0; k < num_splits; ++k) {
      const int64_t slot = (w.partial + k) * partials.max_queries + i;
      const float weight = std::exp2(partials.m[slot] - m_max);
      l_sum += partials.l[slot] * weight;
      for (int64_t c = 0; c < nv; ++c) acc[c] += weight * vload(&partials.acc[slot * L.head_dim + c * kLanes]);
    }
    float* dst = L.out + (w.first_token + i / L.group) * L.o_stride_token +
                 (w.kv_head * L.group + i % L.group) * L.o_stride_head;
    const float inv = 1.f / l_sum;  // as attend() normalises an item that was not split
    for (int64_t c = 0; c < nv; ++c) vstore(dst + c * kLanes, acc[c] * inv);
  }
}

}  // namespace
}  // namespace pdserve

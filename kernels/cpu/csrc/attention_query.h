// The per-query step of the CPU paged attention (attention.cpp): for an item with few queries
// (decode, short spec verification), each query's kLanes dot products against one key tile,
// folded into one score vector by a shuffle tree, then its online softmax update. The
// multi-query step (prompt chunks) is attention_tile.h. Anonymous namespace: one library per ISA.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <utility>

#include "attention_tile.h"
#include "attention_work.h"
#include "vec.h"

namespace pdserve {
namespace {

// Lane permutations for transpose_sum (GCC __builtin_shuffle: index >= kLanes picks from the
// second operand). Fold at width w = kLanes >> (level + 1): within each 2w-lane group, the
// first w lanes come from a, the next w from b; "hi" takes the other half of each pair.
template <std::size_t... L>
constexpr std::array<vint, sizeof...(L)> make_folds(std::index_sequence<L...>) {
  return {lanes_of([](int i) {
    const int w = kLanes >> (L + 1), group = i / (2 * w) * 2 * w, pos = i % (2 * w);
    return pos < w ? group + pos : kLanes + group + pos - w;
  })...};
}
constexpr std::array<vint, kLog2Lanes> kFoldLo = make_folds(std::make_index_sequence<kLog2Lanes>{});

constexpr int bit_reversed(int j) {
  int r = 0;
  for (int b = 0; b < kLog2Lanes; ++b) r |= ((j >> b) & 1) << (kLog2Lanes - 1 - b);
  return r;
}

// kLanes vectors -> one: lane j = the lane sum of rows[bit_reversed(j)] (kLanes - 1 adds,
// twice as many shuffles, instead of kLanes separate vsums)
inline vfloat transpose_sum(vfloat* rows) {
  int count = kLanes;
  for (int level = 0; level < kLog2Lanes; ++level) {
    count /= 2;
    const vint lo = kFoldLo[level], hi = lo + (kLanes >> (level + 1));
    for (int r = 0; r < count; ++r) {
      const vfloat a = rows[2 * r], b = rows[2 * r + 1];
      rows[r] = __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
    }
  }
  return rows[0];
}

// Scores of one query against the keys of one tile, scaled to base 2: lane j = q . K_j for
// j < visible, -inf beyond. NV = head_dim / kLanes when known at compile time, else 0.
template <int NV>
inline vfloat tile_scores(const float* q, const float* k_rows, int64_t k_stride, int64_t visible, int nv) {
  vfloat dots[kLanes];
#pragma GCC unroll 16
  for (int j = 0; j < kLanes; ++j) {
    vfloat dot{};
    if (j < visible)
      for (int c = 0; c < (NV ? NV : nv); ++c) dot += vload(q + c * kLanes) * vload(k_rows + j * k_stride + c * kLanes);
    dots[bit_reversed(j)] = dot;
  }
  const vfloat scores = transpose_sum(dots);
  return kIota < static_cast<int>(visible) ? scores : vsplat(-INFINITY);
}

// One tile of n keys (k_rows, v_rows: fp32 rows) against queries 0 .. nq - 1 of t, one query at a
// time; query i sees the tile's first visible_keys(i) keys (<= 0: none). NV as tile_scores.
template <int NV, class Visible>
inline void attend_tile_per_query(const TileRows& t, int64_t nq, int64_t head_dim, int nv, const float* k_rows,
                                  int64_t k_stride, int64_t n, const float* v_rows, int64_t v_stride,
                                  Visible visible_keys) {
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t visible = visible_keys(i);
    if (visible <= 0) continue;
    const vfloat scores = tile_scores<NV>(t.q + i * head_dim, k_rows, k_stride, visible, nv);
    // online softmax: rescale what was accumulated when the running max grows
    const float m_new = std::max(t.m[i], vmax_lane(scores));
    const float correction = vexp2(vsplat(t.m[i] - m_new))[0];  // the multi-query step's exp2
    const vfloat weights = vexp2(scores - m_new);
    t.l[i] = t.l[i] * correction + vsum(weights);
    t.m[i] = m_new;
    float* acc_i = t.acc + i * head_dim;
    vfloat acc[kMaxHeadVectors];
    for (int c = 0; c < nv; ++c) acc[c] = vload(acc_i + c * kLanes) * correction;
    for (int64_t j = 0; j < visible; ++j) {
      const float weight = weights[j];
      for (int c = 0; c < nv; ++c) acc[c] += weight * vload(v_rows + j * v_stride + c * kLanes);
    }
    for (int c = 0; c < nv; ++c) vstore(acc_i + c * kLanes, acc[c]);
  }
}

}  // namespace
}  // namespace pdserve

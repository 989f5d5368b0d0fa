// The multi-query step of the CPU paged attention (attention.cpp): one tile of up to kLanes keys
// against every query of a work item at once, as two small register-blocked GEMMs.
//
// The per-query step reads each key row once per query and folds kLanes dot products into one
// score vector with a shuffle tree; with many queries per item (a prompt chunk on a cached
// prefix: 16 rows x the GQA group) that is mostly shuffles and loads, not FMAs. Here the key tile
// is transposed once into scratch (kt[d][j] = K_j[d]) and shared by all the item's queries:
//
//   S[i][:]  = sum_d q_i[d] * kt[d][:]       kTreeRows queries at a time, one FMA per (query, d),
//                                           summed in the per-query step's order (below)
//   online softmax per query (as the per-query step; the block's corrections in one vexp2),
//   P[i][j] to scratch
//   acc[i]   = acc[i] * corr_i + sum_j P[i][j] * V_j     kPvRows queries x up to 4 vectors of
//                                           head_dim in registers, each V vector loaded once per
//                                           kPvRows queries
//
// Query rows are padded to kQueryPad in scratch; padded rows never see a key (P = 0, corr = 1).
//
// Both steps give a query the same result bit for bit, whichever served it (a token verified in a
// 5-row item, recomputed in a prompt chunk or decoded alone): the same sum order for its scores
// (score_rows), the same exp2 for its corrections (vexp2) and the same P x V order. Quantized
// activations turn the last-ulp differences of two orders into different int8 codes, so greedy
// output with speculation or after a preemption would depend on the batch otherwise.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <utility>

#include "vec.h"

namespace pdserve {

constexpr int kScoreRows = 8;                  // score accumulators in flight (FMA latency x ports)
constexpr int kPvRows = kLanes == 16 ? 6 : 2;  // 6 x 4 zmm or 2 x 4 ymm accumulators, + 4 V vectors
constexpr int kQueryPad = 24;                  // a multiple of kScoreRows and kPvRows
static_assert(kScoreRows <= kLanes, "a block's corrections are one vector");

// 2^x for x <= 0 (Cephes exp2f polynomial on [-0.5, 0.5], relative error ~2e-7); exactly 0
// below -127, so masked scores (-inf) get weight 0.
inline vfloat vexp2(vfloat x) {
  x = x < -127.f ? vsplat(-127.f) : x;
  vfloat shifted = x + 0.5f;
  vfloat n = __builtin_convertvector(__builtin_convertvector(shifted, vint), vfloat);
  n = n > shifted ? n - 1.f : n;  // truncation rounded negatives up: floor(x + 0.5)
  vfloat f = x - n;
  vfloat p = vsplat(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  vint bits = (__builtin_convertvector(n, vint) + 127) << 23;  // 2^n; n = -127 gives +0
  vfloat two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Lane masks of the kLanes x kLanes transpose: at level s (block width w = kLanes >> (s + 1)),
// rows i and i + w (i & w == 0) swap their off-diagonal w x w blocks; after every level the
// square is transposed. lo: lanes of row i after the swap, hi: of row i + w.
template <std::size_t... S>
constexpr std::array<vint, sizeof...(S)> make_block_swaps(bool is_hi, std::index_sequence<S...>) {
  return {lanes_of([is_hi](int i) {
    const int w = kLanes >> (S + 1);
    if (is_hi) return (i & w) ? kLanes + i : i + w;
    return (i & w) ? kLanes + i - w : i;
  })...};
}
constexpr std::array<vint, kLog2Lanes> kSwapLo = make_block_swaps(false, std::make_index_sequence<kLog2Lanes>{});
constexpr std::array<vint, kLog2Lanes> kSwapHi = make_block_swaps(true, std::make_index_sequence<kLog2Lanes>{});

inline void transpose_square(vfloat* m) {
#pragma GCC unroll 4
  for (int level = 0; level < kLog2Lanes; ++level) {
    const int w = kLanes >> (level + 1);
    const vint lo = kSwapLo[level], hi = kSwapHi[level];
#pragma GCC unroll 16
    for (int i = 0; i < kLanes; ++i) {
      if (i & w) continue;
      const vfloat a = m[i], b = m[i + w];
      m[i] = __builtin_shuffle(a, b, lo);
      m[i + w] = __builtin_shuffle(a, b, hi);
    }
  }
}

// kt[d * kLanes + j] = rows[j * stride + d] for j < n, 0 for n <= j < kLanes (rows past n are
// not read: they may lie past the block).
inline void transpose_tile(const float* rows, int64_t stride, int64_t n, int64_t head_dim, float* kt) {
  for (int64_t c = 0; c < head_dim; c += kLanes) {
    vfloat m[kLanes];
#pragma GCC unroll 16
    for (int j = 0; j < kLanes; ++j) m[j] = j < n ? vload(rows + j * stride + c) : vfloat{};
    transpose_square(m);
#pragma GCC unroll 16
    for (int d = 0; d < kLanes; ++d) vstore(kt + (c + d) * kLanes, m[d]);
  }
}

// Scores in the per-query step's order (attention_query.h: tile_scores): for each lane class l
// (the dimensions d = c * kLanes + l) a sequential sum over c, then the classes folded pairwise,
// l with l + kLanes / 2, then l with l + kLanes / 4, ..., as its shuffle tree adds them. Here
// lane j holds key j, so every fold is a plain vector add. The tree runs depth first over
// kTreeRows queries, kLeaves lane classes at a time (kTreeRows x kLeaves independent FMA chains:
// 8 keep two FMA ports busy), so at most log2(kLanes) partial sums per query wait in registers.
constexpr int kTreeRows = kLanes == 16 ? 4 : 2;
// Registers: kTreeRows x kLeaves accumulators, kTreeRows per tree level above the leaves waiting
// for their right half, one K vector: 8 + 12 + 1 of 32 zmm (AVX-512), 8 + 2 + 1 of 16 ymm (AVX2).
constexpr int kLeaves = kLanes == 16 ? 2 : kLanes / 2;
static_assert(kScoreRows % kTreeRows == 0, "score_rows takes kTreeRows queries at a time");

// Leaves L0, L0 + kLanes / kLeaves, ... (each its own sum over c), folded into one node.
template <int L0>
inline void score_leaves(const float* q, int64_t head_dim, const float* kt, vfloat* out) {
  constexpr int kStep = kLanes / kLeaves;
  vfloat a[kLeaves][kTreeRows] = {};
  for (int64_t c = 0; c < head_dim; c += kLanes) {
#pragma GCC unroll 8
    for (int f = 0; f < kLeaves; ++f) {
      const int l = L0 + f * kStep;
      const vfloat k = vload(kt + (c + l) * kLanes);
#pragma GCC unroll 4
      for (int r = 0; r < kTreeRows; ++r) a[f][r] += vsplat(q[r * head_dim + c + l]) * k;
    }
  }
  // the folds inside the node: leaf f with f + width, width = kLeaves / 2, ..., 1
#pragma GCC unroll 8
  for (int width = kLeaves / 2; width >= 1; width /= 2)
#pragma GCC unroll 8
    for (int f = 0; f < width; ++f)
#pragma GCC unroll 4
      for (int r = 0; r < kTreeRows; ++r) a[f][r] += a[f + width][r];
#pragma GCC unroll 4
  for (int r = 0; r < kTreeRows; ++r) out[r] = a[0][r];
}

// The tree node over lane classes L0, L0 + Step, L0 + 2 Step, ...: its left half + its right half.
template <int L0, int Step>
inline void score_node(const float* q, int64_t head_dim, const float* kt, vfloat* out) {
  if constexpr (Step * kLeaves == kLanes) {
    score_leaves<L0>(q, head_dim, kt, out);
  } else {
    vfloat right[kTreeRows];
    score_node<L0, 2 * Step>(q, head_dim, kt, out);
    score_node<L0 + Step, 2 * Step>(q, head_dim, kt, right);
#pragma GCC unroll 4
    for (int r = 0; r < kTreeRows; ++r) out[r] += right[r];
  }
}

// scores[r] lane j = q_r . K_j for the kScoreRows query rows at q (stride head_dim).
inline void score_rows(const float* q, int64_t head_dim, const float* kt, vfloat* scores) {
  for (int r = 0; r < kScoreRows; r += kTreeRows) score_node<0, 1>(q + r * head_dim, head_dim, kt, scores + r);
}

// acc_r = acc_r * corr_r + sum_{j < n} p[r][j] * V_j for the kPvRows rows at acc (stride
// head_dim), C vectors of head_dim at a time.
template <int C>
inline void pv_rows(const float* p, const float* corr, float* acc, int64_t head_dim, const float* v_rows,
                    int64_t v_stride, int64_t n) {
  for (int64_t c0 = 0; c0 < head_dim; c0 += C * kLanes) {
    vfloat a[kPvRows][C];
#pragma GCC unroll 6
    for (int r = 0; r < kPvRows; ++r) {
      const vfloat cr = vsplat(corr[r]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) a[r][c] = vload(acc + r * head_dim + c0 + c * kLanes) * cr;
    }
    for (int64_t j = 0; j < n; ++j) {
      vfloat v[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) v[c] = vload(v_rows + j * v_stride + c0 + c * kLanes);
#pragma GCC unroll 6
      for (int r = 0; r < kPvRows; ++r) {
        const vfloat pj = vsplat(p[r * kLanes + j]);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) a[r][c] += pj * v[c];
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < kPvRows; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) vstore(acc + r * head_dim + c0 + c * kLanes, a[r][c]);
  }
}

// Scratch rows of the multi-query step, [kQueryPad-padded queries]: q (scaled to base 2), acc
// [.., head_dim], the running max m and sum l, and this tile's P [.., kLanes] and corrections.
struct TileRows {
  float *q, *acc, *m, *l, *p, *corr;
};

// Rows nq .. padded end: P = 0 and correction 1 for every tile, so they never move.
inline void init_padding(const TileRows& t, int64_t nq, int64_t nq_padded) {
  for (int64_t i = nq; i < nq_padded; ++i) {
    std::fill(t.p + i * kLanes, t.p + (i + 1) * kLanes, 0.f);
    t.corr[i] = 1.f;
  }
}

// One key tile (kt transposed, n keys; V rows at v_rows) against queries 0 .. nq - 1;
// visible(i) = how many of the tile's keys query i sees (causal; <= 0: none).
template <class Visible>
inline void attend_tile_rows(const TileRows& t, int64_t nq, int64_t head_dim, const float* kt, int64_t n,
                             const float* v_rows, int64_t v_stride, Visible visible) {
  for (int64_t i0 = 0; i0 < nq; i0 += kScoreRows) {
    vfloat scores[kScoreRows], weights[kScoreRows];
    score_rows(t.q + i0 * head_dim, head_dim, kt, scores);
    // online softmax per query; the corrections 2^(m_old - m_new) of the block as one vector
    // (lanes of rows that see no key: 2^0 = 1, and P = 0, so they do not move)
    alignas(64) float m_old[kLanes] = {}, m_new[kLanes] = {};
    const int64_t rows = std::min<int64_t>(kScoreRows, nq - i0);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r, seen = visible(i);
      if (seen <= 0) {  // also keeps m = -inf from meeting itself (a split before this query)
        weights[r] = vfloat{};
        continue;
      }
      const vfloat s = kIota < static_cast<int>(seen) ? scores[r] : vsplat(-INFINITY);
      m_old[r] = t.m[i];
      m_new[r] = t.m[i] = std::max(t.m[i], vmax_lane(s));
      weights[r] = vexp2(s - m_new[r]);
    }
    const vfloat corr = vexp2(vload(m_old) - vload(m_new));  // m_old = -inf: 0
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      t.corr[i] = corr[r];
      t.l[i] = t.l[i] * corr[r] + vsum(weights[r]);
      vstore(t.p + i * kLanes, weights[r]);
    }
  }
  const int64_t nv = head_dim / kLanes;
  for (int64_t i0 = 0; i0 < nq; i0 += kPvRows) {
    const float *p = t.p + i0 * kLanes, *corr = t.corr + i0;
    float* acc = t.acc + i0 * head_dim;
    if (nv % 4 == 0)
      pv_rows<4>(p, corr, acc, head_dim, v_rows, v_stride, n);
    else if (nv % 2 == 0)
      pv_rows<2>(p, corr, acc, head_dim, v_rows, v_stride, n);
    else
      pv_rows<1>(p, corr, acc, head_dim, v_rows, v_stride, n);
  }
}

}  // namespace pdserve

// The quantized matmul's inner loops, shared by quant_linear.cpp (the ops) and decoder_stack.cpp
// (the decode step in one parallel region): one definition, so both give the same bits.
//
// y = x @ W for W in a GGUF block format: a tile is R rows of x against NP panels of kLanes
// output columns, summed block by block. The pieces, by what they do:
//     quant_format.h   the formats, their packed layout (the full description) and constants
//     quant_dot.h      the ISA's byte dot products (per-ISA intrinsic wrappers)
//     quant_blocks.h   a 32-input block's sums: Q8_0, Q4_0 / Q4_1, Q5_0 / Q5_1
//     quant_kquants.h  Q6_K's block sums (Q4_K reuses the 4-bit ones)
//     this file        tiles over panels, the row/format dispatch, the thread split
// Everything is in an anonymous namespace on purpose: each library is built for one ISA and
// several are loaded side by side (tests compare them), so no symbol of this code may be shared.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>

#include "quant_blocks.h"
#include "quant_dot.h"
#include "quant_format.h"
#include "quant_kquants.h"
#include "vec.h"

namespace pdserve {
namespace {

// acc[r][j] = sum over blocks of column panel p0 + j against row r; written to out.
template <int F, bool Exact, int R, int NP>
void tile(const Rows& rows, const unsigned char* packed, int64_t p0, float* out, int64_t out_stride,
          int64_t N) {
  constexpr int64_t BB = block_bytes<F>();
  constexpr int kSub = F == kQ4K || F == kQ6K ? 8 : 1;  // 32-input blocks per weight block
  const int64_t nb = rows.nb, nwb = nb / kSub;
  vfloat acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NP; ++j) acc[r][j] = vfloat{};
  for (int64_t wb = 0; wb < nwb; ++wb) {
    const unsigned char* blk[NP];
    for (int j = 0; j < NP; ++j) blk[j] = packed + ((p0 + j) * nwb + wb) * BB;
    // One work item ahead (the panels the next item reads, or the next weight's first ones):
    // block by block, so those bytes arrive while this item computes. Measured at batch-1
    // decode on the default model (Xeon, AVX-512, 2 threads): the layer matmuls and the LM head
    // over 96 MB of blocks took 2.4 ms instead of 3.4 without it. A prefetch past the end of
    // the weight is harmless (no fault); it fetches some other bytes. The K-quants' 2.4-3.4 KB
    // per panel are spread over their 8 blocks of 32 below (all at once, Q4_K's matmuls over
    // 30 decode-shaped weights took 1.55 ms instead of 1.26: loadtests/bench_quant_kernels).
    if constexpr (kSub == 1)
      for (int j = 0; j < NP; ++j) prefetch_bytes(blk[j] + kPanels * nwb * BB, BB);
    vfloat sums[R][NP];
    const unsigned char* qs[NP];
    if constexpr (F == kQ4K) {
      // 8 sub-blocks, each a 4-bit block of scale d * sc[s] and offset -dmin * mn[s]
      for (int s = 0; s < kSub; ++s) {
        const int64_t b = wb * kSub + s;
        for (int j = 0; j < NP; ++j) {
          qs[j] = blk[j] + (20 + 16 * s) * kLanes;
          prefetch_bytes(blk[j] + kPanels * nwb * BB + s * (BB / kSub), BB / kSub);
        }
        block_sums<kQ4, Exact, R, NP>(rows, b, qs, sums);
        for (int j = 0; j < NP; ++j) {
          const vfloat scale = vload_half(blk[j]) * vload_u8(blk[j] + (4 + s) * kLanes);
          const vfloat offset = -(vload_half(blk[j] + 2 * kLanes) * vload_u8(blk[j] + (12 + s) * kLanes));
          for (int r = 0; r < R; ++r) {
            acc[r][j] += scale * sums[r][j];
            acc[r][j] += offset * vsplat(rows.xsum[r * nb + b]);
          }
        }
      }
      continue;
    }
    if constexpr (F == kQ6K) {
      // 8 blocks of 32, each two halves of scale d * sc[2 s] and d * sc[2 s + 1]
      for (int s = 0; s < kSub; ++s) {
        const int64_t b = wb * kSub + s;
        const unsigned char* hib[NP];
        for (int j = 0; j < NP; ++j) {
          qs[j] = blk[j] + (18 + 24 * s) * kLanes;
          hib[j] = qs[j] + 16 * kLanes;
          prefetch_bytes(blk[j] + kPanels * nwb * BB + s * (BB / kSub), BB / kSub);
        }
        vfloat hi_sums[R][NP];
        block_sums_q6k<Exact, R, NP>(rows, b, qs, hib, sums, hi_sums);
        for (int j = 0; j < NP; ++j) {
          const vfloat d = vload_half(blk[j]);
          const auto* sc = reinterpret_cast<const signed char*>(blk[j] + (2 + 2 * s) * kLanes);
          const vfloat scale_lo = d * vload_int8(sc), scale_hi = d * vload_int8(sc + kLanes);
          for (int r = 0; r < R; ++r) {
            acc[r][j] += scale_lo * sums[r][j];
            acc[r][j] += scale_hi * hi_sums[r][j];
          }
        }
      }
      continue;
    }
    for (int j = 0; j < NP; ++j) qs[j] = blk[j] + (F == kQ8_0 ? 2 : 4) * kLanes;
    block_sums<F, Exact, R, NP>(rows, wb, qs, sums);
    for (int j = 0; j < NP; ++j) {
      const vfloat d = vload_half(blk[j]);
      for (int r = 0; r < R; ++r) acc[r][j] += d * sums[r][j];
      if constexpr (F == kQ4 || F == kQ5) {
        const vfloat m = vload_half(blk[j] + 2 * kLanes);
        for (int r = 0; r < R; ++r) acc[r][j] += m * vsplat(rows.xsum[r * nb + wb]);
      }
    }
  }
  for (int j = 0; j < NP; ++j) {
    const int64_t col = (p0 + j) * kLanes;
    const int64_t width = std::min<int64_t>(kLanes, N - col);
    for (int r = 0; r < R; ++r) vstore_first(out + r * out_stride + col, acc[r][j], width);
  }
}

template <int F, bool Exact, int R>
void rows_tile(const Rows& rows, const unsigned char* packed, int64_t p0, int64_t P, float* out,
               int64_t os, int64_t N) {
  if (p0 + kPanels <= P) return tile<F, Exact, R, kPanels>(rows, packed, p0, out, os, N);
  for (int64_t p = p0; p < P; ++p) tile<F, Exact, R, 1>(rows, packed, p, out, os, N);
}

template <int F, bool Exact>
void rows_tile(int num_rows, const Rows& rows, const unsigned char* packed, int64_t p0, int64_t P,
               float* out, int64_t os, int64_t N) {
  switch (num_rows) {
    case 1: return rows_tile<F, Exact, 1>(rows, packed, p0, P, out, os, N);
    case 2: return rows_tile<F, Exact, 2>(rows, packed, p0, P, out, os, N);
#ifdef __AVX512F__
    case 3: return rows_tile<F, Exact, 3>(rows, packed, p0, P, out, os, N);
    case 4: return rows_tile<F, Exact, 4>(rows, packed, p0, P, out, os, N);
#endif
  }
}

// Work items [begin, end) of a packed weight (P panels of kLanes columns, kPanels panels per
// item) for all M rows: their columns of out [M, N] (row stride N). What one thread does of a
// matmul; the items split between threads as ATen's static split does (split_items).
inline void multiply_items(const Rows& rows, int64_t M, const unsigned char* wp, int64_t P, int64_t N,
                           int64_t format, bool exact, int64_t begin, int64_t end, float* out) {
  for (int64_t item = begin; item < end; ++item)
    for (int64_t m = 0; m < M; m += kRows) {
      const int num_rows = static_cast<int>(std::min<int64_t>(kRows, M - m));
      const Rows at_m = rows.at(m);
      float* o = out + m * N;
      if (format == kQ4) {
        if (exact) rows_tile<kQ4, true>(num_rows, at_m, wp, item * kPanels, P, o, N, N);
        else rows_tile<kQ4, false>(num_rows, at_m, wp, item * kPanels, P, o, N, N);
      } else if (format == kQ5) {
        if (exact) rows_tile<kQ5, true>(num_rows, at_m, wp, item * kPanels, P, o, N, N);
        else rows_tile<kQ5, false>(num_rows, at_m, wp, item * kPanels, P, o, N, N);
      } else if (format == kQ4K) {
        if (exact) rows_tile<kQ4K, true>(num_rows, at_m, wp, item * kPanels, P, o, N, N);
        else rows_tile<kQ4K, false>(num_rows, at_m, wp, item * kPanels, P, o, N, N);
      } else if (format == kQ6K) {
        if (exact) rows_tile<kQ6K, true>(num_rows, at_m, wp, item * kPanels, P, o, N, N);
        else rows_tile<kQ6K, false>(num_rows, at_m, wp, item * kPanels, P, o, N, N);
      } else {
        if (exact) rows_tile<kQ8_0, true>(num_rows, at_m, wp, item * kPanels, P, o, N, N);
        else rows_tile<kQ8_0, false>(num_rows, at_m, wp, item * kPanels, P, o, N, N);
      }
    }
}

// Work items of a weight of P panels.
inline int64_t num_items(int64_t P) { return (P + kPanels - 1) / kPanels; }

// Thread t of n's items [first, second) of `items`: ATen's static split (at::parallel_for with
// grain 1 gives thread t the items from t * ceil(items / n)).
inline std::pair<int64_t, int64_t> split_items(int64_t items, int64_t t, int64_t n) {
  const int64_t per_thread = (items + n - 1) / n;
  const int64_t begin = std::min(items, t * per_thread);
  return {begin, std::min(items, begin + per_thread)};
}

}  // namespace
}  // namespace pdserve

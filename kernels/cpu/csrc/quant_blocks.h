// One 32-input block's sums for the block formats (Q8_0, Q4_0 / Q4_1, Q5_0 / Q5_1), with x
// quantized to int8 (integer dot products) or kept in fp32 (exact); and the per-row activation
// preparation they read. Formats and layout: quant_format.h. Anonymous namespace: see there.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "quant_dot.h"
#include "quant_format.h"
#include "vec.h"

namespace pdserve {
namespace {

// One row's activations in blocks of 32: per block xsum (the fp32 sum of x, the 4-bit offsets'
// factor) and, unless xq is null, xq int8 [K] and dx: dx = max|x| / 127 and
// xq = round(x * (127 / max|x|)), in fp32, exactly as kernels.quant.quantize_activations_ref.
void prepare_row(const float* x, int64_t nb, float* xsum, int8_t* xq, float* dx) {
  constexpr int V = kBlock / kLanes;
  for (int64_t b = 0; b < nb; ++b) {
    vfloat v[V], amax = vfloat{}, sum = vfloat{};
    for (int i = 0; i < V; ++i) {
      v[i] = vload(x + b * kBlock + i * kLanes);
      const vfloat a = v[i] < vfloat{} ? -v[i] : v[i];
      amax = amax > a ? amax : a;
      sum += v[i];
    }
    xsum[b] = vsum(sum);
    if (xq == nullptr) continue;
    const float m = vmax_lane(amax);
    const float inv = m > 0.0f ? 127.0f / m : 0.0f;
    dx[b] = m / 127.0f;
    for (int i = 0; i < V; ++i) {
      const vint q = vround(v[i] * inv);
      for (int c = 0; c < kLanes; ++c) xq[b * kBlock + i * kLanes + c] = static_cast<int8_t>(q[c]);
    }
  }
}

// Where a tile reads its rows: fp32 x (exact) or the quantized rows, and the per-block factors.
struct Rows {
  const float* x;     // [M, x_stride] fp32
  int64_t x_stride;
  const int8_t* xq;   // [M, K] int8, or null (exact)
  const float* dx;    // [M, nb]
  const float* xsum;  // [M, nb]
  int64_t K, nb;
  Rows at(int64_t m) const {
    return {x + m * x_stride, x_stride, xq ? xq + m * K : nullptr, dx + m * nb, xsum + m * nb, K, nb};
  }
};

// byte t of every lane as int lanes: zero-extended (4-bit: the nibble pair) or sign-extended
template <int T, bool Signed>
inline vint lane_byte(vint v) {
  if constexpr (Signed) return (v << (24 - 8 * T)) >> 24;
  return (v >> (8 * T)) & 255;
}

// The exact (fp32 x) block sums: lo/hi[r][j] += x * w over the block's two halves of inputs;
// qs[j]: panel j's quants of 32-input block b (F: kQ4, kQ5 or kQ8_0, the quants' layout; kQ5's
// fifth bits follow its nibbles: one word per lane, bits 2g / 2g + 1 of byte t for inputs 4g + t
// and 16 + 4g + t).
template <int F, int R, int NP>
void exact_block(const Rows& rows, int64_t b, const unsigned char* const* qs, vfloat (&lo)[R][NP],
                 vfloat (&hi)[R][NP]) {
  constexpr int64_t G = 4 * kLanes;
  const float* xb = rows.x + b * kBlock;
  vint high[NP];
  if constexpr (F == kQ5)
    for (int j = 0; j < NP; ++j) std::memcpy(&high[j], qs[j] + 4 * G, sizeof(vint));
  auto group = [&](auto t_const, const vint* raw, int g) {
    constexpr int T = decltype(t_const)::value;
    vfloat w0[NP], w1[NP];
    for (int j = 0; j < NP; ++j) {
      if constexpr (F == kQ4 || F == kQ5) {
        const vint pair = lane_byte<T, false>(raw[j]);
        vint q0 = pair & 15, q1 = pair >> 4;  // inputs 4 g + T, 16 + 4 g + T
        if constexpr (F == kQ5) {
          const vint h = lane_byte<T, false>(high[j]);
          q0 |= ((h >> (2 * g)) & 1) << 4;
          q1 |= ((h >> (2 * g + 1)) & 1) << 4;
        }
        w0[j] = __builtin_convertvector(q0, vfloat);
        w1[j] = __builtin_convertvector(q1, vfloat);
      } else {
        w0[j] = __builtin_convertvector(lane_byte<T, true>(raw[j]), vfloat);  // input 4 g + T
      }
    }
    for (int r = 0; r < R; ++r) {
      const float* xr = xb + r * rows.x_stride;
      if constexpr (F == kQ4 || F == kQ5) {
        const vfloat x0 = vsplat(xr[4 * g + T]), x1 = vsplat(xr[16 + 4 * g + T]);
        for (int j = 0; j < NP; ++j) {
          lo[r][j] += x0 * w0[j];
          hi[r][j] += x1 * w1[j];
        }
      } else {
        const vfloat x0 = vsplat(xr[4 * g + T]);
        for (int j = 0; j < NP; ++j) (T % 2 ? hi : lo)[r][j] += x0 * w0[j];
      }
    }
  };
  const int groups = F == kQ8_0 ? 8 : 4;
  for (int g = 0; g < groups; ++g) {
    vint raw[NP];
    for (int j = 0; j < NP; ++j) std::memcpy(&raw[j], qs[j] + g * G, sizeof(vint));
    group(std::integral_constant<int, 0>{}, raw, g);
    group(std::integral_constant<int, 1>{}, raw, g);
    group(std::integral_constant<int, 2>{}, raw, g);
    group(std::integral_constant<int, 3>{}, raw, g);
  }
}

inline void prefetch_bytes(const unsigned char* p, int64_t n) {
  for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, 3);
}

// sums[r][j] = sum over 32-input block b of x[k] q[k] (times dx when x is quantized), for row r
// and panel j, whose quants of that block start at qs[j] (F: kQ4 or kQ8_0, their layout). Two
// sums per block (the first and the last 16 inputs, or even and odd groups) keep 2 * R * NP
// independent chains where an instruction accumulates in place (FMA, vpdpbusd).
template <int F, bool Exact, int R, int NP>
inline void block_sums(const Rows& rows, int64_t b, const unsigned char* const* qs, vfloat (&sums)[R][NP]) {
  constexpr int64_t G = 4 * kLanes;  // bytes of one group of 4 inputs across the panel's columns
  const int64_t nb = rows.nb, K = rows.K;
  if constexpr (Exact) {
    vfloat lo[R][NP], hi[R][NP];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NP; ++j) lo[r][j] = hi[r][j] = vfloat{};
    exact_block<F, R, NP>(rows, b, qs, lo, hi);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NP; ++j) sums[r][j] = lo[r][j] + hi[r][j];
  } else {
    const int8_t* xb = rows.xq + b * kBlock;
    ivec lo[R][NP], hi[R][NP];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NP; ++j) lo[r][j] = hi[r][j] = isplat(0);
    if constexpr (F == kQ4 || F == kQ5) {
      ivec high[NP];  // kQ5: the fifth bits, shifted right by 2 per group (bits 2g, 2g + 1 of each byte)
      if constexpr (F == kQ5)
        for (int j = 0; j < NP; ++j) high[j] = iload(qs[j] + 4 * G);
      for (int g = 0; g < 4; ++g) {
        ivec wl[NP], wh[NP];
        for (int j = 0; j < NP; ++j) {
          const ivec raw = iload(qs[j] + g * G);
          wl[j] = low_nibbles(raw);
          wh[j] = high_nibbles(raw);
          if constexpr (F == kQ5) {
            wl[j] = with_high<0, 1>(wl[j], high[j]);
            wh[j] = with_high<1, 1>(wh[j], high[j]);
            high[j] = shift_right2(high[j]);
          }
        }
        for (int r = 0; r < R; ++r) {
          const ivec xl = xsplat(xb + r * K + 4 * g), xh = xsplat(xb + r * K + 16 + 4 * g);
          for (int j = 0; j < NP; ++j) {
            // 5-bit codes: int32 sums (dot_q4's int16 ones could overflow without VNNI)
            lo[r][j] = F == kQ5 ? dot_u8(lo[r][j], wl[j], xl) : dot_q4(lo[r][j], wl[j], xl);
            ivec& h = kSplitSums ? hi[r][j] : lo[r][j];
            h = F == kQ5 ? dot_u8(h, wh[j], xh) : dot_q4(h, wh[j], xh);
          }
        }
      }
    } else {
      for (int g = 0; g < 8; g += 2) {
        ivec w0[NP], w1[NP];
        for (int j = 0; j < NP; ++j) {
          w0[j] = iload(qs[j] + g * G);
          w1[j] = iload(qs[j] + (g + 1) * G);
        }
        for (int r = 0; r < R; ++r) {
          const ivec x0 = xsplat(xb + r * K + 4 * g), x1 = xsplat(xb + r * K + 4 * g + 4);
          for (int j = 0; j < NP; ++j) {
            lo[r][j] = dot_s8(lo[r][j], w0[j], x0);
            ivec& h = kSplitSums ? hi[r][j] : lo[r][j];
            h = dot_s8(h, w1[j], x1);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const vfloat dx = vsplat(rows.dx[r * nb + b]);
      for (int j = 0; j < NP; ++j) {
        ivec total = F == kQ4 ? finish_q4(lo[r][j]) : lo[r][j];
        if (kSplitSums) total = iadd(total, F == kQ4 ? finish_q4(hi[r][j]) : hi[r][j]);
        sums[r][j] = dx * to_float(total);
      }
    }
  }
}

}  // namespace
}  // namespace pdserve

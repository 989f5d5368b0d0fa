// The K-quants' block sums: Q6_K's 32-input blocks of 6-bit codes (4-bit parts and 2-bit high
// parts); Q4_K's sub-blocks are 4-bit blocks (quant_blocks.h) with their own scales, applied in
// quant_tiles.h. Formats and layout: quant_format.h. Anonymous namespace: see there.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "quant_blocks.h"
#include "quant_dot.h"
#include "quant_format.h"
#include "vec.h"

namespace pdserve {
namespace {

// Q6_K's 32-input block b: lo[r][j] / hi[r][j] = the sums over its first / last 16 inputs of
// x[k] (q[k] - 32) (times dx when x is quantized), for row r and panel j, whose block holds its
// 4-bit parts at nib[j] (the 4-bit layout) and 2-bit parts at hib[j]: two words per lane, word
// w's byte t holding the high bits of inputs 4g + t, 16 + 4g + t for g = 2w (bits 0-1, 2-3) and
// g = 2w + 1 (bits 4-5, 6-7). The halves have their own scales, so their sums stay apart.
template <bool Exact, int R, int NP>
inline void block_sums_q6k(const Rows& rows, int64_t b, const unsigned char* const* nib,
                           const unsigned char* const* hib, vfloat (&lo)[R][NP], vfloat (&hi)[R][NP]) {
  constexpr int64_t G = 4 * kLanes;
  const int64_t nb = rows.nb, K = rows.K;
  if constexpr (Exact) {
    const float* xb = rows.x + b * kBlock;
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NP; ++j) lo[r][j] = hi[r][j] = vfloat{};
    auto group = [&](auto t_const, const vint* raw, const vint* high, int g) {
      constexpr int T = decltype(t_const)::value;
      const int shift = 4 * (g % 2);
      vfloat w0[NP], w1[NP];
      for (int j = 0; j < NP; ++j) {
        const vint nibbles = lane_byte<T, false>(raw[j]), h = lane_byte<T, false>(high[j]);
        w0[j] = __builtin_convertvector((nibbles & 15) | (((h >> shift) & 3) << 4), vfloat) - vsplat(32.f);
        w1[j] = __builtin_convertvector((nibbles >> 4) | (((h >> (shift + 2)) & 3) << 4), vfloat) - vsplat(32.f);
      }
      for (int r = 0; r < R; ++r) {
        const float* xr = xb + r * rows.x_stride;
        const vfloat x0 = vsplat(xr[4 * g + T]), x1 = vsplat(xr[16 + 4 * g + T]);
        for (int j = 0; j < NP; ++j) {
          lo[r][j] += x0 * w0[j];
          hi[r][j] += x1 * w1[j];
        }
      }
    };
    for (int g = 0; g < 4; ++g) {
      vint raw[NP], high[NP];
      for (int j = 0; j < NP; ++j) {
        std::memcpy(&raw[j], nib[j] + g * G, sizeof(vint));
        std::memcpy(&high[j], hib[j] + (g / 2) * G, sizeof(vint));
      }
      group(std::integral_constant<int, 0>{}, raw, high, g);
      group(std::integral_constant<int, 1>{}, raw, high, g);
      group(std::integral_constant<int, 2>{}, raw, high, g);
      group(std::integral_constant<int, 3>{}, raw, high, g);
    }
  } else {
    // unsigned codes q (0..63) against xq, then 32 * sum(xq) off each half: the same integers
    // as (q - 32) * xq, with the unsigned-by-signed byte product every ISA has
    const int8_t* xb = rows.xq + b * kBlock;
    const ivec thirty_two = isplat(0x20202020);
    ivec lo_i[R][NP], hi_i[R][NP], lo_c[R], hi_c[R];
    for (int r = 0; r < R; ++r) {
      lo_c[r] = hi_c[r] = isplat(0);
      for (int j = 0; j < NP; ++j) lo_i[r][j] = hi_i[r][j] = isplat(0);
    }
    for (int g = 0; g < 4; ++g) {
      ivec wl[NP], wh[NP];
      for (int j = 0; j < NP; ++j) {
        const ivec raw = iload(nib[j] + g * G), h = iload(hib[j] + (g / 2) * G);
        if (g % 2 == 0) {
          wl[j] = with_high<0, 2>(low_nibbles(raw), h);
          wh[j] = with_high<2, 2>(high_nibbles(raw), h);
        } else {
          wl[j] = with_high<4, 2>(low_nibbles(raw), h);
          wh[j] = with_high<6, 2>(high_nibbles(raw), h);
        }
      }
      for (int r = 0; r < R; ++r) {
        const ivec xl = xsplat(xb + r * K + 4 * g), xh = xsplat(xb + r * K + 16 + 4 * g);
        lo_c[r] = dot_u8(lo_c[r], thirty_two, xl);
        hi_c[r] = dot_u8(hi_c[r], thirty_two, xh);
        for (int j = 0; j < NP; ++j) {
          lo_i[r][j] = dot_u8(lo_i[r][j], wl[j], xl);
          hi_i[r][j] = dot_u8(hi_i[r][j], wh[j], xh);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const vfloat dx = vsplat(rows.dx[r * nb + b]);
      for (int j = 0; j < NP; ++j) {
        lo[r][j] = dx * to_float(isub(lo_i[r][j], lo_c[r]));
        hi[r][j] = dx * to_float(isub(hi_i[r][j], hi_c[r]));
      }
    }
  }
}

// kLanes bytes -> fp32 lanes (a Q4_K sub-block's 6-bit scales or mins, one per column)
inline vfloat vload_u8(const unsigned char* p) { return __builtin_convertvector(vwiden_u8(p), vfloat); }

}  // namespace
}  // namespace pdserve

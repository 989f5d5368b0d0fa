// The quantized matmul's inner loops, shared by quant_linear.cpp (the ops) and decoder_stack.cpp
// (the decode step in one parallel region): one definition, so both give the same bits.
//
// y = x @ W on CPU for W in a GGUF block format (Q8_0, or 4-bit: Q4_0 / Q4_1), with integer dot
// products: as llama.cpp does, each row of x is quantized once per call to 8 bits per block of
// 32 inputs (xq = round(x / dx), dx = max|x| / 127, an fp32 scale per block), and each block's
// sum of x[k] * q[k] becomes an int32 dot product of bytes (AVX512-VNNI / AVX-VNNI vpdpbusd;
// AVX2 and AVX-512BW: vpmaddubsw + vpmaddwd).
//
// Each 32 consecutive inputs k of one output column n form a block with an fp16 scale d (and,
// for 4-bit, an fp16 offset m): W[k, n] = d * q (Q8_0, q int8) or d * q + m (4-bit, q 0..15;
// Q4_0 is the 4-bit layout with m = -8 d, exact in fp16). Per block:
//     y[n] += d * dx * sum_k xq[k] q[k]  +  m * sum_k x[k]
// The integer sum is exact; the offset's factor sum_k x[k] is the fp32 sum of the unquantized
// x. The only approximation is x ~ dx * xq: |x - dx * xq| <= dx / 2 = max|x| / 254 per input
// (tests/kernels/test_cpu_quant_linear.py bounds y's error by it). With exact = true the kernel
// keeps x in fp32 instead (each byte widened to fp32 and multiplied-added; several times the
// arithmetic): the products are then those of dequantize-then-matmul, summed in another order.
//
// Packed layout (kernels/quant_cpu.py repacks the file's blocks once at load): panels of kLanes
// output columns, as in linear.cpp; panel p is [num_blocks, block_bytes] contiguous bytes, and
// one block of a panel is
//     4-bit: d [kLanes] fp16 | m [kLanes] fp16 | qs [4][kLanes][4] u8    (20 * kLanes bytes)
//     Q8_0:  d [kLanes] fp16 | qs [8][kLanes][4] i8                      (34 * kLanes bytes)
//     5-bit: the 4-bit block, then one word per lane of fifth bits        (24 * kLanes bytes)
//     Q4_K:  d [kLanes] fp16 | dmin [kLanes] fp16 | sc [8][kLanes] u8 | mn [8][kLanes] u8 |
//            8 x qs [4][kLanes][4] u8 (one per sub-block of 32)          (148 * kLanes bytes)
//     Q6_K:  d [kLanes] fp16 | sc [16][kLanes] i8 (per 16 inputs) | 8 x (low 4 bits of 32 inputs
//            as 4-bit qs [4][kLanes][4] u8, their high 2 bits [2][kLanes][4] u8: block_sums_q6k)
//                                                                         (210 * kLanes bytes)
// qs[g][c][t] is column c's file byte 4 g + t: one 32-bit lane per column holding 4 consecutive
// inputs, what a 4-byte dot product instruction consumes. For 4-bit, the low nibble is input
// 4 g + t and the high nibble input 16 + 4 g + t (the file's nibble order; Q4_K's nibbles are
// reordered to it at load, and its 6-bit scales and mins unpacked to a byte each). The bytes per
// weight are the file's own (20 or 34 per 32, 148 for Q4_K's 144 per 256, Q6_K's 210), so a decode step
// streams the file's bytes once. A Q4_K sub-block s is a 4-bit block whose scale is
// d * sc[s] and offset -dmin * mn[s] (both exact in fp32); a Q6_K value is d * sc * (q - 32)
// with q the 6-bit code (exact in fp32 too).
//
// Everything here is in an anonymous namespace on purpose: each library is built for one ISA and
// several are loaded side by side (tests compare them), so no symbol of this code may be shared.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace pdserve {
namespace {


constexpr int kBlock = 32;   // inputs per block, both formats
constexpr int kPanels = 2;   // panels per work item (the unit threads split)
#ifdef __AVX512F__
constexpr int kRows = 4;     // 32 zmm: 2 * 4 * 2 int sums + 4 * 2 fp32 sums + weights
#else
constexpr int kRows = 2;     // 16 ymm
#endif
enum Format : int64_t { kQ8_0 = 0, kQ4 = 1, kQ4K = 2, kQ6K = 3, kQ5 = 4 };

template <int F>
constexpr int64_t block_bytes() {
  return F == kQ4 ? 20 * kLanes : F == kQ5 ? 24 * kLanes : F == kQ4K ? 148 * kLanes : F == kQ6K ? 210 * kLanes
                                                                                                : 34 * kLanes;
}

// Inputs per block of a format (the K-quants: super-blocks of 256).
inline int64_t block_inputs(int64_t format) { return format == kQ4K || format == kQ6K ? 256 : 32; }

inline int64_t format_block_bytes(int64_t format) {
  return format == kQ4    ? block_bytes<kQ4>()
         : format == kQ5  ? block_bytes<kQ5>()
         : format == kQ4K ? block_bytes<kQ4K>()
         : format == kQ6K ? block_bytes<kQ6K>()
                          : block_bytes<kQ8_0>();
}

// ---- the ISA's 4-byte dot products: ivec is kLanes int32 lanes, each 4 bytes of one column ----
#if defined(__AVX512F__) && defined(__AVX512BW__)
using ivec = __m512i;
inline ivec iload(const unsigned char* p) { return _mm512_loadu_si512(p); }
inline ivec isplat(int32_t v) { return _mm512_set1_epi32(v); }
inline ivec iadd(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
inline ivec isub(ivec a, ivec b) { return _mm512_sub_epi32(a, b); }
// Q5 / Q6_K: per byte, a 4-bit value | the Bits bits at bit S of h's same byte, moved to bit 4
// (h's bits above them are masked off, so 16-bit shifts do not mix bytes); h >> 2 per 16 bits
template <int S, int Bits>
inline ivec with_high(ivec low4, ivec h) {
  const ivec mask = _mm512_set1_epi8((1 << Bits) - 1);
  return _mm512_or_si512(low4, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, S), mask), 4));
}
inline ivec shift_right2(ivec h) { return _mm512_srli_epi16(h, 2); }
inline ivec low_nibbles(ivec v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
inline ivec high_nibbles(ivec v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
inline vfloat to_float(ivec v) { return (vfloat)_mm512_cvtepi32_ps(v); }
#if defined(__AVX512VNNI__)
#define PDSERVE_VNNI 1
// acc += per lane, the 4 products of unsigned bytes w and signed bytes x
inline ivec dot_u8(ivec acc, ivec w, ivec x) { return _mm512_dpbusd_epi32(acc, w, x); }
#else
// vpmaddubsw's int16 pair sums cannot saturate: w <= 128 here (4-bit codes, |Q8_0|), and
// 2 * 128 * 127 < 2^15
inline ivec dot_u8(ivec acc, ivec w, ivec x) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
}
// 4-bit: the block's 8 vpmaddubsw results summed in int16 (each |.| <= 2 * 15 * 127, all 8:
// 30480 < 2^15), widened to int32 once per block
inline ivec dot_q4(ivec acc16, ivec w, ivec x) { return _mm512_add_epi16(acc16, _mm512_maddubs_epi16(w, x)); }
inline ivec finish_q4(ivec acc16) { return _mm512_madd_epi16(acc16, _mm512_set1_epi16(1)); }
#endif
// acc += per lane, the 4 products of signed bytes w and x: |w| times x with w's sign
inline ivec dot_s8(ivec acc, ivec w, ivec x) {
  const ivec signed_x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
  return dot_u8(acc, _mm512_abs_epi8(w), signed_x);
}
#elif defined(__AVX2__) && !defined(__AVX512F__)
using ivec = __m256i;
inline ivec iload(const unsigned char* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline ivec isplat(int32_t v) { return _mm256_set1_epi32(v); }
inline ivec iadd(ivec a, ivec b) { return _mm256_add_epi32(a, b); }
inline ivec isub(ivec a, ivec b) { return _mm256_sub_epi32(a, b); }
template <int S, int Bits>
inline ivec with_high(ivec low4, ivec h) {
  const ivec mask = _mm256_set1_epi8((1 << Bits) - 1);
  return _mm256_or_si256(low4, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, S), mask), 4));
}
inline ivec shift_right2(ivec h) { return _mm256_srli_epi16(h, 2); }
inline ivec low_nibbles(ivec v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline ivec high_nibbles(ivec v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
inline vfloat to_float(ivec v) { return (vfloat)_mm256_cvtepi32_ps(v); }
#if defined(__AVXVNNI__)
#define PDSERVE_VNNI 1
inline ivec dot_u8(ivec acc, ivec w, ivec x) { return _mm256_dpbusd_avx_epi32(acc, w, x); }
#else
inline ivec dot_u8(ivec acc, ivec w, ivec x) {  // no saturation: see the AVX-512BW version
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
inline ivec dot_q4(ivec acc16, ivec w, ivec x) { return _mm256_add_epi16(acc16, _mm256_maddubs_epi16(w, x)); }
inline ivec finish_q4(ivec acc16) { return _mm256_madd_epi16(acc16, _mm256_set1_epi16(1)); }
#endif
inline ivec dot_s8(ivec acc, ivec w, ivec x) { return dot_u8(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }
#else  // portable: GCC vectors, lane by lane
using ivec = vint;
inline ivec iload(const unsigned char* p) { ivec v; std::memcpy(&v, p, sizeof v); return v; }
inline ivec isplat(int32_t v) { return ivec{} + v; }
inline ivec iadd(ivec a, ivec b) { return a + b; }
inline ivec isub(ivec a, ivec b) { return a - b; }
template <int S, int Bits>
inline ivec with_high(ivec low4, ivec h) { return low4 | (((h >> S) & (0x01010101 * ((1 << Bits) - 1))) << 4); }
inline ivec shift_right2(ivec h) { return h >> 2; }
inline ivec low_nibbles(ivec v) { return v & 0x0f0f0f0f; }
inline ivec high_nibbles(ivec v) { return (v >> 4) & 0x0f0f0f0f; }
inline vfloat to_float(ivec v) { return __builtin_convertvector(v, vfloat); }
template <bool Signed>
inline ivec dot_bytes(ivec acc, ivec w, ivec x) {
  for (int c = 0; c < kLanes; ++c)
    for (int t = 0; t < 4; ++t) {
      const int wt = Signed ? static_cast<int8_t>(w[c] >> 8 * t) : static_cast<uint8_t>(w[c] >> 8 * t);
      acc[c] += wt * static_cast<int8_t>(x[c] >> 8 * t);
    }
  return acc;
}
inline ivec dot_u8(ivec acc, ivec w, ivec x) { return dot_bytes<false>(acc, w, x); }
inline ivec dot_s8(ivec acc, ivec w, ivec x) { return dot_bytes<true>(acc, w, x); }
#define PDSERVE_VNNI 1  // int32 sums throughout, like vpdpbusd
#endif

#ifdef PDSERVE_VNNI
// vpdpbusd accumulates in place (5-cycle latency): two chains per tile column, int32 throughout
constexpr bool kSplitSums = true;
inline ivec dot_q4(ivec acc, ivec w, ivec x) { return dot_u8(acc, w, x); }
inline ivec finish_q4(ivec acc) { return acc; }
#else
constexpr bool kSplitSums = false;  // one add chain (1 cycle) per tile column: fewer registers
#endif

// 4 bytes of xq at p, in every lane
inline ivec xsplat(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return isplat(v);
}

// kLanes fp16 values -> fp32 lanes
inline vfloat vload_half(const unsigned char* p) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__) && defined(__AVX__)
  return (vfloat)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vfloat out;
  for (int c = 0; c < kLanes; ++c) {
    uint16_t h;
    std::memcpy(&h, p + 2 * c, 2);
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float value;
    if (exp == 0) {
      value = static_cast<float>(man) * (1.0f / 16777216.0f);  // subnormal: man * 2^-24
    } else {
      const uint32_t bits = (exp == 31 ? 0x7f800000u : (exp + 112) << 23) | (man << 13);
      std::memcpy(&value, &bits, 4);
    }
    uint32_t bits;
    std::memcpy(&bits, &value, 4);
    bits |= sign;
    std::memcpy(&out[c], &bits, 4);
  }
  return out;
#endif
}

// fp32 lanes -> nearest int32 (ties to even, the default rounding mode: torch.round's rule)
inline vint vround(vfloat v) {
#if defined(__AVX512F__)
  return (vint)_mm512_cvtps_epi32((__m512)v);
#elif defined(__AVX__)
  return (vint)_mm256_cvtps_epi32((__m256)v);
#else
  vint out;
  for (int c = 0; c < kLanes; ++c) out[c] = static_cast<int>(std::nearbyint(v[c]));
  return out;
#endif
}

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

// The ISA's byte dot products for the quantized matmul, one set of wrappers per instruction set
// (AVX-512BW with or without VNNI, AVX2 with or without AVX-VNNI, portable GCC vectors), and the
// loads they need: activation bytes in every lane, fp16 scales, fp32 -> int32 rounding.
// Anonymous namespace: see quant_format.h.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "quant_format.h"
#include "vec.h"

namespace pdserve {
namespace {

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

}  // namespace
}  // namespace pdserve

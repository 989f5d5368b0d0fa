// The SIMD vocabulary shared by the CPU kernels: one vector of kLanes fp32 values, as wide as
// one register of the ISA the library is built for.
//
// 16 lanes (a zmm, one cache line) with AVX-512, 8 (a ymm) with AVX2, 4 (an xmm or a NEON
// register) otherwise. The width is native on purpose: a GCC vector wider than the registers is
// split into halves that live on the stack, so every accumulator update waits for a store and a
// load (a 16-lane type compiled for AVX2 made the matmul 2-3x slower than torch's). Kernels are
// written once in terms of kLanes; permutation tables below are built for whatever it is.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

namespace pdserve {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
constexpr int kLog2Lanes = kLanes == 16 ? 4 : kLanes == 8 ? 3 : 2;
static_assert(1 << kLog2Lanes == kLanes, "kLanes must be a power of two");

typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef int vint __attribute__((vector_size(kLanes * sizeof(int))));

inline vfloat vload(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void vstore(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

// The first `width` (<= kLanes) lanes of v to p: a matmul's last column panel, narrower than a vector.
inline void vstore_first(float* p, vfloat v, int64_t width) {
  if (width == kLanes) return vstore(p, v);
  float tmp[kLanes];
  vstore(tmp, v);
  std::memcpy(p, tmp, width * sizeof(float));
}

// kLanes one-byte codes of a quantized KV row, widened to int32 lanes (vpmovsxbd / vpmovzxbd;
// GCC's __builtin_convertvector from a byte vector goes lane by lane, 3x slower than fp32 rows).
inline vint vwiden_s8(const signed char* p) {
#if defined(__AVX512F__)
  return (vint)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  return (vint)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  vint r;
  for (int i = 0; i < kLanes; ++i) r[i] = p[i];
  return r;
#endif
}

inline vint vwiden_u8(const unsigned char* p) {
#if defined(__AVX512F__)
  return (vint)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  return (vint)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  vint r;
  for (int i = 0; i < kLanes; ++i) r[i] = p[i];
  return r;
#endif
}

// int8 codes as fp32 (before the row's scale)
inline vfloat vload_int8(const signed char* p) { return __builtin_convertvector(vwiden_s8(p), vfloat); }

// float8_e4m3fn bit patterns s.eeee.mmm as fp32 times 2^-120: the exponent and mantissa bits
// shifted into fp32's field (bits 20..26), the sign into bit 31. Normal and subnormal codes both
// come out exact; the 2^120 is folded into the row's scale by the caller (kFp8Bias).
inline vfloat vload_fp8(const unsigned char* p) {
  const vint x = vwiden_u8(p);
  const vint bits = ((x & 0x7f) << 20) | ((x & 0x80) << 24);
  vfloat f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
constexpr float kFp8Bias = 1.329227995784916e36f;  // 2^120

// kLanes bfloat16 values (bit patterns) as fp32: the 16 bits widened and shifted into the top
// half, exact (vpmovzxwd + vpslld).
inline vfloat vload_bf16(const unsigned short* p) {
#if defined(__AVX512F__)
  const vint x = (vint)_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__AVX2__)
  const vint x = (vint)_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vint x;
  for (int i = 0; i < kLanes; ++i) x[i] = p[i];
#endif
  const vint bits = x << 16;
  vfloat f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// lane 0 to every lane: one broadcast (vfloat{} + x would add a zero first)
inline vfloat vsplat(float x) { return __builtin_shuffle(vfloat{x}, vint{}); }

// A vint whose lane i is f(i), at compile time.
template <class F, std::size_t... I>
constexpr vint make_lanes(F f, std::index_sequence<I...>) {
  return vint{f(static_cast<int>(I))...};
}
template <class F>
constexpr vint lanes_of(F f) {
  return make_lanes(f, std::make_index_sequence<kLanes>{});
}

constexpr vint kIota = lanes_of([](int i) { return i; });

// kSwap[s]: lane <-> lane ^ w for w = kLanes / 2, ..., 2, 1: the butterfly of the reductions below
template <std::size_t... S>
constexpr std::array<vint, sizeof...(S)> make_swaps(std::index_sequence<S...>) {
  return {lanes_of([](int i) { return i ^ (kLanes >> (S + 1)); })...};
}
constexpr std::array<vint, kLog2Lanes> kSwap = make_swaps(std::make_index_sequence<kLog2Lanes>{});

// Horizontal sum and max as log2(kLanes) shuffle steps, not a lane-by-lane chain.
inline float vsum(vfloat v) {
  for (const vint& swap : kSwap) v += __builtin_shuffle(v, swap);
  return v[0];
}

inline float vmax_lane(vfloat v) {
  for (const vint& swap : kSwap) {
    const vfloat other = __builtin_shuffle(v, swap);
    v = v > other ? v : other;
  }
  return v[0];
}

// out = x / sqrt(mean(x^2) + eps) * weight for one row of n floats. One definition for every
// kernel that normalizes (elementwise.cpp's rms_norm, quant_linear.cpp's fused norm + matmul),
// so the fused op gives the unfused pair's values bit for bit.
inline void rms_norm_row(const float* x, const float* weight, float* out, int64_t n, float eps) {
  vfloat acc = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    vfloat v = vload(x + i);
    acc += v * v;
  }
  float sum_squares = vsum(acc);
  for (; i < n; ++i) sum_squares += x[i] * x[i];
  const float inv_rms = 1.f / std::sqrt(sum_squares / static_cast<float>(n) + eps);
  const vfloat inv = vsplat(inv_rms);
  for (i = 0; i + kLanes <= n; i += kLanes) vstore(out + i, vload(x + i) * inv * vload(weight + i));
  for (; i < n; ++i) out[i] = x[i] * inv_rms * weight[i];
}

// e^x per lane, Cephes expf (about 1 ulp): x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6
// polynomial, 2^n written into the exponent bits. Inputs clamp to [-87.3, 88.3], where 2^n stays a
// normal float: e^x for x < -87.3 comes out ~1e-38 instead of smaller, which silu never notices.
inline vfloat vexp(vfloat x) {
  x = x < vsplat(88.3f) ? x : vsplat(88.3f);
  x = x > vsplat(-87.3f) ? x : vsplat(-87.3f);
  // Round x / ln2 to the nearest integer by adding 1.5 * 2^23: the integer lands in the low mantissa bits.
  const vfloat shifter = vsplat(12582912.f);
  const vfloat shifted = x * vsplat(1.44269504088896341f) + shifter;
  const vfloat n = shifted - shifter;
  vint n_int, shifter_bits;
  std::memcpy(&n_int, &shifted, sizeof n_int);
  std::memcpy(&shifter_bits, &shifter, sizeof shifter_bits);
  n_int -= shifter_bits;
  const vfloat r = x - n * vsplat(0.693359375f) - n * vsplat(-2.12194440e-4f);  // ln2 split in two
  vfloat p = vsplat(1.9875691500e-4f);
  p = p * r + vsplat(1.3981999507e-3f);
  p = p * r + vsplat(8.3334519073e-3f);
  p = p * r + vsplat(4.1665795894e-2f);
  p = p * r + vsplat(1.6666665459e-1f);
  p = p * r + vsplat(5.0000001201e-1f);
  p = p * r * r + r + vsplat(1.f);
  const vint exponent = (n_int + 127) << 23;
  vfloat pow2n;
  std::memcpy(&pow2n, &exponent, sizeof pow2n);
  return p * pow2n;
}

// out = silu(gate) * up = gate / (1 + e^-gate) * up for one row of n floats: elementwise.cpp's
// silu_and_mul and decoder_stack.cpp's decode step share it, so they give the same bits.
inline void silu_and_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vfloat g = vload(gate + i);
    vstore(out + i, g / (vsplat(1.f) + vexp(-g)) * vload(up + i));
  }
  for (; i < n; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

}  // namespace pdserve

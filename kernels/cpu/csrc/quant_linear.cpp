// y = x @ W on CPU for W in a GGUF block format (Q8_0, or 4-bit: Q4_0 / Q4_1), dequantized in
// registers, accumulated in fp32. x is never quantized: the products are those of
// dequantize-then-matmul, summed in another order.
//
// Each 32 consecutive inputs k of one output column n form a block with an fp16 scale d (and,
// for 4-bit, an fp16 offset m): W[k, n] = d * q (Q8_0, q int8) or d * q + m (4-bit, q 0..15;
// Q4_0 is the 4-bit layout with m = -8 d, exact in fp16). Within a block the kernel sums
// x[k] * q (small integers, exact in fp32) and applies the scale once:
//     y[n] += d * sum_k x[k] q[k]  +  m * sum_k x[k]
//
// Packed layout (kernels/quant_cpu.py repacks the file's blocks once at load): panels of kLanes
// output columns, as in linear.cpp; panel p is [num_blocks, block_bytes] contiguous bytes, and
// one block of a panel is
//     4-bit: d [kLanes] fp16 | m [kLanes] fp16 | qs [16][kLanes] u8   (20 * kLanes bytes)
//     Q8_0:  d [kLanes] fp16 | qs [32][kLanes] i8                     (34 * kLanes bytes)
// where qs[i][c] is column c's byte i as the file stores it: for 4-bit, input i in the low
// nibble and input i + 16 in the high one. The bytes per weight are the file's own (20 or 34
// per 32), so a decode step streams exactly the file's bytes once.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace pdserve {
namespace {

constexpr int kBlock = 32;   // inputs per block, both formats
constexpr int kPanels = 2;   // panels per work item (the unit threads split)
#ifdef __AVX512F__
constexpr int kRows = 4;     // 32 zmm: 3 * 4 * 2 accumulators + 4 weight vectors + broadcasts
#else
constexpr int kRows = 2;     // 16 ymm: 3 * 2 * 2 accumulators + 4 weight vectors (a few spill)
#endif
enum Format : int64_t { kQ8_0 = 0, kQ4 = 1 };

template <int F>
constexpr int64_t block_bytes() { return F == kQ4 ? 20 * kLanes : 34 * kLanes; }

// kLanes bytes -> int lanes, zero- or sign-extended (one vpmovzxbd / vpmovsxbd; GCC's
// __builtin_convertvector on a byte vector inserts lane by lane)
template <bool Signed>
inline vint vload_bytes(const unsigned char* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (vint)(Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (vint)(Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
  vint out;
  for (int c = 0; c < kLanes; ++c)
    out[c] = Signed ? static_cast<int>(static_cast<signed char>(p[c])) : static_cast<int>(p[c]);
  return out;
#endif
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
    } else if (exp == 31) {
      const uint32_t bits = 0x7f800000u | (man << 13);
      std::memcpy(&value, &bits, 4);
    } else {
      const uint32_t bits = ((exp + 112) << 23) | (man << 13);
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

// The low and the high nibbles of kLanes bytes, each widened to int lanes: split on the 16
// (or 8) bytes first, where the masks and shifts are cheap 128-bit ops that any vector port
// runs, so the wide ports only widen, convert and multiply.
inline void vload_nibbles(const unsigned char* p, vint& lo, vint& hi) {
#if defined(__AVX512F__) || defined(__AVX2__)
  const __m128i mask = _mm_set1_epi8(15);
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  lo = (vint)_mm512_cvtepu8_epi32(_mm_and_si128(b, mask));
  hi = (vint)_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask));
#else
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  lo = (vint)_mm256_cvtepu8_epi32(_mm_and_si128(b, mask));
  hi = (vint)_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask));
#endif
#else
  const vint v = vload_bytes<false>(p);
  lo = v & 15;
  hi = v >> 4;
#endif
}

// acc[r][j] = sum over blocks of column panel p0 + j against x row r; written to out.
// Two partial sums per block (inputs i and i + 16, or even and odd) keep 2 * R * NP independent
// FMA chains.
template <int F, int R, int NP>
void tile(const float* x, int64_t x_stride, const float* xsum, int64_t nb,
          const unsigned char* packed, int64_t p0, float* out, int64_t out_stride, int64_t N) {
  constexpr int64_t BB = block_bytes<F>();
  vfloat acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NP; ++j) acc[r][j] = vfloat{};
  for (int64_t b = 0; b < nb; ++b) {
    const unsigned char* blk[NP];
    for (int j = 0; j < NP; ++j) blk[j] = packed + ((p0 + j) * nb + b) * BB;
    vfloat lo[R][NP], hi[R][NP];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NP; ++j) lo[r][j] = hi[r][j] = vfloat{};
    const float* xb = x + b * kBlock;
    if constexpr (F == kQ4) {
      for (int i = 0; i < 16; ++i) {
        vfloat wl[NP], wh[NP];
        for (int j = 0; j < NP; ++j) {
          vint lo_q, hi_q;
          vload_nibbles(blk[j] + 4 * kLanes + i * kLanes, lo_q, hi_q);
          wl[j] = __builtin_convertvector(lo_q, vfloat);
          wh[j] = __builtin_convertvector(hi_q, vfloat);
        }
        for (int r = 0; r < R; ++r) {
          const vfloat xl = vsplat(xb[r * x_stride + i]), xh = vsplat(xb[r * x_stride + i + 16]);
          for (int j = 0; j < NP; ++j) {
            lo[r][j] += xl * wl[j];
            hi[r][j] += xh * wh[j];
          }
        }
      }
    } else {
      for (int i = 0; i < kBlock; i += 2) {
        vfloat w0[NP], w1[NP];
        for (int j = 0; j < NP; ++j) {
          w0[j] = __builtin_convertvector(vload_bytes<true>(blk[j] + 2 * kLanes + i * kLanes), vfloat);
          w1[j] = __builtin_convertvector(vload_bytes<true>(blk[j] + 2 * kLanes + (i + 1) * kLanes), vfloat);
        }
        for (int r = 0; r < R; ++r) {
          const vfloat x0 = vsplat(xb[r * x_stride + i]), x1 = vsplat(xb[r * x_stride + i + 1]);
          for (int j = 0; j < NP; ++j) {
            lo[r][j] += x0 * w0[j];
            hi[r][j] += x1 * w1[j];
          }
        }
      }
    }
    for (int j = 0; j < NP; ++j) {
      const vfloat d = vload_half(blk[j]);
      for (int r = 0; r < R; ++r) acc[r][j] += d * (lo[r][j] + hi[r][j]);
      if constexpr (F == kQ4) {
        const vfloat m = vload_half(blk[j] + 2 * kLanes);
        for (int r = 0; r < R; ++r) acc[r][j] += m * vsplat(xsum[r * nb + b]);
      }
    }
  }
  for (int j = 0; j < NP; ++j) {
    const int64_t col = (p0 + j) * kLanes;
    const int64_t width = std::min<int64_t>(kLanes, N - col);
    for (int r = 0; r < R; ++r) {
      float* dst = out + r * out_stride + col;
      if (width == kLanes) {
        vstore(dst, acc[r][j]);
      } else {
        float tmp[kLanes];
        vstore(tmp, acc[r][j]);
        std::memcpy(dst, tmp, width * sizeof(float));
      }
    }
  }
}

template <int F, int R>
void rows_tile(const float* x, int64_t xs, const float* xsum, int64_t nb, const unsigned char* packed,
               int64_t p0, int64_t P, float* out, int64_t os, int64_t N) {
  if (p0 + kPanels <= P) return tile<F, R, kPanels>(x, xs, xsum, nb, packed, p0, out, os, N);
  for (int64_t p = p0; p < P; ++p) tile<F, R, 1>(x, xs, xsum, nb, packed, p, out, os, N);
}

template <int F>
void rows_tile(int rows, const float* x, int64_t xs, const float* xsum, int64_t nb,
               const unsigned char* packed, int64_t p0, int64_t P, float* out, int64_t os, int64_t N) {
  switch (rows) {
    case 1: return rows_tile<F, 1>(x, xs, xsum, nb, packed, p0, P, out, os, N);
    case 2: return rows_tile<F, 2>(x, xs, xsum, nb, packed, p0, P, out, os, N);
#ifdef __AVX512F__
    case 3: return rows_tile<F, 3>(x, xs, xsum, nb, packed, p0, P, out, os, N);
    case 4: return rows_tile<F, 4>(x, xs, xsum, nb, packed, p0, P, out, os, N);
#endif
  }
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                        int64_t format) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
                    "quant_linear: x must be a 2-d float32 CPU tensor, got ", x.dim(), "-d ",
                    x.scalar_type());
  TORCH_CHECK_VALUE(x.size(1) <= 1 || x.stride(1) == 1,
                    "quant_linear: x must have stride 1 in its last dim");
  TORCH_CHECK_VALUE(format == kQ8_0 || format == kQ4, "quant_linear: format must be 0 (q8_0) or 1 (q4), got ",
                    format);
  const int64_t bb = format == kQ4 ? block_bytes<kQ4>() : block_bytes<kQ8_0>();
  TORCH_CHECK_VALUE(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == bb &&
                        packed.is_contiguous(),
                    "quant_linear: packed must be a contiguous uint8 [P, num_blocks, ", bb,
                    "] tensor from kernels.quant_cpu.pack");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), nb = packed.size(1);
  TORCH_CHECK_VALUE(K == nb * kBlock, "quant_linear: x has ", K, " features but the weight expects ",
                    nb * kBlock);
  TORCH_CHECK_VALUE(out_features > (P - 1) * kLanes && out_features <= P * kLanes,
                    "quant_linear: out_features ", out_features, " does not match ", P, " panels");
  at::Tensor out = at::empty({M, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  const int64_t xs = x.stride(0), N = out_features;
  // per row and block: sum of x over the block's 32 inputs (the 4-bit offsets' factor)
  at::Tensor xsum_t = at::empty({format == kQ4 ? M : 0, nb}, x.options());
  float* xsum = xsum_t.data_ptr<float>();
  if (format == kQ4)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < nb; ++b) {
        float s = 0.0f;
        for (int k = 0; k < kBlock; ++k) s += xp[m * xs + b * kBlock + k];
        xsum[m * nb + b] = s;
      }
  const unsigned char* wp = packed.data_ptr<unsigned char>();
  float* op = out.data_ptr<float>();
  const int64_t items = (P + kPanels - 1) / kPanels;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item)
      for (int64_t m = 0; m < M; m += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m));
        if (format == kQ4)
          rows_tile<kQ4>(rows, xp + m * xs, xs, xsum + m * nb, nb, wp, item * kPanels, P, op + m * N, N, N);
        else
          rows_tile<kQ8_0>(rows, xp + m * xs, xs, xsum, nb, wp, item * kPanels, P, op + m * N, N, N);
      }
  });
  return out;
}

}  // namespace
}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(PDSERVE_NAMESPACE, m) {
  m.def("quant_linear(Tensor x, Tensor packed, int out_features, int format) -> Tensor",
        &pdserve::quant_linear);
}

// How the CPU paged attention (attention.cpp) reads a cache row: in place (fp32), or widened
// to fp32 in registers (bfloat16, and int8 / float8_e4m3fn codes times the row's scale), and
// the prefetch of the next block's rows. Anonymous namespace: one library per ISA.
#pragma once

#include <cstdint>
#include <cstring>

#include "vec.h"

namespace pdserve {
namespace {

// How a cache row is read: Rows::load(p) gives kLanes values of the row at p (before its
// scale), Rows::scale(row, head_dim) the row's scale. F32Rows are read in place.
struct F32Rows {
  using T = float;
  static constexpr int64_t kScaleBytes = 0;
};

// A quantized row's fp32 scale, stored after its head_dim one-byte codes (kernels/kv_quant.py).
inline float stored_scale(const void* row, int64_t head_dim) {
  float s;
  std::memcpy(&s, static_cast<const unsigned char*>(row) + head_dim, sizeof s);
  return s;
}

struct Int8Rows {
  using T = signed char;
  static constexpr int64_t kScaleBytes = 4;
  static vfloat load(const T* p) { return vload_int8(p); }
  static float scale(const T* row, int64_t head_dim) { return stored_scale(row, head_dim); }
};

// float8_e4m3fn codes: the 2^120 exponent bias of the widening (vload_fp8) is folded into the scale.
struct Fp8Rows {
  using T = unsigned char;
  static constexpr int64_t kScaleBytes = 4;
  static vfloat load(const T* p) { return vload_fp8(p); }
  static float scale(const T* row, int64_t head_dim) { return stored_scale(row, head_dim) * kFp8Bias; }
};

// bfloat16 rows: no scale; widened in registers like the 1-byte codes.
struct Bf16Rows {
  using T = unsigned short;
  static constexpr int64_t kScaleBytes = 0;
  static vfloat load(const T* p) { return vload_bf16(p); }
  static float scale(const T*, int64_t) { return 1.f; }
};

// n quantized rows -> fp32 rows of head_dim at dst (scale applied).
template <class R>
inline void dequantize_tile(const typename R::T* rows, int64_t stride, int64_t n, int nv, int64_t head_dim,
                            float* dst) {
  for (int64_t j = 0; j < n; ++j) {
    const typename R::T* row = rows + j * stride;
    const vfloat scale = vsplat(R::scale(row, head_dim));
    for (int c = 0; c < nv; ++c) vstore(dst + j * head_dim + c * kLanes, R::load(row + c * kLanes) * scale);
  }
}

// Ask for the K or V rows of the next block while this one computes: block ids are scattered,
// so the hardware prefetcher cannot guess the jump.
template <class T>
inline void prefetch_rows(const T* rows, int64_t num_rows, int64_t stride, int64_t row_bytes) {
  for (int64_t j = 0; j < num_rows; ++j)
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(rows + j * stride) + b);
}

}  // namespace
}  // namespace pdserve

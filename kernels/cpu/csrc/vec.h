// The SIMD vocabulary shared by the CPU kernels: one vector of kLanes fp32 values.
//
// 16 lanes = 64 bytes = one cache line. GCC's vector extension lowers it to one zmm register
// with AVX-512, two ymm with AVX2, four xmm with SSE or NEON, so the kernels are written once
// and compiled with -march=native for whatever machine runs them.
#pragma once

#include <cstring>

namespace pdserve {

constexpr int kLanes = 16;
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));

inline vfloat vload(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void vstore(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

inline vfloat vsplat(float x) { return vfloat{} + x; }

inline float vsum(vfloat v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

inline float vmax_lane(vfloat v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

}  // namespace pdserve

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

typedef int vint __attribute__((vector_size(kLanes * sizeof(int))));

// lane <-> lane ^ w for w = 8, 4, 2, 1: the butterfly of the tree reductions below
constexpr vint kIota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
constexpr vint kSwap[4] = {kIota ^ 8, kIota ^ 4, kIota ^ 2, kIota ^ 1};

// Horizontal sum and max as log2(kLanes) shuffle steps, not a 15-step lane-by-lane chain.
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

}  // namespace pdserve

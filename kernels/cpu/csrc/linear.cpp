// y = x @ W for fp32 on CPU, with W pre-packed into column panels.
//
// Packed layout: W [K, N] (the transposed Linear weight) becomes panels [P, K, kLanes] with
// P = ceil(N / kLanes): panel p holds columns p*kLanes .. p*kLanes+kLanes-1 of every row, the
// last one zero-padded. One k-step of a panel is one cache line, and a panel is one contiguous
// run of memory, so the kernel streams the weights exactly once per call at any M <= kRows:
// that is what makes decode (M = 1) and speculative verification (M = 2..8) cost the same
// weight traffic, where a general GEMM packs the weights on every call.
//
// Tile: kRows rows of x times kPanels panels, held in registers across the whole K loop
// (kRows * kPanels accumulators); x values are broadcast from memory. Threads split the panels;
// the panels of a work item stay in L2 while larger M walks over them kRows rows at a time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>

#include "vec.h"

namespace pdserve {
namespace {

#ifdef __AVX512F__
constexpr int kRows = 8;  // 32 vector registers: 16 accumulators + 2 weight vectors
constexpr int kPanels = 2;
#else
constexpr int kRows = 6;  // 16 registers (a vfloat is two): 12 accumulators + 2 for the weights
constexpr int kPanels = 1;
#endif

// acc[r][j] = sum_k x[r, k] * panel_j[k, :]; then written to out[r, (p0 + j) * kLanes ...]
template <int R, int NP>
void tile(const float* x, int64_t x_stride, const float* panels, int64_t K, int64_t p0,
          int64_t num_panels, float* out, int64_t out_stride, int64_t N) {
  vfloat acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NP; ++j) acc[r][j] = vfloat{};
  const float* w = panels + p0 * K * kLanes;
  for (int64_t k = 0; k < K; ++k) {
    vfloat wk[NP];
    for (int j = 0; j < NP; ++j) wk[j] = vload(w + (j * K + k) * kLanes);
    for (int r = 0; r < R; ++r) {
      const vfloat xr = vsplat(x[r * x_stride + k]);
      for (int j = 0; j < NP; ++j) acc[r][j] += xr * wk[j];
    }
  }
  for (int j = 0; j < NP && p0 + j < num_panels; ++j) {
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

template <int NP>
void row_tail(int rows, const float* x, int64_t x_stride, const float* panels, int64_t K,
              int64_t p0, int64_t P, float* out, int64_t out_stride, int64_t N) {
  switch (rows) {
#define PDSERVE_TAIL(R) \
  case R:               \
    return tile<R, NP>(x, x_stride, panels, K, p0, P, out, out_stride, N);
    PDSERVE_TAIL(1)
    PDSERVE_TAIL(2)
    PDSERVE_TAIL(3)
    PDSERVE_TAIL(4)
    PDSERVE_TAIL(5)
    PDSERVE_TAIL(6)
    PDSERVE_TAIL(7)
#undef PDSERVE_TAIL
  }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& panels, int64_t out_features) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "linear: x must be a 2-d float32 CPU tensor, got ", x.dim(), "-d ", x.scalar_type());
  TORCH_CHECK_VALUE(x.size(1) <= 1 || x.stride(1) == 1, "linear: x must have stride 1 in its last dim");
  TORCH_CHECK_VALUE(panels.scalar_type() == at::kFloat && panels.dim() == 3 && panels.size(2) == kLanes &&
                  panels.is_contiguous(),
              "linear: panels must be a contiguous float32 [P, K, ", kLanes, "] tensor from pack_weight");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK_VALUE(panels.size(1) == K, "linear: x has ", K, " features but the weight expects ",
              panels.size(1));
  TORCH_CHECK_VALUE(out_features > (P - 1) * kLanes && out_features <= P * kLanes,
              "linear: out_features ", out_features, " does not match ", P, " panels");
  at::Tensor out = at::empty({M, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), N = out_features;
  const int64_t items = (P + kPanels - 1) / kPanels;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p0 = item * kPanels;
      // a last item with fewer panels than kPanels reads one zero panel too many: avoid it
      const bool full = p0 + kPanels <= P;
      int64_t m = 0;
      for (; m + kRows <= M; m += kRows) {
        if (full) tile<kRows, kPanels>(xp + m * xs, xs, wp, K, p0, P, op + m * N, N, N);
        else tile<kRows, 1>(xp + m * xs, xs, wp, K, p0, P, op + m * N, N, N);
      }
      if (m < M) {
        if (full) row_tail<kPanels>(M - m, xp + m * xs, xs, wp, K, p0, P, op + m * N, N, N);
        else row_tail<1>(M - m, xp + m * xs, xs, wp, K, p0, P, op + m * N, N, N);
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(PDSERVE_NAMESPACE, m) {
  m.def("linear(Tensor x, Tensor panels, int out_features) -> Tensor", &pdserve::linear);
  m.def("linear_lanes() -> int", [] { return static_cast<int64_t>(pdserve::kLanes); });
}

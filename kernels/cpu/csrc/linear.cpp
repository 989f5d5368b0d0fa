// y = x @ W for fp32 on CPU, with W pre-packed into column panels.
//
// Packed layout: W [K, N] (the transposed Linear weight) becomes panels [P, K, kLanes] with
// P = ceil(N / kLanes): panel p holds columns p*kLanes .. p*kLanes+kLanes-1 of every row, the
// last one zero-padded. One k-step of a panel is one vector load, and a panel is one contiguous
// run of memory, so the kernel streams the weights exactly once per call at any M <= kRows:
// that is what makes decode (M = 1) and speculative verification (M = 2..8) cost the same
// weight traffic, where a general GEMM packs the weights on every call.
//
// Tile: up to kRows rows of x times kPanels panels, held in registers across the whole K loop;
// x values are broadcast from memory. Threads split the panels in items of kPanels; the panels of
// an item stay in L2 while larger M walks over them kRows rows at a time. kLanes is the ISA's
// register width (vec.h), so the packed layout is per ISA: pack with that library's lanes.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>

#include "vec.h"

namespace pdserve {
namespace {

// A work item is kPanels panels (the unit threads split); a tile is up to kRows rows of x times
// the item's panels, kRows * kPanels accumulators in registers.
constexpr int kPanels = 2;
#ifdef __AVX512F__
constexpr int kRows = 8;  // 32 zmm: 16 accumulators + 2 weight vectors
#else
constexpr int kRows = 6;  // 16 ymm (or xmm): 12 accumulators + 2 weight vectors + 1 broadcast
#endif

// With few rows the tile has few accumulators, so each waits on its own previous FMA (4-cycle
// latency) and the loads idle: keep split_k partial sums over interleaved k instead (8
// independent FMA chains in all), added together after the loop.
constexpr int split_k(int rows, int panels) { return rows * panels >= 8 ? 1 : 8 / (rows * panels); }

// acc[r][j] = sum_k x[r, k] * panel_j[k, :]; then written to out[r, (p0 + j) * kLanes ...]
template <int R, int NP>
void tile(const float* x, int64_t x_stride, const float* panels, int64_t K, int64_t p0,
          float* out, int64_t out_stride, int64_t N) {
  constexpr int U = split_k(R, NP);
  vfloat acc[U][R][NP];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NP; ++j) acc[u][r][j] = vfloat{};
  const float* w = panels + p0 * K * kLanes;
  auto fma_k = [&](vfloat (&a)[R][NP], int64_t k) {
    vfloat wk[NP];
    for (int j = 0; j < NP; ++j) wk[j] = vload(w + (j * K + k) * kLanes);
    for (int r = 0; r < R; ++r) {
      const vfloat xr = vsplat(x[r * x_stride + k]);
      for (int j = 0; j < NP; ++j) a[r][j] += xr * wk[j];
    }
  };
  int64_t k = 0;
  for (; k + U <= K; k += U)
    for (int u = 0; u < U; ++u) fma_k(acc[u], k + u);
  for (; k < K; ++k) fma_k(acc[0], k);
  for (int u = 1; u < U; ++u)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NP; ++j) acc[0][r][j] += acc[u][r][j];
  for (int j = 0; j < NP; ++j) {
    const int64_t col = (p0 + j) * kLanes;
    const int64_t width = std::min<int64_t>(kLanes, N - col);
    for (int r = 0; r < R; ++r) vstore_first(out + r * out_stride + col, acc[0][r][j], width);
  }
}

// `rows` (1..kRows) rows of x against the item's panels p0 .. p0 + kPanels - 1 (the last item
// may have fewer: a tile over a missing panel would read past the weights)
template <int R>
void rows_tile(const float* x, int64_t x_stride, const float* panels, int64_t K, int64_t p0,
               int64_t P, float* out, int64_t out_stride, int64_t N) {
  if (p0 + kPanels <= P) return tile<R, kPanels>(x, x_stride, panels, K, p0, out, out_stride, N);
  for (int64_t p = p0; p < P; ++p) tile<R, 1>(x, x_stride, panels, K, p, out, out_stride, N);
}

void rows_tile(int rows, const float* x, int64_t x_stride, const float* panels, int64_t K,
               int64_t p0, int64_t P, float* out, int64_t out_stride, int64_t N) {
  switch (rows) {
#define PDSERVE_ROWS(R) \
  case R:               \
    return rows_tile<R>(x, x_stride, panels, K, p0, P, out, out_stride, N);
    PDSERVE_ROWS(1)
    PDSERVE_ROWS(2)
    PDSERVE_ROWS(3)
    PDSERVE_ROWS(4)
    PDSERVE_ROWS(5)
    PDSERVE_ROWS(6)
#ifdef __AVX512F__
    PDSERVE_ROWS(7)
    PDSERVE_ROWS(8)
#endif
#undef PDSERVE_ROWS
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
      for (int64_t m = 0; m < M; m += kRows)
        rows_tile(static_cast<int>(std::min<int64_t>(kRows, M - m)), xp + m * xs, xs, wp, K,
                  item * kPanels, P, op + m * N, N, N);
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

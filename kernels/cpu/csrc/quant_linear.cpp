// The quantized matmul ops: y = x @ W for W in a GGUF block format (quant_tiles.h has the format,
// the packed layout and the inner loops), and the layer's norm fused with the matmul after it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "quant_tiles.h"
#include "vec.h"

namespace pdserve {
namespace {

// The first work item this thread (at::get_thread_num() inside a parallel region) will take of
// a packed weight in a loop over `threads` threads (split_items).
const unsigned char* first_item_of_this_thread(const at::Tensor& packed, int64_t threads) {
  const int64_t items = num_items(packed.size(0));
  const int64_t item = std::min(split_items(items, at::get_thread_num(), threads).first,
                                std::max<int64_t>(items - 1, 0));
  return packed.data_ptr<unsigned char>() + item * kPanels * packed.size(1) * packed.size(2);
}

// Scratch that lives for one call: grown on demand and kept per calling thread, so a decode
// step's ~120 matmuls allocate no activation rows (only their outputs).
template <class T>
T* thread_scratch(int slot, int64_t n) {
  thread_local std::vector<T> buffers[2];
  std::vector<T>& buffer = buffers[slot];
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

void check_weight(const char* op, const at::Tensor& packed, int64_t K, int64_t out_features, int64_t format,
                  const std::optional<at::Tensor>& prefetch_next) {
  TORCH_CHECK_VALUE(!prefetch_next.has_value() || !prefetch_next->defined() ||
                        (prefetch_next->scalar_type() == at::kByte && prefetch_next->dim() == 3 &&
                         prefetch_next->is_contiguous()),
                    op, ": prefetch_next must be a contiguous uint8 [P, num_blocks, block bytes] tensor");
  TORCH_CHECK_VALUE(format >= kQ8_0 && format <= kQ5, op,
                    ": format must be 0 (q8_0), 1 (q4), 2 (q4_k), 3 (q6_k) or 4 (q5), got ", format);
  const int64_t bb = format_block_bytes(format);
  TORCH_CHECK_VALUE(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == bb &&
                        packed.is_contiguous(),
                    op, ": packed must be a contiguous uint8 [P, num_blocks, ", bb,
                    "] tensor from kernels.quant_cpu.pack");
  const int64_t P = packed.size(0), nb = packed.size(1);
  TORCH_CHECK_VALUE(K == nb * block_inputs(format), op, ": x has ", K, " features but the weight expects ",
                    nb * block_inputs(format));
  TORCH_CHECK_VALUE(out_features > (P - 1) * kLanes && out_features <= P * kLanes,
                    op, ": out_features ", out_features, " does not match ", P, " panels");
}

// y [M, out_features] = rows of x (M rows of K floats, row stride xs) times the packed weight;
// the arguments are checked by the callers.
at::Tensor quant_linear_rows(const float* xp, int64_t xs, int64_t M, int64_t K, const at::Tensor& packed,
                             int64_t out_features, int64_t format, bool exact,
                             const std::optional<at::Tensor>& prefetch_next, const at::TensorOptions& options) {
  const int64_t P = packed.size(0), nb = K / kBlock;  // blocks of 32 inputs of x
  at::Tensor out = at::empty({M, out_features}, options);
  if (M == 0) return out;
  // per row and block: dx and xsum [M, nb] fp32; the quantized rows xq [M, K] int8 unless exact
  float* dx = thread_scratch<float>(0, 2 * M * nb);
  float* xsum = dx + M * nb;
  int8_t* xq = exact ? nullptr : thread_scratch<int8_t>(0, M * K);
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      prepare_row(xp + m * xs, nb, xsum + m * nb, xq ? xq + m * K : nullptr, dx + m * nb);
  });
  const Rows rows{xp, xs, xq, dx, xsum, K, nb};
  const unsigned char* wp = packed.data_ptr<unsigned char>();
  float* op = out.data_ptr<float>();
  const int64_t N = out_features, items = num_items(P);
  // prefetch_next: the weight the caller multiplies by next (a layer's following matmul). Each
  // thread, done with its items, fetches the first item it will take of that one, so the next
  // call does not start on a cold stream.
  const bool chain = prefetch_next.has_value() && prefetch_next->defined();
  const int64_t threads = std::max<int64_t>(at::get_num_threads(), 1);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    multiply_items(rows, M, wp, P, N, format, exact, begin, end, op);
    if (chain) {
      const at::Tensor& next = *prefetch_next;
      prefetch_bytes(first_item_of_this_thread(next, threads),
                     std::min<int64_t>(next.numel(), kPanels * next.size(1) * next.size(2)));
    }
  });
  return out;
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                        int64_t format, bool exact, const std::optional<at::Tensor>& prefetch_next) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
                    "quant_linear: x must be a 2-d float32 CPU tensor, got ", x.dim(), "-d ",
                    x.scalar_type());
  TORCH_CHECK_VALUE(x.size(1) <= 1 || x.stride(1) == 1,
                    "quant_linear: x must have stride 1 in its last dim");
  check_weight("quant_linear", packed, x.size(1), out_features, format, prefetch_next);
  return quant_linear_rows(x.data_ptr<float>(), x.stride(0), x.size(0), x.size(1), packed, out_features, format,
                           exact, prefetch_next, x.options());
}

// residual_out = x + residual; y = quant_linear(rms_norm(residual_out) * weight): the layer's
// norm and the matmul after it in one call (a decode step makes 2 per layer). Returns
// (y, residual_out); the same values as elementwise.rms_norm_residual then quant_linear.
std::tuple<at::Tensor, at::Tensor> rms_norm_quant_linear(const at::Tensor& x, const at::Tensor& residual,
                                                         const at::Tensor& weight, double eps,
                                                         const at::Tensor& packed, int64_t out_features,
                                                         int64_t format, bool exact,
                                                         const std::optional<at::Tensor>& prefetch_next) {
  auto check_rows = [](const char* name, const at::Tensor& t) {
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 &&
                          (t.size(1) <= 1 || t.stride(1) == 1),
                      "rms_norm_quant_linear: ", name, " must be a 2-d float32 CPU tensor with stride 1 "
                      "in its last dim, got ", t.dim(), "-d ", t.scalar_type());
  };
  check_rows("x", x);
  check_rows("residual", residual);
  TORCH_CHECK_VALUE(residual.sizes() == x.sizes(), "rms_norm_quant_linear: residual has shape ",
                    residual.sizes(), " but x has ", x.sizes());
  TORCH_CHECK_VALUE(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
                        weight.size(0) == x.size(1) && weight.is_contiguous(),
                    "rms_norm_quant_linear: weight must be a contiguous float32 [", x.size(1), "] tensor");
  const int64_t M = x.size(0), K = x.size(1);
  check_weight("rms_norm_quant_linear", packed, K, out_features, format, prefetch_next);
  at::Tensor residual_out = at::empty({M, K}, x.options());
  float* np = thread_scratch<float>(1, M * K);  // the normed rows: read by the matmul only
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* sp = residual_out.data_ptr<float>();
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* xr = xp + m * x.stride(0);
      const float* rr = rp + m * residual.stride(0);
      float* sr = sp + m * K;
      int64_t i = 0;
      for (; i + kLanes <= K; i += kLanes) vstore(sr + i, vload(xr + i) + vload(rr + i));
      for (; i < K; ++i) sr[i] = xr[i] + rr[i];
      rms_norm_row(sr, wp, np + m * K, K, static_cast<float>(eps));
    }
  });
  return {quant_linear_rows(np, K, M, K, packed, out_features, format, exact, prefetch_next, x.options()),
          residual_out};
}

}  // namespace
}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(PDSERVE_NAMESPACE, m) {
  m.def("quant_linear(Tensor x, Tensor packed, int out_features, int format, bool exact, "
        "Tensor? prefetch_next=None) -> Tensor",
        &pdserve::quant_linear);
  m.def("rms_norm_quant_linear(Tensor x, Tensor residual, Tensor weight, float eps, Tensor packed, "
        "int out_features, int format, bool exact, Tensor? prefetch_next=None) -> (Tensor, Tensor)",
        &pdserve::rms_norm_quant_linear);
}

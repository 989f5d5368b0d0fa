// The small per-layer ops of a Llama block, compiled for CPU: rms_norm (optionally fused with the
// residual add), rotary (in place), store_kv (in place into the paged cache; its code is in
// store_kv.h) and silu_and_mul; and row_argmax, the greedy sample of a row of logits.
//
// Same contracts as the torch references (kernels/rms_norm.py, rotary.py, store_kv.py,
// activation.py), fp32 only. At batch 1 each op is a few hundred nanoseconds of arithmetic, so
// what matters is staying out of torch's per-op machinery: one dispatcher call per op, checks
// done here, and no parallel region unless there are enough rows (prefill) to pay for one.
// Bad arguments raise ValueError (TORCH_CHECK_VALUE) naming the argument, like kernels/_checks.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "op_checks.h"
#include "store_kv.h"
#include "vec.h"

namespace pdserve {
namespace {

void check_rms_norm(const at::Tensor& x, const at::Tensor& weight) {
  check_tensor("x", x, {-1, -1}, Kind::kFloat32);
  check_tensor("weight", weight, {x.size(1)}, Kind::kFloat32);
}

// x: [N, H] (row stride free), weight: [H] -> out [N, H].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms_norm(x, weight);
  const int64_t num_rows = x.size(0), hidden = x.size(1), stride_x = x.stride(0);
  at::Tensor out = at::empty({num_rows, hidden}, x.options());
  const float* x_ptr = x.const_data_ptr<float>();
  const float* w_ptr = weight.const_data_ptr<float>();
  float* out_ptr = out.mutable_data_ptr<float>();
  at::parallel_for(0, num_rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      rms_norm_row(x_ptr + row * stride_x, w_ptr, out_ptr + row * hidden, hidden, static_cast<float>(eps));
  });
  return out;
}

// residual_out = x + residual; out = rms_norm(residual_out). Returns (out, residual_out).
std::tuple<at::Tensor, at::Tensor> rms_norm_residual(const at::Tensor& x, const at::Tensor& weight, double eps,
                                                     const at::Tensor& residual) {
  check_rms_norm(x, weight);
  check_tensor("residual", residual, {x.size(0), x.size(1)}, Kind::kFloat32);
  const int64_t num_rows = x.size(0), hidden = x.size(1);
  const int64_t stride_x = x.stride(0), stride_r = residual.stride(0);
  at::Tensor out = at::empty({num_rows, hidden}, x.options());
  at::Tensor residual_out = at::empty({num_rows, hidden}, x.options());
  const float* x_ptr = x.const_data_ptr<float>();
  const float* r_ptr = residual.const_data_ptr<float>();
  const float* w_ptr = weight.const_data_ptr<float>();
  float* out_ptr = out.mutable_data_ptr<float>();
  float* sum_ptr = residual_out.mutable_data_ptr<float>();
  at::parallel_for(0, num_rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* xr = x_ptr + row * stride_x;
      const float* rr = r_ptr + row * stride_r;
      float* sr = sum_ptr + row * hidden;
      int64_t i = 0;
      for (; i + kLanes <= hidden; i += kLanes) vstore(sr + i, vload(xr + i) + vload(rr + i));
      for (; i < hidden; ++i) sr[i] = xr[i] + rr[i];
      rms_norm_row(sr, w_ptr, out_ptr + row * hidden, hidden, static_cast<float>(eps));
    }
  });
  return {out, residual_out};
}

// Rotates num_heads head vectors [x1 | x2] (head_dim = 2 * half) in place:
// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin.
void rotate_heads(float* x, int64_t stride_head, int64_t num_heads, const float* cos, const float* sin,
                  int64_t half) {
  for (int64_t h = 0; h < num_heads; ++h) {
    float* x1 = x + h * stride_head;
    float* x2 = x1 + half;
    int64_t i = 0;
    for (; i + kLanes <= half; i += kLanes) {
      const vfloat a = vload(x1 + i), b = vload(x2 + i), c = vload(cos + i), s = vload(sin + i);
      vstore(x1 + i, a * c - b * s);
      vstore(x2 + i, b * c + a * s);
    }
    for (; i < half; ++i) {
      const float a = x1[i], b = x2[i];
      x1[i] = a * cos[i] - b * sin[i];
      x2[i] = b * cos[i] + a * sin[i];
    }
  }
}

// q: [N, Hq, D], k: [N, Hk, D] (views with free token/head strides), positions: [N],
// cos_sin_cache: [max_pos, D] = [cos | sin]. In place.
void rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos_sin_cache) {
  check_tensor("q", q, {-1, -1, -1}, Kind::kFloat32);
  const int64_t num_tokens = q.size(0), head_dim = q.size(2);
  TORCH_CHECK_VALUE(head_dim % 2 == 0, "q must have an even head_dim, got shape ", tuple_str(q.sizes()));
  check_tensor("k", k, {num_tokens, -1, head_dim}, Kind::kFloat32);
  check_tensor("positions", positions, {num_tokens}, Kind::kIndex);
  check_tensor("cos_sin_cache", cos_sin_cache, {-1, head_dim}, Kind::kFloat32);
  TORCH_CHECK_VALUE(cos_sin_cache.is_contiguous(), "cos_sin_cache must be contiguous, got strides ",
                    tuple_str(cos_sin_cache.strides()));
  const int64_t max_pos = cos_sin_cache.size(0), half = head_dim / 2;
  const int64_t num_heads = q.size(1), num_kv_heads = k.size(1);
  const int64_t stride_qt = q.stride(0), stride_qh = q.stride(1);
  const int64_t stride_kt = k.stride(0), stride_kh = k.stride(1);
  const int64_t stride_pos = positions.stride(0);
  float* q_ptr = q.mutable_data_ptr<float>();
  float* k_ptr = k.mutable_data_ptr<float>();
  const float* cache_ptr = cos_sin_cache.const_data_ptr<float>();
  with_index_data(positions, [&](const auto* pos) {
    // Check every position before rotating anything: a bad one leaves q and k untouched.
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int64_t p = pos[t * stride_pos];
      TORCH_CHECK_VALUE(p >= 0 && p < max_pos, "positions must be in [0, ", max_pos,
                        ") (the rows of cos_sin_cache), got ", p, " at token ", t);
    }
    const int64_t grain = grain_rows((num_heads + num_kv_heads) * head_dim);
    at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cos = cache_ptr + static_cast<int64_t>(pos[t * stride_pos]) * head_dim;
        rotate_heads(q_ptr + t * stride_qt, stride_qh, num_heads, cos, cos + half, half);
        rotate_heads(k_ptr + t * stride_kt, stride_kh, num_kv_heads, cos, cos + half, half);
      }
    });
  });
}

// x: [N, 2I] = [gate | up] (row stride free) -> [N, I] = silu(gate) * up.
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_tensor("x", x, {-1, -1}, Kind::kFloat32);
  TORCH_CHECK_VALUE(x.size(1) % 2 == 0, "x must have an even last dim [N, 2*I], got shape ", tuple_str(x.sizes()));
  const int64_t num_rows = x.size(0), inter = x.size(1) / 2, stride_x = x.stride(0);
  at::Tensor out = at::empty({num_rows, inter}, x.options());
  const float* x_ptr = x.const_data_ptr<float>();
  float* out_ptr = out.mutable_data_ptr<float>();
  // Each element costs an exp and a division: half the usual elements already make a chunk.
  at::parallel_for(0, num_rows, grain_rows(2 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* gate = x_ptr + row * stride_x;
      silu_and_mul_row(gate, gate + inter, out_ptr + row * inter, inter);
    }
  });
  return out;
}

// logits: [N, V] (row stride free) -> per row the index of its first maximum, or -1 for a row
// whose maximum is not finite (a NaN anywhere, or every value -inf, or a +inf): the indices
// torch.max(logits, dim=-1) returns, where its values are finite. A greedy decode step's
// sample: torch's max over a 49152-token vocabulary took 0.11 ms per token inside the decode
// loop (its reduction machinery on logits the LM head's threads just wrote; 30 us alone), this
// pass 0.04 ms there with the Python around it (4.6 us alone; docs/benchmark-log.md, issue 18).
// One thread: the row sits in the caches the LM head wrote it to.
std::vector<int64_t> row_argmax(const at::Tensor& logits) {
  check_tensor("logits", logits, {-1, -1}, Kind::kFloat32);
  const int64_t num_rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK_VALUE(vocab > 0, "logits must have at least one column, got shape ", tuple_str(logits.sizes()));
  std::vector<int64_t> out(num_rows, -1);
  const float* base = logits.const_data_ptr<float>();
  for (int64_t row = 0; row < num_rows; ++row) {
    const float* x = base + row * logits.stride(0);
    // pass 1: the maximum; a NaN fails every comparison, so it is counted, not taken
    vfloat vmax = vsplat(-INFINITY);
    vint nan = vint{};
    int64_t i = 0;
    for (; i + kLanes <= vocab; i += kLanes) {
      const vfloat v = vload(x + i);
      nan |= v != v;
      vmax = v > vmax ? v : vmax;
    }
    float best = vmax_lane(vmax);
    bool has_nan = false;
    for (int lane = 0; lane < kLanes; ++lane) has_nan |= nan[lane] != 0;
    for (; i < vocab; ++i) {
      has_nan |= x[i] != x[i];
      best = x[i] > best ? x[i] : best;
    }
    if (has_nan || !std::isfinite(best)) continue;
    // pass 2: its first index (== also matches -0.0 against 0.0, as torch's ties do)
    const vfloat target = vsplat(best);
    for (i = 0; i + kLanes <= vocab; i += kLanes) {
      const vint hit = vload(x + i) == target;
      bool any = false;
      for (int lane = 0; lane < kLanes; ++lane) any |= hit[lane] != 0;
      if (any) break;
    }
    while (x[i] != best) ++i;  // the first hit in that vector, or in the tail
    out[row] = i;
  }
  return out;
}

}  // namespace
}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(PDSERVE_NAMESPACE, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &pdserve::rms_norm);
  m.def("rms_norm_residual(Tensor x, Tensor weight, float eps, Tensor residual) -> (Tensor, Tensor)",
        &pdserve::rms_norm_residual);
  m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos_sin_cache) -> ()", &pdserve::rotary);
  m.def("store_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()",
        &pdserve::store_kv);
  m.def("silu_and_mul(Tensor x) -> Tensor", &pdserve::silu_and_mul);
  m.def("row_argmax(Tensor logits) -> int[]", &pdserve::row_argmax);
}
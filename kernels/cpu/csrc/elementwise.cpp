// The small per-layer ops of a Llama block, compiled for CPU: rms_norm (optionally fused with the
// residual add), rotary (in place), store_kv (in place into the paged cache) and silu_and_mul;
// and row_argmax, the greedy sample of a row of logits.
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
#include <initializer_list>
#include <string>
#include <tuple>
#include <vector>

#include "vec.h"

namespace pdserve {
namespace {

// A chunk of a parallel loop touches at least this many floats (tens of microseconds of work), so
// only prefill-sized batches fork: waking the OpenMP workers costs microseconds on a quiet
// machine and, on a busy one, up to a scheduler tick (measured: 11 ms for a 20 us op).
constexpr int64_t kGrainElements = 1 << 16;

int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(row_elements, 1));
}

std::string tuple_str(c10::IntArrayRef values) {
  std::string s = "(";
  for (size_t i = 0; i < values.size(); ++i) s += (i ? ", " : "") + std::to_string(values[i]);
  return s + (values.size() == 1 ? ",)" : ")");
}

std::string expected_shape_str(std::initializer_list<int64_t> shape) {
  std::string s = "(";
  size_t i = 0;
  for (int64_t size : shape) s += (i++ ? ", " : "") + (size < 0 ? std::string("*") : std::to_string(size));
  return s + (shape.size() == 1 ? ",)" : ")");
}

const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    default: return c10::toString(t);
  }
}

enum class Kind { kFloat32, kIndex };

// kernels/_checks.check_tensor for this path: shape entries < 0 match any size; fp32 tensors must
// have stride 1 in their last dim, index tensors may have any strides.
void check_tensor(const char* name, const at::Tensor& t, std::initializer_list<int64_t> shape, Kind kind) {
  TORCH_CHECK_VALUE(t.defined(), name, " must be a torch.Tensor, got None");
  TORCH_CHECK_VALUE(t.dim() == static_cast<int64_t>(shape.size()), name, " must be ", shape.size(),
                    "-d, got shape ", tuple_str(t.sizes()));
  int64_t dim = 0;
  for (int64_t want : shape) {
    TORCH_CHECK_VALUE(want < 0 || t.size(dim) == want, name, " must have shape ", expected_shape_str(shape),
                      ", got ", tuple_str(t.sizes()), " (dim ", dim, " differs)");
    ++dim;
  }
  if (kind == Kind::kFloat32) {
    TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat, name,
                      " must have dtype float32 (the compiled CPU kernels are fp32 only), got ",
                      dtype_name(t.scalar_type()));
  } else {
    TORCH_CHECK_VALUE(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, name,
                      " must have dtype int64|int32, got ", dtype_name(t.scalar_type()));
  }
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be on cpu for the compiled CPU kernels, got ", t.device());
  TORCH_CHECK_VALUE(kind == Kind::kIndex || t.dim() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1, name,
                    " must have stride 1 in its last dim, got strides ", tuple_str(t.strides()));
}

// Calls fn(ptr) with positions / slot_mapping's data as int64_t* or int32_t*.
template <typename Fn>
void with_index_data(const at::Tensor& t, Fn&& fn) {
  if (t.scalar_type() == at::kLong) fn(t.const_data_ptr<int64_t>());
  else fn(t.const_data_ptr<int32_t>());
}

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

// key/value: [N, Hkv, D]; key_cache/value_cache: [num_blocks, block_size, Hkv, D] strided views
// (same strides); slot_mapping: [N], < 0 = skip. Copies each token's K and V into its slot.
// A quantized KV row (kernels/kv_quant.py): head_dim codes, then the row's fp32 scale
// max|x| / qmax; code = round_half_even(x / scale) for int8, float8_e4m3fn(x / scale) for fp8.
// The arithmetic is the reference's, in the same order, so the codes come out identical.
constexpr int64_t kScaleBytes = 4;

// |x| <= 448 to the nearest float8_e4m3fn (ties to even), as torch converts.
uint8_t to_e4m3(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float a = std::fabs(x);
  if (a < 0.015625f) return sign | static_cast<uint8_t>(std::nearbyint(a * 512.f));  // subnormal: m * 2^-9 (m = 8 is 2^-6)
  int e;
  const float f = std::frexp(a, &e);  // a = f 2^e, f in [0.5, 1)
  int m = static_cast<int>(std::nearbyint((f * 2.f - 1.f) * 8.f));
  int exponent = e - 1 + 7;
  if (m == 8) m = 0, ++exponent;
  return sign | static_cast<uint8_t>(exponent << 3 | m);
}

template <bool kFp8>
void quantize_row(const float* x, int64_t head_dim, uint8_t* row) {
  float amax = 0.f;
  for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float scale = amax / (kFp8 ? 448.f : 127.f);
  const float inv = amax > 0.f ? 1.f / scale : 0.f;
  for (int64_t d = 0; d < head_dim; ++d) {
    const float v = x[d] * inv;
    if constexpr (kFp8) {
      row[d] = to_e4m3(std::clamp(v, -448.f, 448.f));
    } else {
      row[d] = static_cast<uint8_t>(static_cast<int8_t>(std::clamp(std::nearbyint(v), -127.f, 127.f)));
    }
  }
  std::memcpy(row + head_dim, &scale, sizeof scale);
}

// One bfloat16 cache row: round to nearest even, as torch's .to(torch.bfloat16).
inline void to_bf16_row(const float* x, int64_t head_dim, uint8_t* row) {
  for (int64_t d = 0; d < head_dim; ++d) {
    const uint16_t bits = c10::BFloat16(x[d]).x;
    std::memcpy(row + d * sizeof bits, &bits, sizeof bits);
  }
}

void store_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
              const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  // fp32 or bfloat16 caches, or quantized ones (int8, float8_e4m3fn) whose rows carry kScaleBytes more
  const at::ScalarType cache_type = key_cache.defined() ? key_cache.scalar_type() : at::kFloat;
  const bool is_quantized = cache_type == at::kChar || cache_type == at::kFloat8_e4m3fn;
  const bool is_bf16 = cache_type == at::kBFloat16;
  if (is_quantized || is_bf16) {
    TORCH_CHECK_VALUE(key_cache.dim() == 4 && key_cache.device().is_cpu() && key_cache.stride(-1) == 1,
                      "key_cache must be a 4-d cpu tensor with stride 1 in its last dim, got shape ",
                      tuple_str(key_cache.sizes()), " strides ", tuple_str(key_cache.strides()));
    TORCH_CHECK_VALUE(!is_quantized || key_cache.size(3) > kScaleBytes, "key_cache is ", dtype_name(cache_type),
                      ": its rows must hold head_dim codes and ", kScaleBytes, " scale bytes, got shape ",
                      tuple_str(key_cache.sizes()));
    TORCH_CHECK_VALUE(value_cache.defined() && value_cache.scalar_type() == cache_type, "value_cache must have "
                      "the dtype of key_cache (", dtype_name(cache_type), ")");
  } else {
    check_tensor("key_cache", key_cache, {-1, -1, -1, -1}, Kind::kFloat32);
  }
  const int64_t num_kv_heads = key_cache.size(2), row_width = key_cache.size(3);
  const int64_t head_dim = is_quantized ? row_width - kScaleBytes : row_width;
  TORCH_CHECK_VALUE(value_cache.sizes() == key_cache.sizes(), "value_cache must have shape ",
                    tuple_str(key_cache.sizes()), ", got ", tuple_str(value_cache.sizes()));
  if (!is_quantized && !is_bf16)
    check_tensor("value_cache", value_cache, {key_cache.size(0), key_cache.size(1), num_kv_heads, head_dim},
                 Kind::kFloat32);
  TORCH_CHECK_VALUE(value_cache.strides() == key_cache.strides(), "value_cache must have the strides of key_cache ",
                    tuple_str(key_cache.strides()), ", got ", tuple_str(value_cache.strides()));
  check_tensor("key", key, {-1, num_kv_heads, head_dim}, Kind::kFloat32);
  const int64_t num_tokens = key.size(0);
  check_tensor("value", value, {num_tokens, num_kv_heads, head_dim}, Kind::kFloat32);
  check_tensor("slot_mapping", slot_mapping, {num_tokens}, Kind::kIndex);
  const int64_t block_size = key_cache.size(1), num_slots = key_cache.size(0) * block_size;
  const int64_t stride_kt = key.stride(0), stride_kh = key.stride(1);
  const int64_t stride_vt = value.stride(0), stride_vh = value.stride(1);
  const int64_t stride_cb = key_cache.stride(0), stride_co = key_cache.stride(1), stride_ch = key_cache.stride(2);
  const int64_t stride_slot = slot_mapping.stride(0);
  const int64_t element_size = static_cast<int64_t>(key_cache.element_size());
  const size_t row_bytes = head_dim * sizeof(float);
  const float* k_ptr = key.const_data_ptr<float>();
  const float* v_ptr = value.const_data_ptr<float>();
  uint8_t* kc_ptr = static_cast<uint8_t*>(key_cache.data_ptr());
  uint8_t* vc_ptr = static_cast<uint8_t*>(value_cache.data_ptr());
  with_index_data(slot_mapping, [&](const auto* slots) {
    // Check every slot before writing any: a bad one leaves the cache untouched.
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int64_t slot = slots[t * stride_slot];
      TORCH_CHECK_VALUE(slot < num_slots, "slot_mapping must be < num_blocks * block_size = ", num_slots,
                        " (or < 0 to skip), got ", slot, " at token ", t);
    }
    at::parallel_for(0, num_tokens, grain_rows(2 * num_kv_heads * head_dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t slot = slots[t * stride_slot];
        if (slot < 0) continue;
        const int64_t dst = ((slot / block_size) * stride_cb + (slot % block_size) * stride_co) * element_size;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          uint8_t* k_row = kc_ptr + dst + h * stride_ch * element_size;
          uint8_t* v_row = vc_ptr + dst + h * stride_ch * element_size;
          const float* k_src = k_ptr + t * stride_kt + h * stride_kh;
          const float* v_src = v_ptr + t * stride_vt + h * stride_vh;
          if (cache_type == at::kChar) {
            quantize_row<false>(k_src, head_dim, k_row);
            quantize_row<false>(v_src, head_dim, v_row);
          } else if (cache_type == at::kFloat8_e4m3fn) {
            quantize_row<true>(k_src, head_dim, k_row);
            quantize_row<true>(v_src, head_dim, v_row);
          } else if (cache_type == at::kBFloat16) {
            to_bf16_row(k_src, head_dim, k_row);
            to_bf16_row(v_src, head_dim, v_row);
          } else {
            std::memcpy(k_row, k_src, row_bytes);
            std::memcpy(v_row, v_src, row_bytes);
          }
        }
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
// pass 0.04 ms there with the Python around it (4.6 us alone; docs/benchmarks.md, issue 18).
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

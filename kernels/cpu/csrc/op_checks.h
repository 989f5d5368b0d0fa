// What the per-layer CPU ops (elementwise.cpp, store_kv.h) share: their argument checks, which
// raise ValueError naming the argument like kernels/_checks.py, and the parallel grain that
// keeps decode-sized calls on the calling thread. Anonymous namespace: one library per ISA.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>

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

}  // namespace
}  // namespace pdserve

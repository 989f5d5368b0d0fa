// store_kv on CPU: each token's K and V rows copied into its slot of the paged cache, fp32 or
// bfloat16, or quantized on the way in (int8, float8_e4m3fn rows carrying their scale), with
// kernels/store_kv.py's and kernels/kv_quant.py's contracts. Included by elementwise.cpp, which
// registers it. Anonymous namespace: one library per ISA.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "op_checks.h"
#include "vec.h"

namespace pdserve {
namespace {

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

}  // namespace
}  // namespace pdserve

// The decoder layers of a Llama-family model in one call, for steps of a few tokens (decode).
//
// engine/models/llama.py's forward calls about ten ops per layer from Python, ~300 per batch-1
// decode step, each a few microseconds of Python and dispatcher work (the q4 forward took 4.2 ms
// that way in the decode loop, 2.2 ms through this class; docs/benchmarks.md, issue 18, on the
// AVX-512 Xeon). DecoderStack makes the same calls in
// the same order on the same arguments (the compiled ops of elementwise.cpp, attention.cpp and
// quant_linear.cpp, found through the dispatcher once at construction), from C++: the result is
// bit for bit the Python loop's with the compiled ops (tests/kernels/test_cpu_decoder_stack.py).
// Per layer, on rows x [T, hidden] (residual starts as the embedding rows):
//     qkv, residual = rms_norm_quant_linear(x, residual, input_norm, qkv)   (layer 0: rms_norm, then quant_linear)
//     qkv += qkv_bias (if any); rotary(q, k); store_kv(k, v); out = paged_attention(q)
//     x = quant_linear(out, o)
//     gate_up, residual = rms_norm_quant_linear(x, residual, post_attention_norm, gate_up)
//     x = quant_linear(silu_and_mul(gate_up), down)
// and after the last layer: rms_norm(x + residual) * final_norm.
// Weights are the packed GGUF panels of kernels/quant_cpu.py (each with its out_features,
// format and activation mode); the class holds references to them (no copy). Each matmul is
// told which weight comes next (quant_linear's prefetch_next; after the last layer, the
// constructor's read_after: the LM head), which does not change a result.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#define PDSERVE_STRINGIFY2(x) #x
#define PDSERVE_STRINGIFY(x) PDSERVE_STRINGIFY2(x)

namespace pdserve {
namespace {

template <class Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  const std::string qualified = std::string(PDSERVE_STRINGIFY(PDSERVE_NAMESPACE)) + "::" + name;
  return c10::Dispatcher::singleton().findSchemaOrThrow(qualified.c_str(), "").typed<Signature>();
}

using T = const at::Tensor&;

struct Ops {
  c10::TypedOperatorHandle<at::Tensor(T, T, double)> rms_norm =
      find_op<at::Tensor(T, T, double)>("rms_norm");
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(T, T, double, T)> rms_norm_residual =
      find_op<std::tuple<at::Tensor, at::Tensor>(T, T, double, T)>("rms_norm_residual");
  c10::TypedOperatorHandle<void(T, T, T, T)> rotary = find_op<void(T, T, T, T)>("rotary");
  c10::TypedOperatorHandle<void(T, T, T, T, T)> store_kv = find_op<void(T, T, T, T, T)>("store_kv");
  c10::TypedOperatorHandle<at::Tensor(T)> silu_and_mul = find_op<at::Tensor(T)>("silu_and_mul");
  c10::TypedOperatorHandle<void(T, T, T, T, T, T, int64_t, double, T, int64_t)> paged_attention =
      find_op<void(T, T, T, T, T, T, int64_t, double, T, int64_t)>("paged_attention");
  using Next = const std::optional<at::Tensor>&;
  c10::TypedOperatorHandle<at::Tensor(T, T, int64_t, int64_t, bool, Next)> quant_linear =
      find_op<at::Tensor(T, T, int64_t, int64_t, bool, Next)>("quant_linear");
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(T, T, T, double, T, int64_t, int64_t, bool, Next)>
      rms_norm_quant_linear =
          find_op<std::tuple<at::Tensor, at::Tensor>(T, T, T, double, T, int64_t, int64_t, bool, Next)>(
              "rms_norm_quant_linear");
};

struct QuantWeight {
  at::Tensor panels;
  int64_t out_features, format;
  bool exact;
  // the weight read after this one (the next matmul's, the LM head's after the last layer):
  // quant_linear's prefetch_next, so each matmul starts on bytes already on their way
  std::optional<at::Tensor> next = std::nullopt;
};

// The four matmul weights of a layer, in this order in the constructor's lists.
enum Matmul { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3, kMatmuls = 4 };

class DecoderStack : public torch::CustomClassHolder {
 public:
  // panels, out_features, formats, exact: kMatmuls entries per layer (qkv, o, gate_up, down);
  // norms: 2 per layer (input, post-attention) then the final norm; qkv_biases: none or one per
  // layer. ValueError for inconsistent lists.
  DecoderStack(std::vector<at::Tensor> panels, std::vector<int64_t> out_features, std::vector<int64_t> formats,
               std::vector<int64_t> exact, std::vector<at::Tensor> norms, std::vector<at::Tensor> qkv_biases,
               std::vector<at::Tensor> read_after, at::Tensor cos_sin_cache, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, double eps, double scale)
      : cos_sin_cache_(std::move(cos_sin_cache)), num_heads_(num_heads), num_kv_heads_(num_kv_heads),
        head_dim_(head_dim), eps_(eps), scale_(scale) {
    const size_t num_layers = panels.size() / kMatmuls;
    TORCH_CHECK_VALUE(panels.size() == num_layers * kMatmuls && out_features.size() == panels.size() &&
                          formats.size() == panels.size() && exact.size() == panels.size(),
                      "DecoderStack: panels, out_features, formats and exact need ", kMatmuls,
                      " entries per layer, got ", panels.size(), ", ", out_features.size(), ", ",
                      formats.size(), ", ", exact.size());
    TORCH_CHECK_VALUE(norms.size() == 2 * num_layers + 1, "DecoderStack: norms needs 2 per layer and the "
                      "final one (", 2 * num_layers + 1, "), got ", norms.size());
    TORCH_CHECK_VALUE(qkv_biases.empty() || qkv_biases.size() == num_layers,
                      "DecoderStack: qkv_biases needs none or one per layer, got ", qkv_biases.size());
    TORCH_CHECK_VALUE(read_after.size() <= 1, "DecoderStack: read_after takes at most one weight, got ",
                      read_after.size());
    for (size_t i = 0; i < panels.size(); ++i)
      weights_.push_back({panels[i], out_features[i], formats[i], exact[i] != 0});
    for (size_t i = 0; i + 1 < weights_.size(); ++i) weights_[i].next = weights_[i + 1].panels;
    if (!read_after.empty() && !weights_.empty()) weights_.back().next = read_after[0];
    norms_ = std::move(norms);
    qkv_biases_ = std::move(qkv_biases);
    num_layers_ = static_cast<int64_t>(num_layers);
  }

  // hidden: [T, hidden] embedding rows; the attention metadata as engine/models/llama.py's
  // AttentionMetadata; kv_cache: [num_blocks, L, 2, block_size, Hkv, D] (any dtype the compiled
  // store_kv and paged_attention take). Runs the first num_layers layers (< 0: all) and returns
  // the final-norm rows [T, hidden].
  at::Tensor forward(at::Tensor hidden, at::Tensor positions, at::Tensor slot_mapping, at::Tensor block_tables,
                     at::Tensor seq_lens, at::Tensor cu_seqlens_q, int64_t max_seqlen_q, at::Tensor kv_cache,
                     int64_t num_layers, int64_t max_kernel_q_len) {
    const int64_t n = num_layers < 0 ? num_layers_ : num_layers;
    TORCH_CHECK_VALUE(n <= num_layers_, "DecoderStack: num_layers ", n, " > the model's ", num_layers_);
    const auto& views = layer_views(kv_cache);
    const int64_t T = hidden.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    at::Tensor x = hidden, residual;
    for (int64_t i = 0; i < n; ++i) {
      const QuantWeight* w = &weights_[i * kMatmuls];
      at::Tensor qkv = norm_matmul(x, residual, norms_[2 * i], w[kQkv]);
      if (!qkv_biases_.empty()) qkv.add_(qkv_biases_[i]);
      const at::Tensor q = qkv.narrow(1, 0, q_size).reshape({T, num_heads_, head_dim_});
      const at::Tensor k = qkv.narrow(1, q_size, kv_size).reshape({T, num_kv_heads_, head_dim_});
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).reshape({T, num_kv_heads_, head_dim_});
      ops_.rotary.call(q, k, positions, cos_sin_cache_);
      ops_.store_kv.call(k, v, views[i].first, views[i].second, slot_mapping);
      at::Tensor out = at::empty({T, num_heads_, head_dim_}, q.options());
      ops_.paged_attention.call(q, views[i].first, views[i].second, block_tables, seq_lens, cu_seqlens_q,
                                max_seqlen_q, scale_, out, max_kernel_q_len);
      x = matmul(out.reshape({T, q_size}), w[kO]);
      at::Tensor gate_up = norm_matmul(x, residual, norms_[2 * i + 1], w[kGateUp]);
      x = matmul(ops_.silu_and_mul.call(gate_up), w[kDown]);
    }
    const at::Tensor& final_norm = norms_.back();
    if (!residual.defined()) return ops_.rms_norm.call(x, final_norm, eps_);
    return std::get<0>(ops_.rms_norm_residual.call(x, final_norm, eps_, residual));
  }

  int64_t num_layers() const { return num_layers_; }

 private:
  at::Tensor matmul(const at::Tensor& x, const QuantWeight& w) const {
    return ops_.quant_linear.call(x, w.panels, w.out_features, w.format, w.exact, w.next);
  }

  // quant_linear(rms_norm(x + residual) * norm), and residual <- x + residual; a residual not
  // yet defined (layer 0) means no add, and residual <- x.
  at::Tensor norm_matmul(const at::Tensor& x, at::Tensor& residual, const at::Tensor& norm,
                         const QuantWeight& w) const {
    if (!residual.defined()) {
      residual = x;
      return matmul(ops_.rms_norm.call(x, norm, eps_), w);
    }
    auto [y, summed] = ops_.rms_norm_quant_linear.call(x, residual, norm, eps_, w.panels, w.out_features,
                                                       w.format, w.exact, w.next);
    residual = std::move(summed);
    return y;
  }

  // Every layer's (key, value) views of kv_cache, built once per cache tensor.
  const std::vector<std::pair<at::Tensor, at::Tensor>>& layer_views(const at::Tensor& kv_cache) {
    TORCH_CHECK_VALUE(kv_cache.dim() == 6 && kv_cache.size(1) >= num_layers_ && kv_cache.size(2) == 2,
                      "DecoderStack: kv_cache must be [num_blocks, num_layers >= ", num_layers_,
                      ", 2, block_size, num_kv_heads, head_dim], got ", kv_cache.sizes());
    if (!views_.empty() && views_key_.is_same(kv_cache) && views_ptr_ == kv_cache.data_ptr()) return views_;
    views_.clear();
    for (int64_t i = 0; i < num_layers_; ++i) {
      const at::Tensor layer = kv_cache.select(1, i);
      views_.emplace_back(layer.select(1, 0), layer.select(1, 1));
    }
    views_key_ = kv_cache;
    views_ptr_ = kv_cache.data_ptr();
    return views_;
  }

  Ops ops_;
  std::vector<QuantWeight> weights_;
  std::vector<at::Tensor> norms_, qkv_biases_;
  at::Tensor cos_sin_cache_;
  int64_t num_layers_ = 0, num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  std::vector<std::pair<at::Tensor, at::Tensor>> views_;
  at::Tensor views_key_;
  const void* views_ptr_ = nullptr;
};

}  // namespace
}  // namespace pdserve

TORCH_LIBRARY_FRAGMENT(PDSERVE_NAMESPACE, m) {
  m.class_<pdserve::DecoderStack>("DecoderStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor,
                       int64_t, int64_t, int64_t, double, double>())
      .def("forward", &pdserve::DecoderStack::forward)
      .def("num_layers", &pdserve::DecoderStack::num_layers);
}

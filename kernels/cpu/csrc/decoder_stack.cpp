// The decoder layers of a Llama-family model in one call, for steps of a few tokens (decode).
//
// engine/models/llama.py's forward calls about ten ops per layer from Python, ~300 per batch-1
// decode step, each a few microseconds of Python and dispatcher work. DecoderStack computes
// what those calls compute with the compiled ops, bit for bit (tests/kernels/test_cpu_decoder_stack.py),
// from C++, on one of two paths:
//   - steps of up to kTeamMaxRows rows: the team path (forward_as_team, below): the matmuls
//     between two attentions in one parallel region, their norms and activation quantization
//     done by each thread for itself, no tensor allocated per op; attention as the ops' calls.
//   - longer steps: the ops' calls through the dispatcher (forward_by_ops), each op its own region.
// Measured on the default model, q4, AVX-512 Xeon, 2 threads (forward only): 1 row 4.2 ms as
// ~300 Python calls, 1.76 ms as dispatcher calls, 1.47 ms as a team; 16 rows 6.68 vs 6.50 ms;
// equal at 32; the team 2-4% slower at 63-64 rows (every thread prepares every row).
// Per layer, on rows x [T, hidden] (residual starts as the embedding rows):
//     qkv, residual = rms_norm_quant_linear(x, residual, input_norm, qkv)   (layer 0: rms_norm, then quant_linear)
//     qkv += qkv_bias (if any); rotary(q, k); store_kv(k, v); out = paged_attention(q)
//     x = quant_linear(out, o)
//     gate_up, residual = rms_norm_quant_linear(x, residual, post_attention_norm, gate_up)
//     x = quant_linear(silu_and_mul(gate_up), down)
// and after the last layer: rms_norm(x + residual) * final_norm.
// Weights are the packed GGUF panels of kernels/quant_cpu.py (each with its out_features,
// format and activation mode); the class holds references to them (no copy). Each matmul's
// threads, done, fetch their first bytes of the weight read next (after the last layer, the
// constructor's read_after: the LM head), which does not change a result. One caller at a time:
// the team path keeps per-thread scratch in the object.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <omp.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "quant_tiles.h"
#include "vec.h"

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

// Steps of up to this many rows take the team path (DecoderStack::forward_as_team); longer ones
// the ops' calls (measured crossover: the header).
constexpr int64_t kTeamMaxRows = 32;

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
    hidden_size_ = norms_[0].size(0);
    intermediate_size_ = num_layers > 0 ? weights_[kGateUp].out_features / 2 : 0;
    // the team path reads the weights' and norms' data directly: their shapes must agree
    const int64_t q_size = num_heads * head_dim, inputs[kMatmuls] = {hidden_size_, q_size, hidden_size_,
                                                                      intermediate_size_};
    const int64_t outputs[kMatmuls] = {q_size + 2 * num_kv_heads * head_dim, hidden_size_, 2 * intermediate_size_,
                                       hidden_size_};
    for (size_t i = 0; i < weights_.size(); ++i) {
      const QuantWeight& w = weights_[i];
      TORCH_CHECK_VALUE(w.panels.dim() == 3 && w.panels.size(1) * block_inputs(w.format) == inputs[i % kMatmuls] &&
                            w.out_features == outputs[i % kMatmuls],
                        "DecoderStack: weight ", i, " (layer ", i / kMatmuls, ", matmul ", i % kMatmuls,
                        ") must map ", inputs[i % kMatmuls], " inputs to ", outputs[i % kMatmuls], " outputs");
    }
    for (const at::Tensor& norm : norms_)
      TORCH_CHECK_VALUE(norm.scalar_type() == at::kFloat && norm.dim() == 1 && norm.size(0) == hidden_size_ &&
                            norm.is_contiguous(),
                        "DecoderStack: norms must be contiguous float32 [", hidden_size_, "] tensors");
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
    const Step step{positions, slot_mapping, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, max_kernel_q_len,
                    layer_views(kv_cache)};
    if (n > 0 && hidden.size(0) <= kTeamMaxRows) return forward_as_team(hidden, step, n);
    return forward_by_ops(hidden, step, n);
  }

  int64_t num_layers() const { return num_layers_; }

 private:
  // One step's attention metadata and the cache's per-layer views.
  struct Step {
    const at::Tensor &positions, &slot_mapping, &block_tables, &seq_lens, &cu_seqlens_q;
    int64_t max_seqlen_q, max_kernel_q_len;
    const std::vector<std::pair<at::Tensor, at::Tensor>>& views;
  };

  // The layers as dispatcher calls of the compiled ops (each its own parallel region): steps
  // with more rows than kTeamMaxRows, and no layers at all.
  at::Tensor forward_by_ops(const at::Tensor& hidden, const Step& step, int64_t n) const {
    const int64_t T = hidden.size(0);
    at::Tensor x = hidden, residual;
    for (int64_t i = 0; i < n; ++i) {
      const QuantWeight* w = &weights_[i * kMatmuls];
      const Qkv qkv = split_qkv(norm_matmul(x, residual, norms_[2 * i], w[kQkv]));
      at::Tensor out = at::empty({T, num_heads_, head_dim_}, hidden.options());
      attention(qkv, i, step, out);
      x = matmul(out.reshape({T, num_heads_ * head_dim_}), w[kO]);
      at::Tensor gate_up = norm_matmul(x, residual, norms_[2 * i + 1], w[kGateUp]);
      x = matmul(ops_.silu_and_mul.call(gate_up), w[kDown]);
    }
    const at::Tensor& final_norm = norms_.back();
    if (!residual.defined()) return ops_.rms_norm.call(x, final_norm, eps_);
    return std::get<0>(ops_.rms_norm_residual.call(x, final_norm, eps_, residual));
  }

  // A fused qkv matmul's output [T, q + 2 kv] and its q, k, v views [T, heads, head_dim].
  struct Qkv {
    at::Tensor all, q, k, v;
  };

  Qkv split_qkv(at::Tensor qkv) const {
    const int64_t T = qkv.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    Qkv views{qkv, qkv.narrow(1, 0, q_size).reshape({T, num_heads_, head_dim_}),
              qkv.narrow(1, q_size, kv_size).reshape({T, num_kv_heads_, head_dim_}),
              qkv.narrow(1, q_size + kv_size, kv_size).reshape({T, num_kv_heads_, head_dim_})};
    return views;
  }

  // Layer i's attention between its qkv and o matmuls: the qkv bias (if any), rotary on q and
  // k, the new keys and values into the cache, and paged attention into out [T, heads, head_dim].
  void attention(const Qkv& qkv, int64_t i, const Step& step, const at::Tensor& out) const {
    if (!qkv_biases_.empty()) qkv.all.add_(qkv_biases_[i]);
    const auto& [key_cache, value_cache] = step.views[i];
    ops_.rotary.call(qkv.q, qkv.k, step.positions, cos_sin_cache_);
    ops_.store_kv.call(qkv.k, qkv.v, key_cache, value_cache, step.slot_mapping);
    ops_.paged_attention.call(qkv.q, key_cache, value_cache, step.block_tables, step.seq_lens, step.cu_seqlens_q,
                              step.max_seqlen_q, scale_, out, step.max_kernel_q_len);
  }

  // ---- the team path: the matmuls of a layer in one parallel region ----
  //
  // Between two attentions a layer makes three matmuls (o, gate_up, down) and the next layer's
  // qkv, with a norm or silu before each: one parallel region for all four, the threads meeting
  // at a barrier after each matmul, instead of a region (fork and join) and serial norm and
  // activation quantization per matmul, and ~20 tensors allocated per layer. Each thread
  // computes its items' columns of each matmul (ATen's static split, as quant_linear's), the
  // norm, silu and activation quantization of the rows itself (redundantly: a few microseconds
  // at decode sizes, the time the ops' serial part took), and keeps its own copy of the
  // residual stream, so no thread writes what another reads between two barriers. The values
  // are the ops' (the same functions: quant_tiles.h, vec.h); attention stays the ops' calls,
  // between the regions.

  // Per thread: the residual stream, the normed (or silu) rows, their activation quantization.
  struct Scratch {
    std::vector<float> residual, rows, factors;  // factors: dx then xsum, per row and block
    std::vector<int8_t> quantized;
  };

  // Rows of M x K floats -> the thread's Rows for a matmul by w (quantized unless w.exact).
  Rows prepare(Scratch& s, const float* x, int64_t stride, int64_t M, int64_t K, const QuantWeight& w) const {
    const int64_t nb = K / kBlock;
    float* dx = s.factors.data();
    float* xsum = dx + M * nb;
    int8_t* xq = w.exact ? nullptr : s.quantized.data();
    for (int64_t m = 0; m < M; ++m)
      prepare_row(x + m * stride, nb, xsum + m * nb, xq ? xq + m * K : nullptr, dx + m * nb);
    return {x, stride, xq, dx, xsum, K, nb};
  }

  // This thread's items of rows x w into out [M, w.out_features]; then it fetches its first
  // item of the weight read next.
  static void multiply(const Rows& rows, int64_t M, const QuantWeight& w, float* out, int64_t t, int64_t nt) {
    const int64_t P = w.panels.size(0);
    const auto [begin, end] = split_items(num_items(P), t, nt);
    multiply_items(rows, M, w.panels.data_ptr<unsigned char>(), P, w.out_features, w.format, w.exact, begin, end,
                   out);
    if (!w.next.has_value()) return;
    const at::Tensor& next = *w.next;
    const int64_t item_bytes = kPanels * next.size(1) * next.size(2);
    const int64_t items = num_items(next.size(0));
    const int64_t first = std::min(split_items(items, t, nt).first, std::max<int64_t>(items - 1, 0));
    prefetch_bytes(next.data_ptr<unsigned char>() + first * item_bytes, std::min(next.numel(), item_bytes));
  }

  // The thread's residual += x (rows of H), and out = rms_norm(residual) * norm (out: the
  // thread's rows unless given): the ops' values (rms_norm_quant_linear, rms_norm_residual),
  // x + residual summed in their order.
  void add_and_norm(Scratch& s, const float* x, int64_t M, const at::Tensor& norm, float* out = nullptr) const {
    const int64_t H = hidden_size_;
    const float* weight = norm.data_ptr<float>();
    if (out == nullptr) out = s.rows.data();
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * H;
      float* sr = s.residual.data() + m * H;
      int64_t i = 0;
      for (; i + kLanes <= H; i += kLanes) vstore(sr + i, vload(xr + i) + vload(sr + i));
      for (; i < H; ++i) sr[i] = xr[i] + sr[i];
      rms_norm_row(sr, weight, out + m * H, H, static_cast<float>(eps_));
    }
  }

  at::Tensor forward_as_team(const at::Tensor& hidden, const Step& step, int64_t n) {
    const int64_t T = hidden.size(0), H = hidden_size_, inter = intermediate_size_;
    TORCH_CHECK_VALUE(hidden.dim() == 2 && hidden.size(1) == H && hidden.scalar_type() == at::kFloat &&
                          hidden.is_contiguous(),
                      "DecoderStack: hidden must be a contiguous float32 [T, ", H, "] tensor, got ", hidden.sizes());
    const int64_t threads = std::max<int64_t>(at::get_num_threads(), 1);
    const int64_t widest = std::max({H, num_heads_ * head_dim_, inter});
    if (static_cast<int64_t>(scratch_.size()) < threads) scratch_.resize(threads);
    for (int64_t t = 0; t < threads; ++t) {
      Scratch& s = scratch_[t];
      s.residual.assign(hidden.data_ptr<float>(), hidden.data_ptr<float>() + T * H);  // layer 0: residual = x
      s.rows.resize(T * widest);
      s.factors.resize(2 * T * (widest / kBlock));
      s.quantized.resize(T * widest);
    }
    const at::TensorOptions options = hidden.options();
    const Qkv qkv = split_qkv(at::empty({T, weights_[kQkv].out_features}, options));
    const at::Tensor out = at::empty({T, num_heads_, head_dim_}, options);
    at::Tensor x = at::empty({T, H}, options), gate_up = at::empty({T, 2 * inter}, options);
    float *x_p = x.data_ptr<float>(), *gate_up_p = gate_up.data_ptr<float>(), *qkv_p = qkv.all.data_ptr<float>();
    const float* out_p = out.data_ptr<float>();
    const float* hidden_p = hidden.data_ptr<float>();

    // layer 0's qkv: rms_norm(x) (no residual yet)
    in_team(threads, [&](Scratch& s, int64_t t, int64_t nt) {
      for (int64_t m = 0; m < T; ++m)
        rms_norm_row(hidden_p + m * H, norms_[0].data_ptr<float>(), s.rows.data() + m * H, H,
                     static_cast<float>(eps_));
      multiply(prepare(s, s.rows.data(), H, T, H, weights_[kQkv]), T, weights_[kQkv], qkv_p, t, nt);
    });
    for (int64_t i = 0; i < n; ++i) {
      attention(qkv, i, step, out);
      const QuantWeight* w = &weights_[i * kMatmuls];
      const bool last = i + 1 == n;
      in_team(threads, [&](Scratch& s, int64_t t, int64_t nt) {
        multiply(prepare(s, out_p, num_heads_ * head_dim_, T, num_heads_ * head_dim_, w[kO]), T, w[kO], x_p, t, nt);
#pragma omp barrier
        add_and_norm(s, x_p, T, norms_[2 * i + 1]);
        multiply(prepare(s, s.rows.data(), H, T, H, w[kGateUp]), T, w[kGateUp], gate_up_p, t, nt);
#pragma omp barrier
        for (int64_t m = 0; m < T; ++m)
          silu_and_mul_row(gate_up_p + m * 2 * inter, gate_up_p + m * 2 * inter + inter, s.rows.data() + m * inter,
                           inter);
        multiply(prepare(s, s.rows.data(), inter, T, inter, w[kDown]), T, w[kDown], x_p, t, nt);
        if (last) return;
#pragma omp barrier
        const QuantWeight& next_qkv = weights_[(i + 1) * kMatmuls + kQkv];
        add_and_norm(s, x_p, T, norms_[2 * (i + 1)]);
        multiply(prepare(s, s.rows.data(), H, T, H, next_qkv), T, next_qkv, qkv_p, t, nt);
      });
    }
    // the final norm of x + residual, from thread 0's residual
    at::Tensor normed = at::empty({T, H}, options);
    add_and_norm(scratch_[0], x_p, T, norms_.back(), normed.data_ptr<float>());
    return normed;
  }

  // f(scratch, t, nt) on each of `threads` threads of torch's OpenMP pool (nt: how many it got).
  template <class F>
  void in_team(int64_t threads, const F& f) {
#pragma omp parallel num_threads(threads)
    {
      const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
      f(scratch_[t], t, nt);
    }
  }

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
  std::vector<Scratch> scratch_;  // per thread of the team path
  std::vector<QuantWeight> weights_;
  std::vector<at::Tensor> norms_, qkv_biases_;
  at::Tensor cos_sin_cache_;
  int64_t num_layers_ = 0, num_heads_, num_kv_heads_, head_dim_, hidden_size_, intermediate_size_;
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

// llama_layers: the decoder-layer loop of turbospec.model.Transformer.forward in C++ (CPU).
//
// A batch-1 decode step of a small model on CPU is dominated by per-op overhead, not by the weight
// reads: ~450 small ATen ops per step, each paying Python dispatch. This kernel runs exactly the
// same ATen ops in the same order as the Python loop (model.py: Transformer._layers_python), so the
// results are bit-identical, without the Python interpreter between them. Linears use oneDNN
// weights pre-packed by Python (mkldnn::_linear_pointwise): one layout for single-row inputs and
// one for multi-row inputs.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "gemv.h"

#include <optional>
#include <string_view>
#include <vector>

namespace turbospec {
namespace {

// Per layer, in this order: attn_norm, qkv_row, qkv_rows, o_row, o_rows, mlp_norm, gate_up_row,
// gate_up_rows, down_row, down_rows (+ qkv_bias last when has_bias).
constexpr int64_t kPerLayer = 10;
// Rows up to which linears use small_linear (keep equal to turbospec.model.Linear.SMALL_ROWS).
constexpr int64_t kSmallRows = 4;

at::Tensor linear(const at::Tensor& x, const at::Tensor& w_row, const at::Tensor& w_rows,
                  const std::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         std::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<std::string_view>)>();
  // A dense w_row means: up to kSmallRows rows go through small_linear (gemv.cpp), which streams the
  // weight faster than oneDNN for one row; from about 6 rows on oneDNN's GEMM is faster (measured on
  // the project's CPU: 1 row 16.6 vs 23.0 ms per SmolLM2 step, 4 rows 19.2 vs 21.9, 8 rows 31.1 vs 25.1).
  if (!w_row.is_mkldnn() && x.numel() <= kSmallRows * x.size(-1) && small_linear_supports(x, w_row))
    return small_linear(x, w_row, bias);
  const auto shape = x.sizes().vec();
  at::Tensor x2 = x.reshape({-1, shape.back()});
  at::Tensor y = op.call(x2, x2.size(0) == 1 && w_row.is_mkldnn() ? w_row : w_rows, bias, "none", c10::List<std::optional<at::Scalar>>(),
                         std::nullopt);
  std::vector<int64_t> out(shape.begin(), shape.end() - 1);
  out.push_back(y.size(1));
  return y.view(out);
}

// Same formula as model.rms_norm.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (x.scalar_type() == at::kFloat) return at::rms_norm(x, {weight.size(0)}, weight, eps);
  at::Tensor h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean({-1}, /*keepdim=*/true) + eps);
  return weight * h.to(x.scalar_type());
}

std::vector<at::Tensor> llama_layers(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin_signed,
                                     const std::optional<at::Tensor>& mask, at::TensorList weights,
                                     at::TensorList k_cache, at::TensorList v_cache, int64_t cache_len,
                                     int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
                                     bool has_bias, at::IntArrayRef capture) {
  const int64_t num_layers = static_cast<int64_t>(k_cache.size());
  const int64_t per_layer = kPerLayer + (has_bias ? 1 : 0);
  TORCH_CHECK(x_in.dim() == 3, "llama_layers: x must be [B, n, hidden], got ", x_in.sizes());
  TORCH_CHECK(static_cast<int64_t>(v_cache.size()) == num_layers,
              "llama_layers: k_cache and v_cache must have one tensor per layer");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == per_layer * num_layers, "llama_layers: weights has ",
              weights.size(), " tensors, expected ", per_layer * num_layers, " (", per_layer, " per layer)");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "llama_layers: num_heads must be a multiple of num_kv_heads");
  const int64_t B = x_in.size(0), n = x_in.size(1);
  const int64_t d = cos.size(-1), total = cache_len + n;
  TORCH_CHECK(num_layers == 0 || total <= k_cache[0].size(2), "llama_layers: cache overflow: cache_len ",
              cache_len, " + ", n, " new tokens > max_seq_len ", k_cache[0].size(2));
  for (int64_t c : capture)
    TORCH_CHECK(c >= 0 && c < num_layers, "llama_layers: capture layer ", c, " is outside [0, ", num_layers, ")");
  const auto dtype = x_in.scalar_type();
  at::Tensor x = x_in;
  std::vector<at::Tensor> out(1 + capture.size());
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor* w = weights.data() + l * per_layer;
    std::optional<at::Tensor> bias;
    if (has_bias) bias = w[kPerLayer];
    at::Tensor h = rms_norm(x, w[0], eps);
    at::Tensor qkv = linear(h, w[1], w[2], bias).view({B, n, num_heads + 2 * num_kv_heads, d});
    at::Tensor qk = qkv.narrow(2, 0, num_heads + num_kv_heads);
    qk = qk * cos + at::roll(qk, {d / 2}, {-1}) * sin_signed;
    at::Tensor q = qk.narrow(2, 0, num_heads).transpose(1, 2);
    at::Tensor k = qk.narrow(2, num_heads, num_kv_heads).transpose(1, 2);
    at::Tensor v = qkv.narrow(2, num_heads + num_kv_heads, num_kv_heads).transpose(1, 2);
    const at::Tensor& kc = k_cache[l];
    const at::Tensor& vc = v_cache[l];
    kc.narrow(2, cache_len, n).copy_(k);
    vc.narrow(2, cache_len, n).copy_(v);
    at::Tensor attn = at::scaled_dot_product_attention(q.to(kc.scalar_type()), kc.narrow(2, 0, total),
                                                       vc.narrow(2, 0, total), mask, 0.0, false, scale,
                                                       /*enable_gqa=*/true);
    attn = attn.to(dtype).transpose(1, 2).reshape({B, n, num_heads * d});
    x = x + linear(attn, w[3], w[4], std::nullopt);
    h = rms_norm(x, w[5], eps);
    at::Tensor gu = linear(h, w[6], w[7], std::nullopt);
    auto parts = gu.chunk(2, -1);
    x = x + linear(at::silu(parts[0]) * parts[1], w[8], w[9], std::nullopt);
    for (size_t c = 0; c < capture.size(); ++c)
      if (capture[c] == l) out[1 + c] = x;
  }
  out[0] = x;
  return out;
}

}  // namespace

// The packed oneDNN weights carry the MkldnnCPU key, so the kernel is registered for every backend;
// it is only ever called with CPU tensors (turbospec.model decides).
TORCH_LIBRARY_IMPL(turbospec, CompositeExplicitAutograd, m) { m.impl("llama_layers", &llama_layers); }

}  // namespace turbospec

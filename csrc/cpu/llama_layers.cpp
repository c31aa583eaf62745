// llama_layers: the decoder-layer loop of turbospec.model.Transformer in C++ (CPU).
//
// A batch-1 decode step of a small model on CPU pays per-op overhead on top of the weight reads:
// ~18 ops per layer, each with Python dispatch when run from Python. This kernel runs the same ops
// in the same order as the Python loop (model.py: Transformer.layers_python, its specification), so
// the results are bit-identical, without the interpreter between them. Every linear is
// turbospec::linear (weights in their stored format, one reduction order for any row count) and
// attention is tree_attention's CPU kernel (one order per query row whatever the number of rows), so
// a token's hidden states do not depend on how many tokens share the pass.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "linear.h"
#include "tree_attention.h"

namespace turbospec {
namespace {

constexpr int64_t kLinears = 4;  // per layer: qkv, o, gate_up, down

// Same formula as model.rms_norm.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (x.scalar_type() == at::kFloat) return at::rms_norm(x, {weight.size(0)}, weight, eps);
  at::Tensor h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean({-1}, /*keepdim=*/true) + eps);
  return weight * h.to(x.scalar_type());
}

std::vector<at::Tensor> llama_layers(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin_signed,
                                     const at::Tensor& tree_mask_packed, at::TensorList norms, at::TensorList weights,
                                     at::IntArrayRef formats, at::IntArrayRef counts, at::TensorList biases,
                                     at::TensorList k_cache, at::TensorList v_cache, int64_t cache_len,
                                     int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
                                     at::IntArrayRef capture, int64_t activations) {
  const int64_t num_layers = static_cast<int64_t>(k_cache.size());
  TORCH_CHECK(x_in.dim() == 3, "llama_layers: x must be [B, n, hidden], got ", x_in.sizes());
  TORCH_CHECK(static_cast<int64_t>(v_cache.size()) == num_layers,
              "llama_layers: k_cache and v_cache must have one tensor per layer");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * num_layers, "llama_layers: norms has ", norms.size(),
              " tensors, expected 2 per layer (", 2 * num_layers, ")");
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == kLinears * num_layers, "llama_layers: counts has ",
              counts.size(), " entries, expected 4 per layer (", kLinears * num_layers, ")");
  TORCH_CHECK(weights.size() == formats.size(), "llama_layers: weights (", weights.size(), ") and formats (",
              formats.size(), ") differ in length");
  TORCH_CHECK(biases.empty() || static_cast<int64_t>(biases.size()) == num_layers, "llama_layers: biases must be "
              "empty or one qkv bias per layer, got ", biases.size());
  int64_t total_segments = 0;
  for (int64_t c : counts) {
    TORCH_CHECK(c >= 1, "llama_layers: every linear needs at least one weight segment, got ", c);
    total_segments += c;
  }
  TORCH_CHECK(total_segments == static_cast<int64_t>(weights.size()), "llama_layers: counts add up to ",
              total_segments, " segments, weights has ", weights.size());
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "llama_layers: num_heads must be a multiple of num_kv_heads");
  const int64_t B = x_in.size(0), n = x_in.size(1);
  const int64_t d = cos.size(-1), total = cache_len + n;
  TORCH_CHECK(num_layers == 0 || total <= k_cache[0].size(2), "llama_layers: cache overflow: cache_len ",
              cache_len, " + ", n, " new tokens > max_seq_len ", k_cache[0].size(2));
  for (int64_t c : capture)
    TORCH_CHECK(c >= 0 && c < num_layers, "llama_layers: capture layer ", c, " is outside [0, ", num_layers, ")");
  const auto dtype = x_in.scalar_type();
  const at::Tensor mask = tree_mask_packed.expand({B, n}).contiguous();
  const at::Tensor lens = at::full({B}, cache_len, x_in.options().dtype(at::kLong));
  at::Tensor x = x_in;
  std::vector<at::Tensor> out(1 + capture.size());
  size_t seg = 0;
  auto next_linear = [&](int64_t l, int64_t j, const at::Tensor& in, const std::optional<at::Tensor>& bias) {
    const int64_t c = counts[l * kLinears + j];
    at::Tensor y = linear(in, weights.slice(seg, c), formats.slice(seg, c), bias, activations);
    seg += c;
    return y;
  };
  for (int64_t l = 0; l < num_layers; ++l) {
    std::optional<at::Tensor> bias;
    if (!biases.empty()) bias = biases[l];
    at::Tensor h = rms_norm(x, norms[2 * l], eps);
    at::Tensor qkv = next_linear(l, 0, h, bias).view({B, n, num_heads + 2 * num_kv_heads, d});
    at::Tensor qk = qkv.narrow(2, 0, num_heads + num_kv_heads);
    qk = qk * cos + at::roll(qk, {d / 2}, {-1}) * sin_signed;
    const at::Tensor& kc = k_cache[l];
    const at::Tensor& vc = v_cache[l];
    kc.narrow(2, cache_len, n).copy_(qk.narrow(2, num_heads, num_kv_heads).transpose(1, 2));
    vc.narrow(2, cache_len, n).copy_(qkv.narrow(2, num_heads + num_kv_heads, num_kv_heads).transpose(1, 2));
    at::Tensor q = qk.narrow(2, 0, num_heads).to(kc.scalar_type());
    at::Tensor attn = at::empty(q.sizes(), q.options());
    tree_attention_cpu(q, kc, vc, lens, mask, scale, /*include_prefix=*/true, attn, std::nullopt);
    x = x + next_linear(l, 1, attn.to(dtype).view({B, n, num_heads * d}), std::nullopt);
    h = rms_norm(x, norms[2 * l + 1], eps);
    at::Tensor gu = next_linear(l, 2, h, std::nullopt);
    auto parts = gu.chunk(2, -1);
    x = x + next_linear(l, 3, at::silu(parts[0]) * parts[1], std::nullopt);
    for (size_t c = 0; c < capture.size(); ++c)
      if (capture[c] == l) out[1 + c] = x;
  }
  out[0] = x;
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(turbospec, CPU, m) { m.impl("llama_layers", &llama_layers); }

}  // namespace turbospec

// Argument checks shared by the CPU and CUDA entry points of every turbospec op.
//
// Each message names the op, the parameter, what is allowed and what was received, e.g.
//   "verify: uniform must be float32 [B, N] = [1, 5], got float64 [1, 5]".
// Values inside tensors (parents, token ids, path indices) are checked by the kernels themselves:
// the CPU kernels raise, the CUDA kernels mark the row invalid (no host sync).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace turbospec {

constexpr int64_t kMaxTreeNodes = 64;  // a tree mask row is one int64 (reference.MAX_TREE_NODES)

inline std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat: return "float32";
    case c10::kDouble: return "float64";
    case c10::kHalf: return "float16";
    case c10::kBFloat16: return "bfloat16";
    case c10::kLong: return "int64";
    case c10::kInt: return "int32";
    case c10::kShort: return "int16";
    case c10::kChar: return "int8";
    case c10::kByte: return "uint8";
    case c10::kBool: return "bool";
    default: return c10::toString(t);
  }
}

inline std::string shape_str(c10::IntArrayRef s) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << "]";
  return o.str();
}

inline std::string describe(const at::Tensor& t) {
  return dtype_name(t.scalar_type()) + " " + shape_str(t.sizes());
}

// One named dimension of an expected shape, e.g. {"B", 4}.
struct Dim {
  const char* name;
  int64_t size;
};

inline bool is_float_dtype(c10::ScalarType t) {
  return t == c10::kFloat || t == c10::kBFloat16 || t == c10::kHalf;
}

// Checks the dtype (one of `dtypes`) and the exact shape of `t`.
inline void check_tensor(const char* op, const char* name, const at::Tensor& t,
                         std::initializer_list<c10::ScalarType> dtypes, std::initializer_list<Dim> dims) {
  bool dtype_ok = false;
  for (auto d : dtypes) dtype_ok = dtype_ok || t.scalar_type() == d;
  bool shape_ok = t.dim() == static_cast<int64_t>(dims.size());
  if (shape_ok) {
    int64_t i = 0;
    for (const Dim& d : dims) shape_ok = shape_ok && t.size(i++) == d.size;
  }
  if (dtype_ok && shape_ok) return;
  std::ostringstream want;
  size_t k = 0;
  for (auto d : dtypes) {
    want << (k == 0 ? "" : (k + 1 == dtypes.size() ? " or " : ", ")) << dtype_name(d);
    ++k;
  }
  want << " [";
  k = 0;
  for (const Dim& d : dims) want << (k++ ? ", " : "") << d.name;
  want << "] = [";
  k = 0;
  for (const Dim& d : dims) want << (k++ ? ", " : "") << d.size;
  want << "]";
  TORCH_CHECK(false, op, ": ", name, " must be ", want.str(), ", got ", describe(t));
}

inline void check_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref,
                         const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " must be on ", ref.device(), " (the device of ",
              ref_name, "), got ", t.device());
}

inline void check_kernel_device(const char* op, const char* name, const at::Tensor& t, c10::DeviceType type) {
  TORCH_CHECK(t.device().type() == type, op, ": ", name, " must be a ", c10::DeviceTypeName(type, true),
              " tensor for this kernel, got one on ", t.device());
}

inline void check_output(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), op, ": output ", name, " must be contiguous, got ", describe(t),
              " with strides ", shape_str(t.strides()));
}

// ---------------------------------------------------------------------------------------------
// Host-side check of a parents array [B, N] (CPU kernels): node 0 is the root (parent -1) and every
// other node's parent comes before it. Raises on the first bad entry in row-major order.
inline void check_parents_host(const char* op, const int64_t* par, int64_t B, int64_t N) {
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(par[b * N] == -1, op, ": parents[", b, ", 0] = ", par[b * N],
                ": node 0 is the root and its parent must be -1");
    for (int64_t i = 1; i < N; ++i) {
      const int64_t p = par[b * N + i];
      TORCH_CHECK(p >= 0 && p < i, op, ": parents[", b, ", ", i, "] = ", p, ": the parent of node ", i,
                  " must be in [0, ", i, ") (nodes in topological order)");
    }
  }
}

struct TreeDims {
  int64_t B, N;
};

inline TreeDims check_build_tree_args(const at::Tensor& parents, const at::Tensor& tree_mask,
                                      const at::Tensor& tree_mask_packed, const at::Tensor& depth,
                                      const at::Tensor& retrieve_index, c10::DeviceType type) {
  const char* op = "build_tree";
  TORCH_CHECK(parents.dim() == 2 && parents.scalar_type() == c10::kLong, op,
              ": parents must be int64 [B, N], got ", describe(parents));
  const int64_t B = parents.size(0), N = parents.size(1);
  TORCH_CHECK(N >= 1 && N <= kMaxTreeNodes, op, ": parents must have N in [1, ", kMaxTreeNodes,
              "] nodes, got N = ", N, " (", describe(parents), ")");
  check_kernel_device(op, "parents", parents, type);
  check_tensor(op, "tree_mask", tree_mask, {c10::kBool}, {{"B", B}, {"N", N}, {"N", N}});
  check_tensor(op, "tree_mask_packed", tree_mask_packed, {c10::kLong}, {{"B", B}, {"N", N}});
  check_tensor(op, "depth", depth, {c10::kLong}, {{"B", B}, {"N", N}});
  check_tensor(op, "retrieve_index", retrieve_index, {c10::kLong}, {{"B", B}, {"N", N}, {"N", N}});
  const std::pair<const char*, const at::Tensor*> outs[] = {
      {"tree_mask", &tree_mask}, {"tree_mask_packed", &tree_mask_packed}, {"depth", &depth},
      {"retrieve_index", &retrieve_index}};
  for (const auto& o : outs) {
    check_device(op, o.first, *o.second, parents, "parents");
    check_output(op, o.first, *o.second);
  }
  return {B, N};
}

// ---------------------------------------------------------------------------------------------
struct VerifyDims {
  int64_t B, N, V;
};

inline VerifyDims check_verify_args(const at::Tensor& target_logits, const at::Tensor& parents,
                                    const at::Tensor& draft_token_ids, const std::optional<at::Tensor>& draft_probs,
                                    const at::Tensor& uniform, const at::Tensor& temperature,
                                    const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& accept_len, const at::Tensor& accept_index,
                                    const at::Tensor& output_token_ids, c10::DeviceType type) {
  const char* op = "verify";
  TORCH_CHECK(target_logits.dim() == 3 && is_float_dtype(target_logits.scalar_type()), op,
              ": target_logits must be float32, bfloat16 or float16 [B, N, V], got ", describe(target_logits));
  const int64_t B = target_logits.size(0), N = target_logits.size(1), V = target_logits.size(2);
  TORCH_CHECK(N >= 1 && N <= kMaxTreeNodes, op, ": target_logits must have N in [1, ", kMaxTreeNodes,
              "] nodes, got N = ", N, " (", describe(target_logits), ")");
  TORCH_CHECK(V >= 1, op, ": target_logits must have a vocabulary V >= 1, got ", describe(target_logits));
  TORCH_CHECK(V <= INT32_MAX, op, ": target_logits vocabulary V must fit in int32, got V = ", V);
  check_kernel_device(op, "target_logits", target_logits, type);
  check_tensor(op, "parents", parents, {c10::kLong}, {{"B", B}, {"N", N}});
  check_tensor(op, "draft_token_ids", draft_token_ids, {c10::kLong}, {{"B", B}, {"N", N}});
  if (draft_probs.has_value()) {
    check_tensor(op, "draft_probs", *draft_probs, {c10::kFloat, c10::kBFloat16, c10::kHalf},
                 {{"B", B}, {"N", N}, {"V", V}});
    check_device(op, "draft_probs", *draft_probs, target_logits, "target_logits");
  }
  check_tensor(op, "uniform", uniform, {c10::kFloat}, {{"B", B}, {"N", N}});
  check_tensor(op, "accept_len", accept_len, {c10::kLong}, {{"B", B}});
  check_tensor(op, "accept_index", accept_index, {c10::kLong}, {{"B", B}, {"N", N}});
  check_tensor(op, "output_token_ids", output_token_ids, {c10::kLong}, {{"B", B}, {"N", N}});
  const std::pair<const char*, const at::Tensor*> ins[] = {
      {"parents", &parents}, {"draft_token_ids", &draft_token_ids}, {"uniform", &uniform}};
  for (const auto& i : ins) check_device(op, i.first, *i.second, target_logits, "target_logits");
  const std::pair<const char*, const at::Tensor*> outs[] = {
      {"accept_len", &accept_len}, {"accept_index", &accept_index}, {"output_token_ids", &output_token_ids}};
  for (const auto& o : outs) {
    check_device(op, o.first, *o.second, target_logits, "target_logits");
    check_output(op, o.first, *o.second);
  }
  // The per-row sampling parameters: temperature and top_p float32 or float64 [B] (float64 keeps a
  // Python float exact), top_k int64 [B]; their values are the kernels' to check (per row).
  check_tensor(op, "temperature", temperature, {c10::kFloat, c10::kDouble}, {{"B", B}});
  check_tensor(op, "top_k", top_k, {c10::kLong}, {{"B", B}});
  check_tensor(op, "top_p", top_p, {c10::kFloat, c10::kDouble}, {{"B", B}});
  const std::pair<const char*, const at::Tensor*> params[] = {
      {"temperature", &temperature}, {"top_k", &top_k}, {"top_p", &top_p}};
  for (const auto& p : params) check_device(op, p.first, *p.second, target_logits, "target_logits");
  return {B, N, V};
}

// ---------------------------------------------------------------------------------------------
// verify's optional logit processing (reference.verify, reference.verify_processing): dtypes, shapes
// and devices; the values are the kernels' to check (the CPU kernel raises naming the row, the CUDA
// kernel marks the row invalid).
inline void check_verify_processing(const VerifyDims& d, const at::Tensor& target_logits,
                                    const std::optional<at::Tensor>& output_counts,
                                    const std::optional<at::Tensor>& prompt_mask,
                                    const std::optional<at::Tensor>& presence_penalty,
                                    const std::optional<at::Tensor>& frequency_penalty,
                                    const std::optional<at::Tensor>& repetition_penalty,
                                    const std::optional<at::Tensor>& logit_bias, const std::optional<at::Tensor>& min_p,
                                    const std::optional<at::Tensor>& token_bitmask) {
  const char* op = "verify";
  const int64_t B = d.B, N = d.N, V = d.V, W = (d.V + 31) / 32;
  if (output_counts.has_value()) check_tensor(op, "output_counts", *output_counts, {c10::kInt}, {{"B", B}, {"V", V}});
  if (prompt_mask.has_value()) check_tensor(op, "prompt_mask", *prompt_mask, {c10::kBool}, {{"B", B}, {"V", V}});
  if (logit_bias.has_value()) check_tensor(op, "logit_bias", *logit_bias, {c10::kFloat}, {{"B", B}, {"V", V}});
  if (token_bitmask.has_value())
    check_tensor(op, "token_bitmask", *token_bitmask, {c10::kInt}, {{"B", B}, {"N", N}, {"ceil(V / 32)", W}});
  const std::pair<const char*, const std::optional<at::Tensor>*> rows[] = {
      {"presence_penalty", &presence_penalty}, {"frequency_penalty", &frequency_penalty},
      {"repetition_penalty", &repetition_penalty}, {"min_p", &min_p}};
  for (const auto& r : rows)
    if (r.second->has_value()) check_tensor(op, r.first, **r.second, {c10::kFloat, c10::kDouble}, {{"B", B}});
  const std::pair<const char*, const std::optional<at::Tensor>*> all[] = {
      {"output_counts", &output_counts}, {"prompt_mask", &prompt_mask}, {"presence_penalty", &presence_penalty},
      {"frequency_penalty", &frequency_penalty}, {"repetition_penalty", &repetition_penalty},
      {"logit_bias", &logit_bias}, {"min_p", &min_p}, {"token_bitmask", &token_bitmask}};
  for (const auto& a : all)
    if (a.second->has_value()) check_device(op, a.first, **a.second, target_logits, "target_logits");
  for (int i = 0; i < 3; ++i)
    TORCH_CHECK(!rows[i].second->has_value() || output_counts.has_value(), op, ": ", rows[i].first,
                " needs output_counts (int32 [B, V], the request's generated token counts; zeros for a fresh request)");
}

// ---------------------------------------------------------------------------------------------
struct CacheDims {
  int64_t L, B, H, S, D, N;
};

inline CacheDims check_compact_kv_args(at::TensorList caches, const at::Tensor& prefix_len,
                                       const at::Tensor& accept_index, const at::Tensor& accept_len,
                                       c10::DeviceType type) {
  const char* op = "compact_kv";
  TORCH_CHECK(accept_len.dim() == 1 && accept_len.scalar_type() == c10::kLong, op,
              ": accept_len must be int64 [B], got ", describe(accept_len));
  const int64_t B = accept_len.size(0);
  TORCH_CHECK(accept_index.dim() == 2 && accept_index.scalar_type() == c10::kLong && accept_index.size(0) == B,
              op, ": accept_index must be int64 [B, N] with B = ", B, ", got ", describe(accept_index));
  const int64_t N = accept_index.size(1);
  check_tensor(op, "prefix_len", prefix_len, {c10::kLong}, {{"B", B}});
  check_kernel_device(op, "accept_len", accept_len, type);
  check_device(op, "accept_index", accept_index, accept_len, "accept_len");
  check_device(op, "prefix_len", prefix_len, accept_len, "accept_len");
  CacheDims d{static_cast<int64_t>(caches.size()), B, 0, 0, 0, N};
  if (caches.empty()) return d;
  const at::Tensor& c0 = caches[0];
  TORCH_CHECK(c0.dim() == 4 && c0.size(0) == B, op, ": caches[0] must be [B, H, S, D] with B = ", B, ", got ",
              describe(c0));
  d.H = c0.size(1);
  d.S = c0.size(2);
  d.D = c0.size(3);
  for (size_t l = 0; l < caches.size(); ++l) {
    const at::Tensor& c = caches[l];
    const std::string name = "caches[" + std::to_string(l) + "]";
    TORCH_CHECK(c.sizes() == c0.sizes() && c.scalar_type() == c0.scalar_type(), op, ": ", name,
                " must have the dtype and shape of caches[0] (", describe(c0), "), got ", describe(c));
    TORCH_CHECK(c.is_floating_point(), op, ": ", name, " must be a floating-point tensor, got ", describe(c));
    check_device(op, name.c_str(), c, accept_len, "accept_len");
    TORCH_CHECK(c.size(3) <= 1 || c.stride(3) == 1, op, ": ", name,
                " must be contiguous in its last dim (D), got strides ", shape_str(c.strides()));
  }
  return d;
}

// ---------------------------------------------------------------------------------------------
constexpr int64_t kMaxHeadDim = 256;

struct AttnDims {
  int64_t B, n, Hq, Hkv, S, D;
};

// tree_attention: q [B, n, Hq, D] (n <= 64, D <= 256, last dim contiguous), k_cache / v_cache
// [B, Hkv, S, D] of q's dtype (last dim contiguous, Hq % Hkv == 0), cache_len int64 [B],
// tree_mask_packed int64 [B, n], out [B, n, Hq, D] of q's dtype and lse float32 [B, Hq, n] (both
// contiguous), all on q's device. The values of cache_len are checked by the kernels.
inline AttnDims check_tree_attention_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                          const at::Tensor& cache_len, const at::Tensor& tree_mask_packed,
                                          double scale, const at::Tensor& out, const std::optional<at::Tensor>& lse,
                                          c10::DeviceType type) {
  const char* op = "tree_attention";
  TORCH_CHECK(q.dim() == 4 && is_float_dtype(q.scalar_type()), op,
              ": q must be float32, bfloat16 or float16 [B, n, Hq, D], got ", describe(q));
  const int64_t B = q.size(0), n = q.size(1), Hq = q.size(2), D = q.size(3);
  TORCH_CHECK(n >= 1 && n <= kMaxTreeNodes, op, ": q must have n in [1, ", kMaxTreeNodes,
              "] new tokens, got n = ", n, " (", describe(q), ")");
  TORCH_CHECK(Hq >= 1, op, ": q must have Hq >= 1 heads, got ", describe(q));
  TORCH_CHECK(D >= 1 && D <= kMaxHeadDim, op, ": q must have a head dim D in [1, ", kMaxHeadDim, "], got D = ", D,
              " (", describe(q), ")");
  check_kernel_device(op, "q", q, type);
  TORCH_CHECK(q.stride(3) == 1 || D == 1, op, ": q must be contiguous in its last dim (D), got strides ",
              shape_str(q.strides()));
  // The caches hold q's dtype; on CPU, float32 queries also read float16 or bfloat16 caches.
  const bool cache16 = type == c10::DeviceType::CPU && q.scalar_type() == c10::kFloat &&
                       (k_cache.scalar_type() == c10::kHalf || k_cache.scalar_type() == c10::kBFloat16);
  const c10::ScalarType kv_dtype = cache16 ? k_cache.scalar_type() : q.scalar_type();
  const std::string dt = type == c10::DeviceType::CPU && q.scalar_type() == c10::kFloat
                             ? std::string("float32, float16 or bfloat16 (float32 q)")
                             : dtype_name(q.scalar_type()) + " (q's dtype)";
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == kv_dtype && k_cache.size(0) == B &&
                  k_cache.size(3) == D,
              op, ": k_cache must be ", dt, " [B, Hkv, S, D] with B = ", B, " and D = ", D,
              " (the sizes of q), got ", describe(k_cache));
  const int64_t Hkv = k_cache.size(1), S = k_cache.size(2);
  TORCH_CHECK(Hkv >= 1 && Hq % Hkv == 0, op, ": the query heads Hq = ", Hq,
              " must be a multiple of the kv heads Hkv = ", Hkv, " (GQA), got q ", describe(q), " and k_cache ",
              describe(k_cache));
  check_tensor(op, "v_cache", v_cache, {kv_dtype}, {{"B", B}, {"Hkv", Hkv}, {"S", S}, {"D", D}});
  check_tensor(op, "cache_len", cache_len, {c10::kLong}, {{"B", B}});
  check_tensor(op, "tree_mask_packed", tree_mask_packed, {c10::kLong}, {{"B", B}, {"n", n}});
  check_tensor(op, "out", out, {q.scalar_type()}, {{"B", B}, {"n", n}, {"Hq", Hq}, {"D", D}});
  if (lse.has_value()) check_tensor(op, "lse", *lse, {c10::kFloat}, {{"B", B}, {"Hq", Hq}, {"n", n}});
  const std::pair<const char*, const at::Tensor*> ins[] = {
      {"k_cache", &k_cache}, {"v_cache", &v_cache}, {"cache_len", &cache_len},
      {"tree_mask_packed", &tree_mask_packed}, {"out", &out}};
  for (const auto& i : ins) check_device(op, i.first, *i.second, q, "q");
  for (const auto& c : {std::make_pair("k_cache", &k_cache), std::make_pair("v_cache", &v_cache)})
    TORCH_CHECK(c.second->stride(3) == 1 || D == 1, op, ": ", c.first,
                " must be contiguous in its last dim (D), got strides ", shape_str(c.second->strides()));
  check_output(op, "out", out);
  if (lse.has_value()) {
    check_device(op, "lse", *lse, q, "q");
    check_output(op, "lse", *lse);
  }
  TORCH_CHECK(std::isfinite(scale), op, ": scale must be a finite number (e.g. 1 / sqrt(D)), got ", scale);
  return {B, n, Hq, Hkv, S, D};
}

// ---------------------------------------------------------------------------------------------
// The fused decoder-layer ops (add_rms_norm, silu_mul, rope_cache): arguments shared by the CPU and
// CUDA kernels. Row ops take contiguous tensors; `rows` is the product of the leading dims.
struct RowDims {
  int64_t rows, K;
};

inline void check_same_float(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x,
                             const char* x_name) {
  TORCH_CHECK(t.scalar_type() == x.scalar_type() && t.sizes() == x.sizes(), op, ": ", name, " must be ",
              dtype_name(x.scalar_type()), " ", shape_str(x.sizes()), " (the dtype and shape of ", x_name,
              "), got ", describe(t));
  check_device(op, name, t, x, x_name);
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got strides ", shape_str(t.strides()));
}

inline RowDims check_add_rms_norm_args(const at::Tensor& x, const std::optional<at::Tensor>& delta,
                                       const at::Tensor& weight, double eps, const at::Tensor& out,
                                       const std::optional<at::Tensor>& sum_out, c10::DeviceType type) {
  const char* op = "add_rms_norm";
  TORCH_CHECK(x.dim() >= 1 && is_float_dtype(x.scalar_type()) && x.size(-1) >= 1, op,
              ": x must be float32, bfloat16 or float16 [..., K] with K >= 1, got ", describe(x));
  check_kernel_device(op, "x", x, type);
  TORCH_CHECK(x.is_contiguous(), op, ": x must be contiguous, got strides ", shape_str(x.strides()));
  const int64_t K = x.size(-1);
  check_tensor(op, "weight", weight, {x.scalar_type()}, {{"K", K}});
  check_device(op, "weight", weight, x, "x");
  TORCH_CHECK(weight.is_contiguous(), op, ": weight must be contiguous");
  check_same_float(op, "out", out, x, "x");
  TORCH_CHECK(delta.has_value() == sum_out.has_value(), op, ": sum_out (where x + delta is written) must be given "
              "exactly when delta is, got delta ", delta.has_value() ? "given" : "None", " and sum_out ",
              sum_out.has_value() ? "given" : "None");
  if (delta.has_value()) {
    check_same_float(op, "delta", *delta, x, "x");
    check_same_float(op, "sum_out", *sum_out, x, "x");
  }
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps must be finite and >= 0, got ", eps);
  return {x.numel() / K, K};
}

inline RowDims check_silu_mul_args(const at::Tensor& gate_up, const at::Tensor& out, c10::DeviceType type) {
  const char* op = "silu_mul";
  TORCH_CHECK(gate_up.dim() >= 1 && is_float_dtype(gate_up.scalar_type()) && gate_up.size(-1) >= 2 &&
                  gate_up.size(-1) % 2 == 0,
              op, ": gate_up must be float32, bfloat16 or float16 [..., 2I] with I >= 1, got ", describe(gate_up));
  check_kernel_device(op, "gate_up", gate_up, type);
  TORCH_CHECK(gate_up.is_contiguous(), op, ": gate_up must be contiguous, got strides ", shape_str(gate_up.strides()));
  std::vector<int64_t> want(gate_up.sizes().begin(), gate_up.sizes().end());
  want.back() /= 2;
  TORCH_CHECK(out.scalar_type() == gate_up.scalar_type() && out.sizes() == c10::IntArrayRef(want), op,
              ": out must be ", dtype_name(gate_up.scalar_type()), " ", shape_str(want), " (gate_up's dtype, half its "
              "last dim), got ", describe(out));
  check_device(op, "out", out, gate_up, "gate_up");
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous");
  return {gate_up.numel() / gate_up.size(-1), want.back()};
}

struct RopeDims {
  int64_t B, n, H, Hkv, S, D;
};

inline RopeDims check_rope_cache_args(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin_signed,
                                      const at::Tensor& cache_len, int64_t num_heads, const at::Tensor& q_out,
                                      const at::Tensor& k_cache, const at::Tensor& v_cache, c10::DeviceType type) {
  const char* op = "rope_cache";
  TORCH_CHECK(qkv.dim() == 4 && is_float_dtype(qkv.scalar_type()), op,
              ": qkv must be float32, bfloat16 or float16 [B, n, H + 2 Hkv, D], got ", describe(qkv));
  check_kernel_device(op, "qkv", qkv, type);
  TORCH_CHECK(qkv.is_contiguous(), op, ": qkv must be contiguous, got strides ", shape_str(qkv.strides()));
  const int64_t B = qkv.size(0), n = qkv.size(1), D = qkv.size(3);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(0) == B && k_cache.size(3) == D &&
                  k_cache.scalar_type() == qkv.scalar_type(),
              op, ": k_cache must be ", dtype_name(qkv.scalar_type()), " [B, Hkv, S, D] with B = ", B, " and D = ", D,
              " (qkv's dtype and sizes), got ", describe(k_cache));
  const int64_t Hkv = k_cache.size(1), S = k_cache.size(2);
  TORCH_CHECK(num_heads >= 1 && Hkv >= 1 && qkv.size(2) == num_heads + 2 * Hkv, op, ": qkv must hold num_heads = ",
              num_heads, " q heads and 2 x Hkv = 2 x ", Hkv, " k / v heads in dim 2, got ", describe(qkv));
  TORCH_CHECK(D >= 2 && D % 2 == 0, op, ": the head dim D must be even (rotary halves), got D = ", D);
  check_tensor(op, "v_cache", v_cache, {qkv.scalar_type()}, {{"B", B}, {"Hkv", Hkv}, {"S", S}, {"D", D}});
  check_tensor(op, "cos", cos, {qkv.scalar_type()}, {{"B", B}, {"n", n}, {"1", 1}, {"D", D}});
  check_tensor(op, "sin_signed", sin_signed, {qkv.scalar_type()}, {{"B", B}, {"n", n}, {"1", 1}, {"D", D}});
  check_tensor(op, "cache_len", cache_len, {c10::kLong}, {{"B", B}});
  check_tensor(op, "q_out", q_out, {qkv.scalar_type()}, {{"B", B}, {"n", n}, {"H", num_heads}, {"D", D}});
  const std::pair<const char*, const at::Tensor*> ins[] = {{"cos", &cos},         {"sin_signed", &sin_signed},
                                                           {"cache_len", &cache_len}, {"q_out", &q_out},
                                                           {"k_cache", &k_cache}, {"v_cache", &v_cache}};
  for (const auto& i : ins) check_device(op, i.first, *i.second, qkv, "qkv");
  for (const auto& c : {std::make_pair("cos", &cos), std::make_pair("sin_signed", &sin_signed),
                        std::make_pair("cache_len", &cache_len), std::make_pair("q_out", &q_out)})
    TORCH_CHECK(c.second->is_contiguous(), op, ": ", c.first, " must be contiguous");
  for (const auto& c : {std::make_pair("k_cache", &k_cache), std::make_pair("v_cache", &v_cache)})
    TORCH_CHECK(c.second->stride(3) == 1, op, ": ", c.first, " must be contiguous in its last dim (D), got strides ",
                shape_str(c.second->strides()));
  return {B, n, num_heads, Hkv, S, D};
}

}  // namespace turbospec

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
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

#include "../checks.h"
#include "linear.h"
#include "rms_norm.h"
#include "tree_attention.h"

namespace turbospec {
namespace {

constexpr int64_t kLinears = 4;  // per dense layer: qkv, o, gate_up, down

// Where each layer's linears sit in counts, and each linear's weight segments in weights: a dense
// layer has kLinears (qkv, o, gate_up, down), a mixture-of-experts layer of E experts 3 + 2 E (qkv,
// o, the router [E, hidden], then each expert's gate_up and down in expert order).
struct LinearIndex {
  std::vector<int64_t> first;  // per layer: its first linear's index in counts
  std::vector<int64_t> seg;    // per linear: its first segment's index in weights
};

LinearIndex index_linears(int64_t num_layers, at::IntArrayRef experts, at::IntArrayRef counts) {
  LinearIndex ix;
  int64_t lin = 0;
  for (int64_t l = 0; l < num_layers; ++l) {
    ix.first.push_back(lin);
    lin += experts.empty() || experts[l] == 0 ? kLinears : 3 + 2 * experts[l];
  }
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == lin, "llama_layers: counts has ", counts.size(),
              " entries, expected ", lin, " (4 per dense layer, 3 + 2 x experts per expert layer)");
  for (int64_t i = 0, seg = 0; i < lin; ++i) {
    ix.seg.push_back(seg);
    seg += counts[i];
  }
  return ix;
}

// The experts' routing of R rows (model.py: Transformer._route), with ATen's own ops so that every bit
// is the Python loop's: router logits (rounded to the model's dtype) -> float32 softmax -> top k ->
// renormalised over those k when norm_topk -> the weights in the model's dtype. Returns the weights
// (as float32 values of the model's dtype, [R, k]) and the expert ids ([R, k]).
std::pair<at::Tensor, at::Tensor> route(const at::Tensor& logits, int64_t top_k, bool norm_topk,
                                        c10::ScalarType dtype) {
  const at::Tensor probs = at::softmax(logits.to(at::kFloat), -1);
  auto [top, idx] = at::topk(probs, top_k, -1);
  if (norm_topk) top = top / top.sum(-1, true);
  return {top.to(dtype), idx.contiguous()};
}

// Same formula as model.rms_norm (the turbospec::rms_norm kernel in float32 / bfloat16 / float16).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (weight.scalar_type() != x.scalar_type() || !is_float_dtype(x.scalar_type()))
    return at::rms_norm(x, {weight.size(0)}, weight, eps);
  return rms_norm_float(x, weight, eps).to(x.scalar_type());
}

bool all_dtype(at::TensorList ts, c10::ScalarType dtype) {
  return std::all_of(ts.begin(), ts.end(), [&](const at::Tensor& t) { return t.scalar_type() == dtype; });
}

// float32, float16 or bfloat16 caches (all of one dtype) whose head dimension is contiguous (the raw
// loops write K/V rows with stride 1).
bool raw_caches(at::TensorList ts) {
  return (all_dtype(ts, at::kFloat) || all_dtype(ts, at::kHalf) || all_dtype(ts, at::kBFloat16)) &&
         std::all_of(ts.begin(), ts.end(), [](const at::Tensor& t) { return t.dim() == 4 && t.stride(3) == 1; });
}

// src[0, d) into a cache row at element offset off: float32 as is, float16 / bfloat16 rounded to
// nearest even (what the Python layers' copy into the cache does).
// int8 activations over a bfloat16 cache: the attention's products are of bfloat16 values too
// (tree_attention's bf16_products; Transformer.attn_bf16_products is the Python loop's twin)
bool bf16_products(int64_t activations, const at::Tensor& cache) {
  return activations == 8 && cache.scalar_type() == at::kBFloat16;
}

template <typename C>
void store_row_as(void* base, int64_t off, const float* src, int64_t d) {
  C* dst = static_cast<C*>(base) + off;
  for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<C>(src[e]);
}

// bf16_products' caches hold their values as the attention reads them: rounded to bfloat16, and one
// below 2^-50 in magnitude stored as +0 (tree_attention's read flush, done once here instead of at
// every read: kv_flushed). The same values as the Python loops' kv_as_stored.
void store_row_flushed(void* base, int64_t off, const float* src, int64_t d) {
  c10::BFloat16* dst = static_cast<c10::BFloat16*>(base) + off;
  for (int64_t e = 0; e < d; ++e) {
    c10::BFloat16 v(src[e]);
    if ((v.x & 0x7FFF) < (kBf16MinExp << 7)) v.x = 0;
    dst[e] = v;
  }
}

void store_cache_row(const at::Tensor& cache, int64_t off, const float* src, int64_t d, bool flush) {
  switch (cache.scalar_type()) {
    case at::kHalf: return store_row_as<c10::Half>(cache.data_ptr(), off, src, d);
    case at::kBFloat16:
      return flush ? store_row_flushed(cache.data_ptr(), off, src, d)
                   : store_row_as<c10::BFloat16>(cache.data_ptr(), off, src, d);
    default: return store_row_as<float>(cache.data_ptr(), off, src, d);
  }
}

// A bfloat16 cache slice written by torch ops, flushed as store_row_flushed does
void flush_tiny_bf16_(at::Tensor slice) {
  slice.masked_fill_(slice.abs() < std::ldexp(1.0, static_cast<int>(kBf16MinExp) - 127), 0);
}

// A value rounded to the model's dtype T, kept as float32 (T = float: the value itself).
template <typename T>
inline float rnd(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return static_cast<float>(static_cast<T>(v));
  }
}

template <typename T>
void round_all(float* p, int64_t count) {
  if constexpr (!std::is_same_v<T, float>)
    for (int64_t i = 0; i < count; ++i) p[i] = rnd<T>(p[i]);
}

// A T tensor's values as float32 (exact): a contiguous float32 tensor's own data, else a copy in buf.
template <typename T>
const float* as_floats(const at::Tensor& t, std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>) {
    if (t.is_contiguous()) return t.data_ptr<float>();
  }
  const at::Tensor c = t.contiguous();
  const T* p = c.data_ptr<T>();
  buf.assign(p, p + c.numel());
  return buf.data();
}

// f(r0, r1) over rows [0, R): split among the threads from kParallelRows rows (a prefill chunk, a
// long verify pass), where the row-wise work between the linears (norms, rotary embedding and cache
// stores, the gate's product, residual adds) left the other thread waiting (perf of a 256-token
// prefill: the calling thread ~11 % busier); fewer rows stay on the calling thread (a region costs
// more than their work). Each row's arithmetic is its own: the same bits either way.
constexpr int64_t kParallelRows = 64;
template <typename F>
void for_rows(int64_t R, const F& f) {
  if (R >= kParallelRows && at::get_num_threads() > 1 && !at::in_parallel_region())
    at::parallel_for(0, R, 16, f);
  else if (R > 0)
    f(0, R);
}

// The layer loop on raw buffers for a model of dtype T (float32 / bfloat16 / float16; float32 K/V
// caches): the same arithmetic as the ATen loop below, operation for operation, without ~35 ATen
// calls per layer. Activations live in float32 buffers; every value the ATen loop stores in a T
// tensor is rounded to T here at the same point (rnd<T>), and element-wise float32 multiplies and adds
// are correctly rounded, so a loop gives the bits the ATen op gives. SiLU stays an ATen call (its exp).
// Buffers are allocated once per call.
template <typename T>
std::vector<at::Tensor> layers_raw(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                                   const at::Tensor& mask, const at::Tensor& lens, at::TensorList norms,
                                   at::TensorList weights, at::IntArrayRef formats, at::IntArrayRef counts,
                                   at::TensorList biases, at::TensorList k_cache, at::TensorList v_cache,
                                   int64_t max_len, int64_t H, int64_t Hkv, double eps_d, double scale,
                                   at::IntArrayRef capture, int64_t activations, at::TensorList qk_norms,
                                   int64_t layout, at::IntArrayRef windows, int64_t act_kind, double softcap,
                                   at::IntArrayRef experts, int64_t top_k, bool norm_topk, const int64_t* nodes) {
  const int64_t L = static_cast<int64_t>(k_cache.size());
  const int64_t B = x_in.size(0), n = x_in.size(1), hid = x_in.size(2), d = cos_in.size(-1);
  // The rows computed: every token of every batch row, or with `nodes` the first nodes[b] of row b
  // (a ragged pass: the rest are padding, skipped). full[r]: row r's index b * n + i in x_in.
  std::vector<int64_t> full;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < (nodes != nullptr ? nodes[b] : n); ++i) full.push_back(b * n + i);
  const int64_t R = static_cast<int64_t>(full.size());
  const bool ragged = R < B * n;
  const int64_t nqkv = (H + 2 * Hkv) * d, half = d / 2;
  const float eps = static_cast<float>(eps_d);
  const auto fopts = x_in.options().dtype(at::kFloat);
  // Shapes the raw loops rely on (the ATen loop's views would check them).
  const int64_t cd = cos_in.dim();  // 5: [2, ...], the global and the sliding-window layers' tables
  TORCH_CHECK((cd == 4 || (cd == 5 && cos_in.size(0) == 2)) && (cos_in.size(-4) == 1 || cos_in.size(-4) == B) &&
                  cos_in.size(-3) == n && cos_in.size(-2) == 1 && sin_in.sizes() == cos_in.sizes(),
              "llama_layers: cos / sin_signed must be [B or 1, n, 1, D] (or two such stacked), got ", cos_in.sizes(),
              " and ", sin_in.sizes());
  const int64_t per = layout == 2 ? 4 : 2;  // norms per layer
  const LinearIndex ix = index_linears(L, experts, counts);
  const auto width_of = [&](int64_t i) {  // linear i's outputs
    int64_t w = 0;
    for (int64_t k = 0; k < counts[i]; ++k) w += weights[ix.seg[i] + k].size(0);
    return w;
  };
  std::vector<int64_t> gu_width(L);  // per layer: gate_up's outputs (2 x I; an expert layer: each expert's)
  for (int64_t l = 0; l < L; ++l) {
    const int64_t E = experts.empty() ? 0 : experts[l], f = ix.first[l];
    int64_t width[kLinears];
    for (int64_t j = 0; j < kLinears; ++j) width[j] = width_of(f + (E > 0 && j >= 2 ? j + 1 : j));
    gu_width[l] = width[2];
    TORCH_CHECK(width[0] == nqkv && width[1] == hid && width[2] % 2 == 0 && width[3] == hid, "llama_layers: layer ",
                l, " linears have ", width[0], ", ", width[1], ", ", width[2], ", ", width[3], " outputs; expected qkv ",
                nqkv, ", o ", hid, ", gate_up 2 x I, down ", hid);
    if (E > 0) {
      TORCH_CHECK(width_of(f + 2) == E, "llama_layers: layer ", l, " router has ", width_of(f + 2),
                  " outputs, expected one per expert (", E, ")");
      for (int64_t e = 1; e < E; ++e)
        TORCH_CHECK(width_of(f + 3 + 2 * e) == width[2] && width_of(f + 4 + 2 * e) == hid, "llama_layers: layer ",
                    l, " expert ", e, " has gate_up / down of ", width_of(f + 3 + 2 * e), " / ",
                    width_of(f + 4 + 2 * e), " outputs, expected ", width[2], " / ", hid, " (as expert 0)");
    }
    TORCH_CHECK(norms[per * l].numel() == hid && norms[per * l + per - 1].numel() == hid, "llama_layers: layer ", l,
                " norms must have ", hid, " elements");
    TORCH_CHECK(biases.empty() || biases[l].numel() == nqkv, "llama_layers: layer ", l, " qkv bias must have ", nqkv,
                " elements, got ", biases[l].numel());
    TORCH_CHECK(qk_norms.empty() || (qk_norms[2 * l].numel() == d && qk_norms[2 * l + 1].numel() == d) ||
                    (qk_norms[2 * l].numel() == H * d && qk_norms[2 * l + 1].numel() == Hkv * d),
                "llama_layers: layer ", l, " q / k norms must have ", d, " elements each (per head) or ", H * d,
                " and ", Hkv * d, " (over all heads)");
    for (const at::Tensor& c : {k_cache[l], v_cache[l]})
      TORCH_CHECK(c.dim() == 4 && c.size(0) == B && c.size(1) == Hkv && c.size(2) >= max_len + n && c.size(3) == d,
                  "llama_layers: layer ", l, " caches must be [", B, ", ", Hkv, ", S >= ", max_len + n, ", ", d,
                  "], got ", c.sizes());
  }
  at::Tensor x = x_in.to(at::kFloat).contiguous();
  // (a ragged pass: the index of its real rows, made once for the gather and every to_model)
  const at::Tensor full_index = ragged ? at::tensor(full, x_in.options().dtype(at::kLong)) : at::Tensor();
  if (ragged) x = x.view({B * n, hid}).index_select(0, full_index);
  else if (x.data_ptr() == x_in.data_ptr()) x = x.clone();
  std::vector<float> cos_buf, sin_buf, bias_buf;
  const float* cp = as_floats<T>(cos_in, cos_buf);
  const float* sp = as_floats<T>(sin_in, sin_buf);
  const int64_t cos_b = cos_in.size(-4) == 1 ? 0 : n * d;  // [B or 1, n, 1, D]
  const int64_t local_off = cd == 5 ? cos_in.numel() / 2 : 0;  // where the second table starts
  at::Tensor h = at::empty({R, hid}, fopts), qkv = at::empty({R, nqkv}, fopts), y = at::empty({R, hid}, fopts);
  at::Tensor q = at::empty({B, n, H, d}, fopts), attn = at::empty({B, n, H, d}, fopts);
  float* xp = x.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  float* qkvp = qkv.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  const int64_t* lp = lens.data_ptr<int64_t>();  // row b's new tokens go to slots lp[b] + i
  // a copy in the model's dtype (exact: x holds T values)
  // [B, n, hid] in the model's dtype from x's rows (a ragged pass: padding rows 0)
  const auto to_model = [&](const at::Tensor& t) {
    if (!ragged) return t.to(x_in.scalar_type(), false, /*copy=*/true).view({B, n, hid});
    at::Tensor o = at::zeros({B * n, hid}, x_in.options());
    o.index_copy_(0, full_index, t.to(x_in.scalar_type()));
    return o.view({B, n, hid});
  };
  // a ragged pass: the attention's output rows [B * n, H * d] -> attc's [R, H * d]
  at::Tensor attc = ragged ? at::empty({R, H * d}, fopts) : at::Tensor();
  std::vector<at::Tensor> out(1 + capture.size());
  at::Tensor gu, act, gu_t, act_t;  // gu_t / act_t: gate_up / SiLU in T for the ATen SiLU
  // linear i (of every layer's, in order; LinearIndex) over `rows` rows
  auto lin_rows = [&](int64_t i, const float* in, int64_t rows, int64_t K, const float* bias, float* dst) {
    linear_f32(in, rows, K, weights.slice(ix.seg[i], counts[i]), formats.slice(ix.seg[i], counts[i]), bias, dst,
               activations);
  };
  // layer l's j-th linear over all R rows (qkv, o; a dense layer's gate_up, down)
  auto lin = [&](int64_t l, int64_t j, const float* in, int64_t K, const float* bias, float* dst) {
    const bool moe = !experts.empty() && experts[l] > 0;
    lin_rows(ix.first[l] + (moe && j >= 2 ? j + 1 : j), in, R, K, bias, dst);
  };
  // ap [rows, I] = act(gate) * up from gate_up's output g [rows, width] (float32 values as the linear
  // gives them; gt_v / at_v: T tensors of g's and ap's shapes for the 16-bit models' ATen activation)
  auto glu = [&](at::Tensor g, at::Tensor a, at::Tensor gt_v, at::Tensor at_v, int64_t rows, int64_t width) {
    const int64_t I = width / 2;
    float* ap = a.data_ptr<float>();
    const float* up = g.data_ptr<float>() + I;
    if constexpr (std::is_same_v<T, float>) {
      if (act_kind == 0) at::silu_out(a, g.narrow(-1, 0, I));  // (the ATen op F.silu runs: same bits)
      else at::gelu_out(a, g.narrow(-1, 0, I), "tanh");          // F.gelu(approximate="tanh")
      for_rows(rows, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t k = 0; k < I; ++k) ap[r * I + k] = ap[r * I + k] * up[r * width + k];
      });
    } else {
      const float* gp = g.data_ptr<float>();
      T* gt = gt_v.data_ptr<T>();
      for (int64_t i = 0; i < rows * width; ++i) gt[i] = static_cast<T>(gp[i]);  // gate_up's output in T
      if (act_kind == 0) at::silu_out(at_v, gt_v.narrow(-1, 0, I));  // F.silu on the T tensor: same bits
      else at::gelu_out(at_v, gt_v.narrow(-1, 0, I), "tanh");
      const T* at_ = at_v.data_ptr<T>();
      for_rows(rows, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t k = 0; k < I; ++k)
            ap[r * I + k] = rnd<T>(static_cast<float>(at_[r * I + k]) * rnd<T>(up[r * width + k]));
      });
    }
  };
  // An expert layer's MLP (model.py: Transformer._moe with _experts_index) over h (hp) into y (yp),
  // rounded to T: the routing (route), then for each expert in order the rows that chose it, gathered,
  // through its gate_up / activation / down, each output times the row's weight (rounded to T) added to
  // the row's sum (rounded to T): a row's additions in expert order, as index_add_ makes them.
  at::Tensor xin, egu, eact, egu_t, eact_t, ey;  // allocated at the first expert layer
  std::vector<std::vector<int64_t>> chosen;      // per expert: r * top_k + slot, for each row r choosing it
  auto experts_mlp = [&](int64_t l) {
    const int64_t E = experts[l], f = ix.first[l], width = gu_width[l], I = width / 2;
    if (!xin.defined()) {
      xin = at::empty({R, hid}, fopts);
      ey = at::empty({R, hid}, fopts);
    }
    if (!egu.defined() || egu.size(-1) != width) {
      egu = at::empty({R, width}, fopts);
      eact = at::empty({R, I}, fopts);
      if constexpr (!std::is_same_v<T, float>) {
        egu_t = at::empty({R, width}, x_in.options());
        eact_t = at::empty({R, I}, x_in.options());
      }
    }
    const at::Tensor lg = at::empty({R, E}, fopts);
    lin_rows(f + 2, hp, R, hid, nullptr, lg.data_ptr<float>());
    round_all<T>(lg.data_ptr<float>(), R * E);  // router(flat) in T
    const auto [top_t, idx] = route(lg, top_k, norm_topk, x_in.scalar_type());
    std::vector<float> top_buf;
    const float* wp = as_floats<T>(top_t, top_buf);
    const int64_t* ip = idx.data_ptr<int64_t>();
    chosen.assign(E, {});
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < top_k; ++j) chosen[ip[r * top_k + j]].push_back(r * top_k + j);
    std::fill(yp, yp + R * hid, 0.0f);
    float* xinp = xin.data_ptr<float>();
    float* eyp = ey.data_ptr<float>();
    for (int64_t e = 0; e < E; ++e) {
      const std::vector<int64_t>& rows = chosen[e];
      const int64_t nr = static_cast<int64_t>(rows.size());
      if (nr == 0) continue;
      for (int64_t i = 0; i < nr; ++i) std::copy(hp + rows[i] / top_k * hid, hp + (rows[i] / top_k + 1) * hid,
                                                 xinp + i * hid);
      const at::Tensor g = egu.narrow(0, 0, nr), a = eact.narrow(0, 0, nr);
      lin_rows(f + 3 + 2 * e, xinp, nr, hid, nullptr, g.data_ptr<float>());
      if constexpr (std::is_same_v<T, float>) glu(g, a, g, a, nr, width);
      else glu(g, a, egu_t.narrow(0, 0, nr), eact_t.narrow(0, 0, nr), nr, width);
      lin_rows(f + 4 + 2 * e, a.data_ptr<float>(), nr, I, nullptr, eyp);
      round_all<T>(eyp, nr * hid);
      for (int64_t i = 0; i < nr; ++i) {
        const float w = wp[rows[i]];
        float* dst = yp + rows[i] / top_k * hid;
        const float* src = eyp + i * hid;
        for (int64_t c = 0; c < hid; ++c) dst[c] = rnd<T>(dst[c] + rnd<T>(src[c] * w));
      }
    }
  };
  auto add_rows = [&](float* dst, const float* src) {  // dst += src over R rows of hid
    for_rows(R, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0 * hid; i < r1 * hid; ++i) dst[i] = rnd<T>(dst[i] + src[i]);
    });
  };
  auto norm_rows = [&](const float* src, const at::Tensor& w, float* dst) {  // R rows of hid
    const at::Tensor wc = w.contiguous();
    const T* wp = wc.data_ptr<T>();
    for_rows(R, [&](int64_t r0, int64_t r1) {
      rms_norm_rows(src + r0 * hid, hid, wp, r1 - r0, hid, eps, dst + r0 * hid, hid);
    });
  };
  auto norm = [&](const at::Tensor& w) { norm_rows(xp, w, hp); };
  // A layer's norms (model.py: Layer) by layout: pre (in_attn, in_mlp), post (out_attn, out_mlp),
  // sandwich (in_attn, out_attn, in_mlp, out_mlp). A sublayer's input: norm(x), or x itself.
  const bool pre_in = layout != 1, post_out = layout != 0;
  auto sublayer_input = [&](int64_t l, int64_t sub) {
    if (!pre_in) std::copy(xp, xp + R * hid, hp);
    else norm(norms[per * l + (layout == 2 ? 2 * sub : sub)]);
  };
  auto add_output = [&](int64_t l, int64_t sub) {  // x += y, or x += norm(y)
    if (post_out) {
      const at::Tensor& w = norms[per * l + (layout == 2 ? 2 * sub + 1 : sub)];
      norm_rows(yp, w, yp);
    }
    add_rows(xp, yp);
  };
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor& kc = k_cache[l];
    const at::Tensor& vc = v_cache[l];
    const int64_t ks0 = kc.stride(0), ks1 = kc.stride(1), ks2 = kc.stride(2);
    const int64_t vs0 = vc.stride(0), vs1 = vc.stride(1), vs2 = vc.stride(2);
    const bool flush = bf16_products(activations, kc);  // bf16_products: stored flushed, read as flushed
    sublayer_input(l, 0);
    const float* bias = biases.empty() ? nullptr : as_floats<T>(biases[l], bias_buf);
    lin(l, 0, hp, hid, bias, qkvp);
    round_all<T>(qkvp, R * nqkv);
    if (!qk_norms.empty()) {  // each q head and each k head RMS-normed over d, in place (model.py: _qk_norm)
      const at::Tensor qw = qk_norms[2 * l].contiguous(), kw = qk_norms[2 * l + 1].contiguous();
      if (qw.numel() == d) {  // over each head
        for (int64_t r = 0; r < R; ++r) {
          float* row = qkvp + r * nqkv;
          rms_norm_rows(row, d, qw.data_ptr<T>(), H, d, eps, row, d);
          rms_norm_rows(row + H * d, d, kw.data_ptr<T>(), Hkv, d, eps, row + H * d, d);
        }
      } else {  // over all of a token's q, and all of its k
        rms_norm_rows(qkvp, nqkv, qw.data_ptr<T>(), R, H * d, eps, qkvp, nqkv);
        rms_norm_rows(qkvp + H * d, nqkv, kw.data_ptr<T>(), R, Hkv * d, eps, qkvp + H * d, nqkv);
      }
    }
    // rotary embedding of the q and k heads (x * cos + roll(x, D/2) * sin_signed, each op rounded to
    // T); k and v into the cache (in its dtype)
    for_rows(R, [&](int64_t r0, int64_t r1) {
    std::vector<float> krow(d);  // a rotated key row before it is stored in the cache's dtype
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = full[r] / n, i = full[r] % n;
      const int64_t off = (local_off != 0 && !windows.empty() && windows[l] > 0 ? local_off : 0) + b * cos_b + i * d;
      const float* c = cp + off;
      const float* sn = sp + off;
      const float* src = qkvp + r * nqkv;
      for (int64_t hh = 0; hh < H + Hkv; ++hh) {
        const float* xs = src + hh * d;
        float* dst = hh < H ? qp + (full[r] * H + hh) * d : krow.data();
        for (int64_t e = 0; e < d; ++e) {
          const float a = rnd<T>(xs[e] * c[e]);
          const float rot = rnd<T>(xs[e < half ? e + half : e - half] * sn[e]);
          dst[e] = rnd<T>(a + rot);
        }
        if (hh >= H) store_cache_row(kc, b * ks0 + (hh - H) * ks1 + (lp[b] + i) * ks2, dst, d, flush);
      }
      for (int64_t hv = 0; hv < Hkv; ++hv)
        store_cache_row(vc, b * vs0 + hv * vs1 + (lp[b] + i) * vs2, src + (H + Hkv + hv) * d, d, flush);
    }
    });
    tree_attention_cpu(q, kc, vc, lens, mask, scale, /*include_prefix=*/true, attn, std::nullopt,
                       windows.empty() ? 0 : windows[l], softcap, flush, nodes, /*kv_flushed=*/flush);
    float* ap = attn.data_ptr<float>();
    if (ragged) {
      float* cp_ = attc.data_ptr<float>();
      for (int64_t r = 0; r < R; ++r) std::copy(ap + full[r] * H * d, ap + (full[r] + 1) * H * d, cp_ + r * H * d);
      ap = cp_;
    }
    round_all<T>(ap, R * H * d);  // attn.to(dtype)
    lin(l, 1, ap, H * d, nullptr, yp);
    round_all<T>(yp, R * hid);
    add_output(l, 0);
    sublayer_input(l, 1);
    if (!experts.empty() && experts[l] > 0) {
      experts_mlp(l);
    } else {
      const int64_t width = gu_width[l], I = width / 2;
      if (!gu.defined() || gu.size(-1) != width) {
        gu = at::empty({R, width}, fopts);
        act = at::empty({R, I}, fopts);
        if constexpr (!std::is_same_v<T, float>) {
          gu_t = at::empty({R, width}, x_in.options());
          act_t = at::empty({R, I}, x_in.options());
        }
      }
      lin(l, 2, hp, hid, nullptr, gu.data_ptr<float>());
      glu(gu, act, gu_t, act_t, R, width);
      lin(l, 3, act.data_ptr<float>(), I, nullptr, yp);
      round_all<T>(yp, R * hid);
    }
    add_output(l, 1);
    for (size_t c = 0; c < capture.size(); ++c)
      if (capture[c] == l) out[1 + c] = to_model(x);
  }
  out[0] = to_model(x);
  return out;
}

std::vector<at::Tensor> llama_layers(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin_signed,
                                     const at::Tensor& tree_mask_packed, at::TensorList norms, at::TensorList weights,
                                     at::IntArrayRef formats, at::IntArrayRef counts, at::TensorList biases,
                                     at::TensorList k_cache, at::TensorList v_cache, int64_t cache_len,
                                     int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
                                     at::IntArrayRef capture, at::TensorList qk_norms, int64_t activations,
                                     const std::optional<at::Tensor>& cache_lens, int64_t layout,
                                     at::IntArrayRef windows, int64_t act_kind, double softcap,
                                     at::IntArrayRef experts, int64_t top_k, bool norm_topk,
                                     const std::optional<at::Tensor>& nodes_in) {
  const int64_t num_layers = static_cast<int64_t>(k_cache.size());
  TORCH_CHECK(x_in.dim() == 3, "llama_layers: x must be [B, n, hidden], got ", x_in.sizes());
  TORCH_CHECK(static_cast<int64_t>(v_cache.size()) == num_layers,
              "llama_layers: k_cache and v_cache must have one tensor per layer");
  TORCH_CHECK(layout >= 0 && layout <= 2, "llama_layers: norm_layout must be 0 (pre), 1 (post) or 2 (sandwich), got ",
              layout);
  TORCH_CHECK(act_kind == 0 || act_kind == 1, "llama_layers: activation must be 0 (SiLU) or 1 (GeLU tanh), got ",
              act_kind);
  const int64_t per = layout == 2 ? 4 : 2;
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == per * num_layers, "llama_layers: norms has ", norms.size(),
              " tensors, expected ", per, " per layer (", per * num_layers, ")");
  TORCH_CHECK(experts.empty() || static_cast<int64_t>(experts.size()) == num_layers, "llama_layers: experts must "
              "be empty or one entry per layer (its number of experts, 0: a dense MLP), got ", experts.size());
  for (int64_t l = 0; l < static_cast<int64_t>(experts.size()); ++l)
    TORCH_CHECK(experts[l] == 0 || (top_k >= 1 && top_k <= experts[l]), "llama_layers: layer ", l, " has ",
                experts[l], " experts: experts_per_token must be in [1, ", experts[l], "], got ", top_k);
  const LinearIndex ix = index_linears(num_layers, experts, counts);  // (checks counts' length)
  TORCH_CHECK(weights.size() == formats.size(), "llama_layers: weights (", weights.size(), ") and formats (",
              formats.size(), ") differ in length");
  TORCH_CHECK(biases.empty() || static_cast<int64_t>(biases.size()) == num_layers, "llama_layers: biases must be "
              "empty or one qkv bias per layer, got ", biases.size());
  TORCH_CHECK(qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == 2 * num_layers, "llama_layers: qk_norms "
              "must be empty or two per layer (q_norm, k_norm), got ", qk_norms.size());
  TORCH_CHECK(windows.empty() || static_cast<int64_t>(windows.size()) == num_layers, "llama_layers: windows must be "
              "empty or one per layer, got ", windows.size());
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
  const int64_t d = cos.size(-1);
  at::Tensor lens;  // int64 [B]: each row's prefix length
  if (cache_lens.has_value()) {
    lens = *cache_lens;
    TORCH_CHECK(lens.device().is_cpu() && lens.scalar_type() == at::kLong && lens.dim() == 1 && lens.size(0) == B,
                "llama_layers: cache_lens must be an int64 CPU tensor [", B, "], got ", lens.scalar_type(), " ",
                lens.sizes(), " on ", lens.device());
    lens = lens.contiguous();
  } else {
    lens = at::full({B}, cache_len, x_in.options().dtype(at::kLong));
  }
  int64_t min_len = B ? lens.data_ptr<int64_t>()[0] : 0, max_len = min_len;
  for (int64_t b = 1; b < B; ++b) {
    min_len = std::min(min_len, lens.data_ptr<int64_t>()[b]);
    max_len = std::max(max_len, lens.data_ptr<int64_t>()[b]);
  }
  TORCH_CHECK(min_len >= 0, "llama_layers: cache_len must be >= 0, got ", min_len);
  TORCH_CHECK(num_layers == 0 || max_len + n <= k_cache[0].size(2), "llama_layers: cache overflow: cache_len ",
              max_len, " + ", n, " new tokens > max_seq_len ", k_cache[0].size(2));
  for (int64_t c : capture)
    TORCH_CHECK(c >= 0 && c < num_layers, "llama_layers: capture layer ", c, " is outside [0, ", num_layers, ")");
  // nodes (int64 [B]): a ragged pass, row b's new tokens its first nodes[b], the rest padding
  at::Tensor nodes_t;
  const int64_t* nodes = nullptr;
  if (nodes_in.has_value()) {
    nodes_t = nodes_in->contiguous();
    TORCH_CHECK(nodes_t.device().is_cpu() && nodes_t.scalar_type() == at::kLong && nodes_t.dim() == 1 &&
                    nodes_t.size(0) == B,
                "llama_layers: nodes must be an int64 CPU tensor [", B, "], got ", nodes_t.scalar_type(), " ",
                nodes_t.sizes(), " on ", nodes_t.device());
    nodes = nodes_t.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(nodes[b] >= 0 && nodes[b] <= n, "llama_layers: nodes[", b, "] = ", nodes[b], " must be in [0, ", n,
                  "] (the pass's new tokens per row)");
  }
  const auto dtype = x_in.scalar_type();
  const at::Tensor mask = tree_mask_packed.expand({B, n}).contiguous();
  // The raw loop: float32 / bfloat16 / float16 models (every input of the model's dtype), float32,
  // float16 or bfloat16 caches.
  const at::Tensor rope[] = {cos, sin_signed};
  if (is_float_dtype(dtype) && all_dtype(rope, dtype) && all_dtype(norms, dtype) && all_dtype(biases, dtype) &&
      all_dtype(qk_norms, dtype) &&
      raw_caches(k_cache) && raw_caches(v_cache) && d % 2 == 0) {
    auto run = [&](auto tag) {
      using T = decltype(tag);
      return layers_raw<T>(x_in, cos, sin_signed, mask, lens, norms, weights, formats, counts, biases, k_cache,
                           v_cache, max_len, num_heads, num_kv_heads, eps, scale, capture, activations, qk_norms,
                           layout, windows, act_kind, softcap, experts, top_k, norm_topk, nodes);
    };
    if (dtype == at::kBFloat16) return run(c10::BFloat16{});
    if (dtype == at::kHalf) return run(c10::Half{});
    return run(float{});
  }
  at::Tensor x = x_in;
  std::vector<at::Tensor> out(1 + capture.size());
  auto linear_i = [&](int64_t i, const at::Tensor& in, const std::optional<at::Tensor>& bias) {  // linear i
    return linear(in, weights.slice(ix.seg[i], counts[i]), formats.slice(ix.seg[i], counts[i]), bias, activations);
  };
  auto next_linear = [&](int64_t l, int64_t j, const at::Tensor& in, const std::optional<at::Tensor>& bias) {
    return linear_i(ix.first[l] + j, in, bias);  // layer l's j-th (qkv, o; a dense layer's gate_up, down)
  };
  const auto gate_act = [&](const at::Tensor& gate) { return act_kind == 0 ? at::silu(gate) : at::gelu(gate, "tanh"); };
  for (int64_t l = 0; l < num_layers; ++l) {
    std::optional<at::Tensor> bias;
    if (!biases.empty()) bias = biases[l];
    const bool local = cos.dim() == 5 && !windows.empty() && windows[l] > 0;
    const at::Tensor c = cos.dim() == 5 ? cos.select(0, local ? 1 : 0) : cos;
    const at::Tensor sn = cos.dim() == 5 ? sin_signed.select(0, local ? 1 : 0) : sin_signed;
    const auto norm_at = [&](int64_t sub, bool out) { return norms[per * l + (layout == 2 ? 2 * sub + out : sub)]; };
    at::Tensor h = layout == 1 ? x : rms_norm(x, norm_at(0, false), eps);
    at::Tensor qkv = next_linear(l, 0, h, bias).view({B, n, num_heads + 2 * num_kv_heads, d});
    if (!qk_norms.empty()) {  // model.py: _qk_norm
      at::Tensor q = qkv.narrow(2, 0, num_heads).contiguous(), k = qkv.narrow(2, num_heads, num_kv_heads).contiguous();
      if (qk_norms[2 * l].numel() == d) {
        q = rms_norm(q, qk_norms[2 * l], eps);
        k = rms_norm(k, qk_norms[2 * l + 1], eps);
      } else {
        q = rms_norm(q.flatten(2), qk_norms[2 * l], eps).view(q.sizes());
        k = rms_norm(k.flatten(2), qk_norms[2 * l + 1], eps).view(k.sizes());
      }
      qkv = at::cat({q, k, qkv.narrow(2, num_heads + num_kv_heads, num_kv_heads)}, 2);
    }
    at::Tensor qk = qkv.narrow(2, 0, num_heads + num_kv_heads);
    qk = qk * c + at::roll(qk, {d / 2}, {-1}) * sn;
    const at::Tensor& kc = k_cache[l];
    const at::Tensor& vc = v_cache[l];
    const at::Tensor k_new = qk.narrow(2, num_heads, num_kv_heads).transpose(1, 2);
    const at::Tensor v_new = qkv.narrow(2, num_heads + num_kv_heads, num_kv_heads).transpose(1, 2);
    const bool flush = bf16_products(activations, kc);
    const auto put = [&](at::Tensor dst, const at::Tensor& src) {
      dst.copy_(src);
      if (flush) flush_tiny_bf16_(dst);
    };
    if (!cache_lens.has_value()) {
      put(kc.narrow(2, cache_len, n), k_new);
      put(vc.narrow(2, cache_len, n), v_new);
    } else {
      const int64_t* lp = lens.data_ptr<int64_t>();
      for (int64_t b = 0; b < B; ++b) {
        put(kc[b].narrow(1, lp[b], n), k_new[b]);
        put(vc[b].narrow(1, lp[b], n), v_new[b]);
      }
    }
    // float32 queries over a 16-bit cache (the kernel widens the cache), else q in the cache's dtype
    const bool cache16 = kc.scalar_type() == at::kHalf || kc.scalar_type() == at::kBFloat16;
    at::Tensor q = qk.narrow(2, 0, num_heads).to(cache16 ? at::kFloat : kc.scalar_type());
    at::Tensor attn = at::empty(q.sizes(), q.options());
    tree_attention_cpu(q, kc, vc, lens, mask, scale, /*include_prefix=*/true, attn, std::nullopt,
                       windows.empty() ? 0 : windows[l], softcap, flush, nullptr, /*kv_flushed=*/flush);
    at::Tensor y = next_linear(l, 1, attn.to(dtype).view({B, n, num_heads * d}), std::nullopt);
    x = x + (layout != 0 ? rms_norm(y, norm_at(0, true), eps) : y);
    h = layout == 1 ? x : rms_norm(x, norm_at(1, false), eps);
    if (!experts.empty() && experts[l] > 0) {  // model.py: Transformer._moe with _experts_index
      const int64_t f = ix.first[l], hid = h.size(-1);
      const at::Tensor flat = h.reshape({-1, hid});
      const auto [top, idx] = route(linear_i(f + 2, flat, std::nullopt), top_k, norm_topk, dtype);
      at::Tensor sum = at::zeros_like(flat);
      for (int64_t e = 0; e < experts[l]; ++e) {
        const std::vector<at::Tensor> where = at::where(idx == e);
        if (where[0].numel() == 0) continue;
        const auto parts = linear_i(f + 3 + 2 * e, flat.index({where[0]}), std::nullopt).chunk(2, -1);
        const at::Tensor ye = linear_i(f + 4 + 2 * e, gate_act(parts[0]) * parts[1], std::nullopt);
        sum.index_add_(0, where[0], (ye * top.index({where[0], where[1]}).unsqueeze(-1)).to(dtype));
      }
      y = sum.view(h.sizes());
    } else {
      auto parts = next_linear(l, 2, h, std::nullopt).chunk(2, -1);
      y = next_linear(l, 3, gate_act(parts[0]) * parts[1], std::nullopt);
    }
    x = x + (layout != 0 ? rms_norm(y, norm_at(1, true), eps) : y);
    for (size_t c = 0; c < capture.size(); ++c)
      if (capture[c] == l) out[1 + c] = x;
  }
  out[0] = x;
  if (nodes != nullptr) {  // padding rows: 0, as the raw loop leaves them (it computes only the others)
    const at::Tensor pad = at::arange(n, nodes_t.options()).unsqueeze(0) >= nodes_t.unsqueeze(1);  // [B, n]
    for (at::Tensor& t : out) t = t.masked_fill(pad.unsqueeze(-1), 0);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(turbospec, CPU, m) { m.impl("llama_layers", &llama_layers); }

}  // namespace turbospec

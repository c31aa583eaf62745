// The row-wise parts of an EAGLE head's decoder layer on CPU: eagle_input (the hidden input g and its
// q/k/v projections) and eagle_output (o_proj, the residual, the MLP). Their specification is the
// Python head (heads.eagle.EagleHead._input / _output over a drafting copy's turbospec linears): the
// same operations in the same order, so the same bits. A drafting round runs each part as one call
// instead of ~8 ATen calls from Python (~0.35 ms of a ~1.7 ms one-token proposal on a Zen 4, where
// the linears themselves took ~0.37 ms; bench/results/2026-12-02-amd-head-drafting.md). Every
// linear is turbospec::linear's kernel and every norm turbospec::rms_norm's, so a row's result does
// not depend on the other rows (lockstep.drive batches a round's requests into one call).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <vector>

#include "linear.h"
#include "rms_norm.h"

namespace turbospec {
namespace {

// Linear i's weight segments: weights[seg[i], seg[i] + counts[i]) with their formats (as for linear)
// and its activations (0 exact, 8 int8).
struct Linears {
  at::TensorList weights;
  at::IntArrayRef formats, counts, acts;
  std::vector<int64_t> seg;

  Linears(const char* op, at::TensorList w, at::IntArrayRef f, at::IntArrayRef c, at::IntArrayRef a,
          size_t n, const char* names)
      : weights(w), formats(f), counts(c), acts(a) {
    TORCH_CHECK(c.size() == n && a.size() == n, op, ": counts and activations must have ", n, " entries (", names,
                "), got ", c.size(), " and ", a.size());
    TORCH_CHECK(w.size() == f.size(), op, ": weights and formats differ in length (", w.size(), " and ", f.size(),
                ")");
    int64_t s = 0;
    for (size_t i = 0; i < n; ++i) {
      TORCH_CHECK(c[i] >= 0 && (a[i] == 0 || a[i] == 8), op, ": linear ", i, " must have >= 0 segments and "
                  "activations 0 or 8, got ", c[i], " and ", a[i]);
      seg.push_back(s);
      s += c[i];
    }
    TORCH_CHECK(s == static_cast<int64_t>(w.size()), op, ": counts add up to ", s, " segments, weights has ",
                w.size());
  }
  int64_t width(int64_t i) const {
    int64_t n = 0;
    for (int64_t k = 0; k < counts[i]; ++k) n += weights[seg[i] + k].size(0);
    return n;
  }
  // y [R, width(i)] = x [R, K] (contiguous) through linear i
  void run(int64_t i, const float* x, int64_t R, int64_t K, const float* bias, float* y) const {
    linear_f32(x, R, K, weights.slice(seg[i], counts[i]), formats.slice(seg[i], counts[i]), bias, y, acts[i]);
  }
};

void check_rows(const char* op, const at::Tensor& rows, int64_t min_width) {
  TORCH_CHECK(rows.is_cpu() && rows.scalar_type() == at::kFloat && rows.dim() == 2 && rows.size(1) > min_width, op,
              ": rows must be a float32 CPU tensor [N, W] with W > ", min_width, ", got ", rows.scalar_type(), " ",
              rows.sizes());
}

const float* norm_weight(const char* op, const char* name, const at::Tensor& w, int64_t H) {
  TORCH_CHECK(w.is_cpu() && w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == H, op, ": ", name,
              " must be a contiguous float32 CPU tensor of ", H, " elements, got ", w.scalar_type(), " ", w.sizes());
  return w.data_ptr<float>();
}

// rows [N, F + H] = (features, embedding of the next token) -> [N, H + q + k + v]: g, then q/k/v.
// mode 0 (EAGLE-1/2): g = fc(cat(embedding, features)) (+ fc_bias), q/k/v of g.
// mode 1 (EAGLE-3): g = fc(features); mode 2 (EAGLE-3 over the head's own outputs): g = features
// (F = H, fc has no segments); q/k/v of cat(rms_norm(embedding, norms[0]), rms_norm(g, norms[1])).
// Linears: [fc, qkv].
at::Tensor eagle_input(const at::Tensor& rows, at::TensorList weights, at::IntArrayRef formats,
                       at::IntArrayRef counts, at::IntArrayRef activations, const std::optional<at::Tensor>& fc_bias,
                       at::TensorList norms, int64_t H, double eps_d, int64_t mode) {
  const char* op = "eagle_input";
  TORCH_CHECK(mode >= 0 && mode <= 2, op, ": mode must be 0 (EAGLE-1/2), 1 (EAGLE-3) or 2 (EAGLE-3, fused), got ",
              mode);
  TORCH_CHECK(H > 0, op, ": hidden_size must be > 0, got ", H);
  check_rows(op, rows, H);
  const Linears lin(op, weights, formats, counts, activations, 2, "fc, qkv");
  const int64_t N = rows.size(0), W = rows.size(1), F = W - H;
  TORCH_CHECK(mode != 2 || (F == H && counts[0] == 0), op, ": mode 2 takes the head's outputs (F = H = ", H,
              ") and no fc, got F = ", F, " and ", counts[0], " fc segments");
  TORCH_CHECK(mode != 0 || F == H, op, ": an EAGLE-1/2 head's features have H = ", H, " values, got ", F);
  TORCH_CHECK(mode == 2 || lin.width(0) == H, op, ": fc must have ", H, " outputs, got ", lin.width(0));
  TORCH_CHECK(mode == 0 || norms.size() == 2, op, ": EAGLE-3 takes 2 norms (input_layernorm, hidden_norm), got ",
              norms.size());
  const float eps = static_cast<float>(eps_d);
  const at::Tensor x = rows.contiguous();
  const float* xp = x.data_ptr<float>();
  const auto fopts = rows.options();
  const int64_t nqkv = lin.width(1);
  at::Tensor g = at::empty({N, H}, fopts);
  float* gp = g.data_ptr<float>();
  std::vector<float> buf;
  if (mode == 2) {
    for (int64_t r = 0; r < N; ++r) std::copy(xp + r * W, xp + r * W + H, gp + r * H);
  } else if (mode == 1) {  // fc(features): the features' rows contiguous
    buf.resize(N * F);
    for (int64_t r = 0; r < N; ++r) std::copy(xp + r * W, xp + r * W + F, buf.data() + r * F);
    lin.run(0, buf.data(), N, F, nullptr, gp);
  } else {  // fc(cat(embedding, features)) + bias
    at::Tensor bias;
    if (fc_bias.has_value() && fc_bias->defined()) {
      TORCH_CHECK(fc_bias->numel() == H, op, ": fc_bias must have ", H, " elements, got ", fc_bias->numel());
      bias = fc_bias->to(at::kFloat).contiguous();
    }
    buf.resize(N * 2 * H);
    for (int64_t r = 0; r < N; ++r) {
      std::copy(xp + r * W + F, xp + r * W + W, buf.data() + r * 2 * H);
      std::copy(xp + r * W, xp + r * W + F, buf.data() + r * 2 * H + H);
    }
    lin.run(0, buf.data(), N, 2 * H, bias.defined() ? bias.data_ptr<float>() : nullptr, gp);
  }
  at::Tensor qkv = at::empty({N, nqkv}, fopts);
  if (mode == 0) {
    lin.run(1, gp, N, H, nullptr, qkv.data_ptr<float>());
  } else {
    std::vector<float> in(N * 2 * H);
    rms_norm_rows(xp + F, W, norm_weight(op, "norms[0]", norms[0], H), N, H, eps, in.data(), 2 * H);
    rms_norm_rows(gp, H, norm_weight(op, "norms[1]", norms[1], H), N, H, eps, in.data() + H, 2 * H);
    lin.run(1, in.data(), N, 2 * H, nullptr, qkv.data_ptr<float>());
  }
  return at::cat({g, qkv}, 1);
}

// rows [N, A + H] = (attention output, g) -> the layer's output [N, H]:
// h = g + o(attended); h + down(silu(gate) * up) of gate_up(rms_norm(h, norm)). Linears: [o, gate_up, down].
at::Tensor eagle_output(const at::Tensor& rows, at::TensorList weights, at::IntArrayRef formats,
                        at::IntArrayRef counts, at::IntArrayRef activations, const at::Tensor& norm, double eps_d) {
  const char* op = "eagle_output";
  const int64_t H = norm.numel();
  check_rows(op, rows, H);
  const Linears lin(op, weights, formats, counts, activations, 3, "o, gate_up, down");
  const int64_t N = rows.size(0), W = rows.size(1), A = W - H, I2 = lin.width(1), I = I2 / 2;
  TORCH_CHECK(lin.width(0) == H && I2 % 2 == 0 && I > 0 && lin.width(2) == H, op, ": o, gate_up and down must have ",
              H, ", 2 x I and ", H, " outputs, got ", lin.width(0), ", ", I2, " and ", lin.width(2));
  const float* nw = norm_weight(op, "norm", norm, H);
  const float eps = static_cast<float>(eps_d);
  const at::Tensor x = rows.contiguous();
  const float* xp = x.data_ptr<float>();
  const auto fopts = rows.options();
  std::vector<float> att(N * A);
  for (int64_t r = 0; r < N; ++r) std::copy(xp + r * W, xp + r * W + A, att.data() + r * A);
  at::Tensor h = at::empty({N, H}, fopts);
  float* hp = h.data_ptr<float>();
  lin.run(0, att.data(), N, A, nullptr, hp);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t k = 0; k < H; ++k) hp[r * H + k] = xp[r * W + A + k] + hp[r * H + k];  // g + o(attended)
  std::vector<float> y(N * H);
  rms_norm_rows(hp, H, nw, N, H, eps, y.data(), H);
  at::Tensor gu = at::empty({N, I2}, fopts), act = at::empty({N, I}, fopts);
  lin.run(1, y.data(), N, H, nullptr, gu.data_ptr<float>());
  at::silu_out(act, gu.narrow(1, 0, I));  // F.silu, as the Python MLP runs it: the same bits
  float* ap = act.data_ptr<float>();
  const float* up = gu.data_ptr<float>() + I;
  for (int64_t r = 0; r < N; ++r)
    for (int64_t k = 0; k < I; ++k) ap[r * I + k] = ap[r * I + k] * up[r * I2 + k];
  at::Tensor out = at::empty({N, H}, fopts);
  float* outp = out.data_ptr<float>();
  lin.run(2, ap, N, I, nullptr, outp);
  for (int64_t i = 0; i < N * H; ++i) outp[i] = hp[i] + outp[i];  // h + mlp
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(turbospec, CPU, m) {
  m.impl("eagle_input", &eagle_input);
  m.impl("eagle_output", &eagle_output);
}

}  // namespace turbospec

// RMS norm of rows in one fixed order, so that the scalar and AVX2 paths give the same bits and a
// row's result never depends on the other rows (reference.rms_norm is the specification):
//   lanes j = 0..7: a_j = sum over t = 0, 1, ... of x[8t + j]^2 (x zero-padded to a multiple of 8;
//   each step a_j + (x * x), two roundings); s = ((a_0 + a_4) + (a_2 + a_6)) + ((a_1 + a_5) + (a_3 + a_7));
//   inv = 1 / sqrt(s / K + eps) (float32); y_k = weight_k * (x_k * inv).
// float32 rows: every step in float32. bfloat16 / float16 rows (x, weight and y of that dtype): the
// same float32 sum and inv, then y_k = T(weight_k * T(x_k * inv)), the roundings of the model's
// composite norm (x.float() ... .to(T), then weight * that in T).
// One call replaces the six ATen ops of the composite F.rms_norm on a decode step's single row.
#include "rms_norm.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>

#include "../checks.h"
#include "isa.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TS_NORM_X86 1
#endif

namespace turbospec {
namespace {

inline float finish(const float* a, int64_t K, float eps) {
  const float t4[4] = {a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]};
  const float t2[2] = {t4[0] + t4[2], t4[1] + t4[3]};
  return 1.f / std::sqrt((t2[0] + t2[1]) / static_cast<float>(K) + eps);
}

float inv_scalar(const float* x, int64_t K, float eps) {
  float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t k = 0; k < K; ++k) a[k & 7] = a[k & 7] + x[k] * x[k];
  return finish(a, K, eps);
}

void row_scalar(const float* x, const float* w, int64_t K, float eps, float* y) {
  const float inv = inv_scalar(x, K, eps);
  for (int64_t k = 0; k < K; ++k) y[k] = w[k] * (x[k] * inv);
}

#ifdef TS_NORM_X86
__attribute__((target("avx2"))) float inv_avx2(const float* x, int64_t K, float eps) {
  __m256 acc = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t{7};
  for (int64_t k = 0; k < K8; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  alignas(32) float a[8];
  _mm256_store_ps(a, acc);
  for (int64_t k = K8; k < K; ++k) a[k & 7] = a[k & 7] + x[k] * x[k];
  return finish(a, K, eps);
}

__attribute__((target("avx2"))) void row_avx2(const float* x, const float* w, int64_t K, float eps, float* y) {
  const int64_t K8 = K & ~int64_t{7};
  const float inv = inv_avx2(x, K, eps);
  const __m256 iv = _mm256_set1_ps(inv);
  for (int64_t k = 0; k < K8; k += 8)
    _mm256_storeu_ps(y + k, _mm256_mul_ps(_mm256_loadu_ps(w + k), _mm256_mul_ps(_mm256_loadu_ps(x + k), iv)));
  for (int64_t k = K8; k < K; ++k) y[k] = w[k] * (x[k] * inv);
}
#endif

template <typename T>
void rows_16(const float* x, int64_t ldx, const T* w, int64_t R, int64_t K, float eps, float* y, int64_t ldy) {
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = x + r * ldx;
    float* yr = y + r * ldy;
#ifdef TS_NORM_X86
    const float inv = cpu_isa() != Isa::kScalar ? inv_avx2(xr, K, eps) : inv_scalar(xr, K, eps);
#else
    const float inv = inv_scalar(xr, K, eps);
#endif
    for (int64_t k = 0; k < K; ++k) {
      const float h = static_cast<float>(static_cast<T>(xr[k] * inv));
      yr[k] = static_cast<float>(static_cast<T>(static_cast<float>(w[k]) * h));
    }
  }
}

void rms_norm_op(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& out) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(x.is_cpu() && is_float_dtype(dt) && x.dim() >= 1,
              "rms_norm: x must be a float32 / bfloat16 / float16 tensor [..., K], got ", describe(x));
  const int64_t K = x.size(-1);
  check_tensor("rms_norm", "weight", weight, {dt}, {{"K", K}});
  TORCH_CHECK(out.scalar_type() == dt && out.sizes() == x.sizes() && out.is_contiguous(), "rms_norm: out must be a "
              "contiguous ", dtype_name(dt), " tensor of x's shape ", shape_str(x.sizes()), ", got ", describe(out));
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "rms_norm: eps must be finite and >= 0, got ", eps);
  if (dt == at::kFloat) {
    const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
    rms_norm_rows(xc.data_ptr<float>(), K, wc.data_ptr<float>(), K == 0 ? 0 : x.numel() / K, K,
                  static_cast<float>(eps), out.data_ptr<float>(), K);
    return;
  }
  out.copy_(rms_norm_float(x, weight, eps));  // exact: the values are of out's dtype
}

}  // namespace

void rms_norm_rows(const float* x, int64_t ldx, const float* weight, int64_t R, int64_t K, float eps, float* y,
                   int64_t ldy) {
#ifdef TS_NORM_X86
  if (cpu_isa() != Isa::kScalar) {
    for (int64_t r = 0; r < R; ++r) row_avx2(x + r * ldx, weight, K, eps, y + r * ldy);
    return;
  }
#endif
  for (int64_t r = 0; r < R; ++r) row_scalar(x + r * ldx, weight, K, eps, y + r * ldy);
}

void rms_norm_rows(const float* x, int64_t ldx, const c10::BFloat16* weight, int64_t R, int64_t K, float eps,
                   float* y, int64_t ldy) {
  rows_16(x, ldx, weight, R, K, eps, y, ldy);
}

void rms_norm_rows(const float* x, int64_t ldx, const c10::Half* weight, int64_t R, int64_t K, float eps, float* y,
                   int64_t ldy) {
  rows_16(x, ldx, weight, R, K, eps, y, ldy);
}

at::Tensor rms_norm_float(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor xf = x.to(at::kFloat).contiguous(), w = weight.contiguous();
  at::Tensor y = at::empty(xf.sizes(), xf.options());
  const int64_t K = x.size(-1), R = K == 0 ? 0 : x.numel() / K;
  const float e = static_cast<float>(eps);
  switch (x.scalar_type()) {
    case at::kFloat: rms_norm_rows(xf.data_ptr<float>(), K, w.data_ptr<float>(), R, K, e, y.data_ptr<float>(), K); break;
    case at::kBFloat16:
      rms_norm_rows(xf.data_ptr<float>(), K, w.data_ptr<c10::BFloat16>(), R, K, e, y.data_ptr<float>(), K);
      break;
    case at::kHalf: rms_norm_rows(xf.data_ptr<float>(), K, w.data_ptr<c10::Half>(), R, K, e, y.data_ptr<float>(), K); break;
    default: TORCH_CHECK(false, "rms_norm: x must be float32, bfloat16 or float16, got ", describe(x));
  }
  return y;
}

}  // namespace turbospec

TORCH_LIBRARY_IMPL(turbospec, CPU, m) { m.impl("rms_norm", &turbospec::rms_norm_op); }

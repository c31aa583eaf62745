// The fused decoder-layer ops on CPU: add_rms_norm, silu_mul, rope_cache (specs: reference.add_rms_norm,
// reference.silu_mul, reference.rope_cache; CUDA twins: csrc/cuda/layer_ops.cu). They exist for the
// static path on CUDA, where each replaces several ATen kernels with one; the CPU decode runs the
// llama_layers loop instead. These kernels are the CPU side of the op: plain loops that round where
// torch rounds (float32 math, each stored value rounded to the tensor's dtype).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>

#include "../checks.h"

namespace turbospec {
namespace {

// Element access for the three float dtypes: math in float32, every store rounded to the dtype.
template <typename T>
inline float ld(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}
template <typename T>
inline float rnd(float v) {
  return static_cast<float>(static_cast<T>(v));
}

template <typename T>
void add_rms_norm_rows(const T* x, const T* delta, const T* w, int64_t rows, int64_t K, float eps, T* out, T* sum) {
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * K;
      const T* src = xr;
      if (delta != nullptr) {
        T* sr = sum + r * K;
        const T* dr = delta + r * K;
        for (int64_t k = 0; k < K; ++k) sr[k] = static_cast<T>(ld(xr, k) + ld(dr, k));
        src = sr;
      }
      float ss = 0.f;
      for (int64_t k = 0; k < K; ++k) ss += ld(src, k) * ld(src, k);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(K) + eps);
      T* o = out + r * K;
      for (int64_t k = 0; k < K; ++k) o[k] = static_cast<T>(ld(w, k) * rnd<T>(ld(src, k) * inv));
    }
  });
}

void add_rms_norm_cpu(const at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& weight, double eps,
                      const at::Tensor& out, const std::optional<at::Tensor>& sum_out) {
  const RowDims d = check_add_rms_norm_args(x, delta, weight, eps, out, sum_out, c10::DeviceType::CPU);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), delta ? delta->data_ptr<scalar_t>() : nullptr,
                                weight.data_ptr<scalar_t>(), d.rows, d.K, static_cast<float>(eps),
                                out.data_ptr<scalar_t>(), sum_out ? sum_out->data_ptr<scalar_t>() : nullptr);
  });
}

void silu_mul_cpu(const at::Tensor& gate_up, const at::Tensor& out) {
  const RowDims d = check_silu_mul_args(gate_up, out, c10::DeviceType::CPU);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* gu = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t I = d.K;
    at::parallel_for(0, d.rows, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t i = 0; i < I; ++i) {
          const float g = ld(gu + r * 2 * I, i), u = ld(gu + r * 2 * I + I, i);
          o[r * I + i] = static_cast<scalar_t>(rnd<scalar_t>(g / (1.f + std::exp(-g))) * u);
        }
    });
  });
}

void rope_cache_cpu(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin_signed,
                    const at::Tensor& cache_len, int64_t num_heads, const at::Tensor& q_out, const at::Tensor& k_cache,
                    const at::Tensor& v_cache) {
  const RopeDims d = check_rope_cache_args(qkv, cos, sin_signed, cache_len, num_heads, q_out, k_cache, v_cache,
                                           c10::DeviceType::CPU);
  const int64_t heads = d.H + 2 * d.Hkv, half = d.D / 2;
  const int64_t* len = cache_len.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_cache", [&] {
    const scalar_t* in = qkv.data_ptr<scalar_t>();
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin_signed.data_ptr<scalar_t>();
    scalar_t* q = q_out.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    for (int64_t b = 0; b < d.B; ++b)
      for (int64_t j = 0; j < d.n; ++j) {
        const int64_t slot = len[b] + j;
        const bool write = len[b] >= 0 && slot < d.S;
        const scalar_t* cj = c + (b * d.n + j) * d.D;
        const scalar_t* sj = s + (b * d.n + j) * d.D;
        for (int64_t h = 0; h < heads; ++h) {
          const scalar_t* x = in + ((b * d.n + j) * heads + h) * d.D;
          scalar_t* dst;
          if (h < d.H) {
            dst = q + ((b * d.n + j) * d.H + h) * d.D;
          } else if (!write) {
            continue;
          } else {
            const bool is_k = h < d.H + d.Hkv;
            const int64_t hk = is_k ? h - d.H : h - d.H - d.Hkv;
            const at::Tensor& cache = is_k ? k_cache : v_cache;
            dst = (is_k ? kc : vc) + b * cache.stride(0) + hk * cache.stride(1) + slot * cache.stride(2);
            if (!is_k) {
              for (int64_t e = 0; e < d.D; ++e) dst[e] = x[e];
              continue;
            }
          }
          for (int64_t e = 0; e < d.D; ++e) {
            const int64_t p = e < half ? e + half : e - half;
            dst[e] = static_cast<scalar_t>(rnd<scalar_t>(ld(x, e) * ld(cj, e)) + rnd<scalar_t>(ld(x, p) * ld(sj, e)));
          }
        }
      }
  });
}

}  // namespace
}  // namespace turbospec

TORCH_LIBRARY_IMPL(turbospec, CPU, m) {
  m.impl("add_rms_norm", &turbospec::add_rms_norm_cpu);
  m.impl("silu_mul", &turbospec::silu_mul_cpu);
  m.impl("rope_cache", &turbospec::rope_cache_cpu);
}

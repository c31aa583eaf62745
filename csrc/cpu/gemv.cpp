// small_linear: y = x @ W^T (+ b) for a few rows of x (decode steps and verify passes), CPU.
//
// At batch 1 a decode step is a chain of matrix-vector products whose cost is reading W once.
// This kernel streams each weight row once for all rows of x and, unlike a BLAS call, fixes its
// reduction order: lane j (0..15) accumulates the products at k = j, j+16, j+32, ... with fused
// multiply-adds in increasing k, then the 16 lanes are summed pairwise (j + 8, then + 4, + 2, + 1),
// then the bias is added. The order does not depend on how many rows x has, on the thread split or
// on the instruction set (AVX-512, AVX2 and the scalar path give the same bits), so a verify pass
// over k+1 tokens computes, for each token, exactly what a one-token decode step computes.
//
// Weights: float32 or bfloat16 [N, K] row-major (bf16 is widened exactly to fp32); x: same dtype as W
// or float32; accumulation in fp32; the output has x's dtype (bf16 output rounded to nearest even).
#include "gemv.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TS_X86 1
#endif

namespace turbospec {
namespace {

constexpr int kLanes = 16;
constexpr int64_t kRowBlock = 4;  // weight rows per inner block
constexpr int64_t kMaxRows = 64;

inline float combine_lanes(const float* s) {
  float t8[8], t4[4], t2[2];
  for (int j = 0; j < 8; ++j) t8[j] = s[j] + s[j + 8];
  for (int j = 0; j < 4; ++j) t4[j] = t8[j] + t8[j + 4];
  for (int j = 0; j < 2; ++j) t2[j] = t4[j] + t4[j + 2];
  return t2[0] + t2[1];
}

inline float load_w(const float* w, int64_t k) { return w[k]; }
inline float load_w(const c10::BFloat16* w, int64_t k) { return static_cast<float>(w[k]); }

// Scalar path: the same lane semantics with std::fma.
template <typename W>
void block_scalar(const W* const* wr, int64_t nw, const float* const* xr, int64_t nx, int64_t K,
                  float (*out)[kMaxRows]) {
  for (int64_t i = 0; i < nw; ++i)
    for (int64_t r = 0; r < nx; ++r) {
      float acc[kLanes] = {0};
      for (int64_t k = 0; k < K; ++k) acc[k % kLanes] = std::fma(load_w(wr[i], k), xr[r][k], acc[k % kLanes]);
      out[i][r] = combine_lanes(acc);
    }
}

#ifdef TS_X86
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16_512(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16_512(const c10::BFloat16* p, __mmask16 m) {
  __m256i h = _mm256_maskz_loadu_epi16(m, reinterpret_cast<const void*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// NW weight rows x NX input rows, all of K (compile-time sizes keep the accumulators in registers).
template <int NW, int NX, typename W>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void block_avx512(const W* const* wr, const float* const* xr,
                                                                       int64_t K, float (*out)[kMaxRows],
                                                                       int64_t r0) {
  __m512 acc[NW][NX];
  for (int i = 0; i < NW; ++i)
    for (int r = 0; r < NX; ++r) acc[i][r] = _mm512_setzero_ps();
  const int64_t full = K / kLanes * kLanes;
  const __mmask16 ones = static_cast<__mmask16>(0xFFFF);
  for (int64_t k = 0; k < full; k += kLanes) {
    __m512 xv[NX];
    for (int r = 0; r < NX; ++r) xv[r] = _mm512_loadu_ps(xr[r] + k);
    for (int i = 0; i < NW; ++i) {
      // Software prefetch of the same place in the next block of rows (contiguous after this one):
      // a DRAM stream a block ahead, which the hardware prefetcher alone does not sustain here.
      _mm_prefetch(reinterpret_cast<const char*>(wr[i] + NW * K + k), _MM_HINT_T0);
      const __m512 wv = load16_512(wr[i] + k, ones);
      for (int r = 0; r < NX; ++r) acc[i][r] = _mm512_fmadd_ps(wv, xv[r], acc[i][r]);
    }
  }
  if (full < K) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - full)) - 1);
    __m512 xv[NX];
    for (int r = 0; r < NX; ++r) xv[r] = _mm512_maskz_loadu_ps(m, xr[r] + full);
    for (int i = 0; i < NW; ++i) {
      const __m512 wv = load16_512(wr[i] + full, m);
      for (int r = 0; r < NX; ++r) acc[i][r] = _mm512_fmadd_ps(wv, xv[r], acc[i][r]);
    }
  }
  alignas(64) float s[kLanes];
  for (int i = 0; i < NW; ++i)
    for (int r = 0; r < NX; ++r) {
      _mm512_store_ps(s, acc[i][r]);
      out[i][r0 + r] = combine_lanes(s);
    }
}

template <int NW, typename W>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void rows_avx512(const W* const* wr, const float* const* xr,
                                                                      int64_t R, int64_t K, float (*out)[kMaxRows]) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) block_avx512<NW, 4>(wr, xr + r, K, out, r);
  switch (R - r) {
    case 3: block_avx512<NW, 3>(wr, xr + r, K, out, r); break;
    case 2: block_avx512<NW, 2>(wr, xr + r, K, out, r); break;
    case 1: block_avx512<NW, 1>(wr, xr + r, K, out, r); break;
    default: break;
  }
}

__attribute__((target("avx2,fma"))) inline void load16_256(const float* p, int64_t left, __m256& lo, __m256& hi) {
  if (left >= kLanes) {
    lo = _mm256_loadu_ps(p);
    hi = _mm256_loadu_ps(p + 8);
    return;
  }
  alignas(32) float buf[kLanes] = {0};
  std::memcpy(buf, p, sizeof(float) * left);
  lo = _mm256_load_ps(buf);
  hi = _mm256_load_ps(buf + 8);
}
__attribute__((target("avx2,fma"))) inline void load16_256(const c10::BFloat16* p, int64_t left, __m256& lo,
                                                           __m256& hi) {
  __m128i a, b;
  if (left >= kLanes) {
    a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8));
  } else {
    alignas(32) uint16_t buf[kLanes] = {0};
    std::memcpy(buf, p, sizeof(uint16_t) * left);
    a = _mm_load_si128(reinterpret_cast<const __m128i*>(buf));
    b = _mm_load_si128(reinterpret_cast<const __m128i*>(buf + 8));
  }
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16));
  hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}

// NW weight rows x NX input rows (16 lanes as two 8-wide halves).
template <int NW, int NX, typename W>
__attribute__((target("avx2,fma"))) void block_avx2(const W* const* wr, const float* const* xr, int64_t K,
                                                    float (*out)[kMaxRows], int64_t r0) {
  __m256 lo[NW][NX], hi[NW][NX];
  for (int i = 0; i < NW; ++i)
    for (int r = 0; r < NX; ++r) lo[i][r] = hi[i][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += kLanes) {
    const int64_t left = K - k;
    __m256 xl[NX], xh[NX];
    for (int r = 0; r < NX; ++r) load16_256(xr[r] + k, left, xl[r], xh[r]);
    for (int i = 0; i < NW; ++i) {
      __m256 wl, wh;
      load16_256(wr[i] + k, left, wl, wh);
      for (int r = 0; r < NX; ++r) {
        lo[i][r] = _mm256_fmadd_ps(wl, xl[r], lo[i][r]);
        hi[i][r] = _mm256_fmadd_ps(wh, xh[r], hi[i][r]);
      }
    }
  }
  alignas(32) float s[kLanes];
  for (int i = 0; i < NW; ++i)
    for (int r = 0; r < NX; ++r) {
      _mm256_store_ps(s, lo[i][r]);
      _mm256_store_ps(s + 8, hi[i][r]);
      out[i][r0 + r] = combine_lanes(s);
    }
}

template <int NW, typename W>
__attribute__((target("avx2,fma"))) void rows_avx2(const W* const* wr, const float* const* xr, int64_t R,
                                                   int64_t K, float (*out)[kMaxRows]) {
  int64_t r = 0;
  for (; r + 2 <= R; r += 2) block_avx2<NW, 2>(wr, xr + r, K, out, r);
  if (r < R) block_avx2<NW, 1>(wr, xr + r, K, out, r);
}
#endif

enum class Isa { kScalar, kAvx2, kAvx512 };

Isa detect_isa() {
#ifdef TS_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kScalar;
}

Isa& isa_setting() {
  static Isa isa = detect_isa();
  return isa;
}

template <typename W, typename Y>
void run(const W* w, const float* x, const float* bias, Y* y, int64_t N, int64_t K, int64_t R) {
  const Isa isa = isa_setting();
  const int64_t nblocks = (N + kRowBlock - 1) / kRowBlock;
  // Enough blocks per task that the fork/join is amortised; the split never changes the result.
  const int64_t grain = std::max<int64_t>(1, nblocks / (4 * std::max(1, at::get_num_threads())));
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    float out[kRowBlock][kMaxRows];
    const float* xr[kMaxRows];
    for (int64_t r = 0; r < R; ++r) xr[r] = x + r * K;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t o0 = b * kRowBlock, nw = std::min(kRowBlock, N - o0);
      const W* wr[kRowBlock];
      for (int64_t i = 0; i < nw; ++i) wr[i] = w + (o0 + i) * K;
#ifdef TS_X86
      if (isa == Isa::kAvx512) {
        switch (nw) {
          case 4: rows_avx512<4>(wr, xr, R, K, out); break;
          case 3: rows_avx512<3>(wr, xr, R, K, out); break;
          case 2: rows_avx512<2>(wr, xr, R, K, out); break;
          default: rows_avx512<1>(wr, xr, R, K, out); break;
        }
      } else if (isa == Isa::kAvx2) {
        switch (nw) {
          case 4: rows_avx2<4>(wr, xr, R, K, out); break;
          case 3: rows_avx2<3>(wr, xr, R, K, out); break;
          case 2: rows_avx2<2>(wr, xr, R, K, out); break;
          default: rows_avx2<1>(wr, xr, R, K, out); break;
        }
      } else
#endif
      {
        float tmp[kRowBlock][kMaxRows];
        block_scalar(wr, nw, xr, R, K, tmp);
        for (int64_t i = 0; i < nw; ++i)
          for (int64_t r = 0; r < R; ++r) out[i][r] = tmp[i][r];
      }
      for (int64_t i = 0; i < nw; ++i) {
        const float bv = bias ? bias[o0 + i] : 0.0f;
        for (int64_t r = 0; r < R; ++r) {
          const float v = bias ? out[i][r] + bv : out[i][r];
          y[r * N + o0 + i] = static_cast<Y>(v);
        }
      }
    }
  });
}

}  // namespace

bool small_linear_supports(const at::Tensor& x, const at::Tensor& weight) {
  if (weight.is_mkldnn() || !weight.is_cpu() || weight.dim() != 2 || !weight.is_contiguous()) return false;
  const auto wt = weight.scalar_type();
  if (wt != at::kFloat && wt != at::kBFloat16) return false;
  const int64_t rows = x.numel() / std::max<int64_t>(1, x.size(-1));
  return rows >= 1 && rows <= kMaxRows && x.size(-1) == weight.size(1);
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_cpu() && !weight.is_mkldnn(),
              "small_linear: weight must be a dense 2-D CPU tensor, got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "small_linear: weight dtype must be float32 or bfloat16, got ", weight.scalar_type());
  TORCH_CHECK(x.size(-1) == weight.size(1), "small_linear: x has ", x.size(-1), " features, weight expects ",
              weight.size(1));
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t R = x.numel() / K;
  TORCH_CHECK(R >= 1 && R <= kMaxRows, "small_linear: x must have 1..", kMaxRows, " rows, got ", R);
  at::Tensor w = weight.contiguous();
  at::Tensor xf = x.reshape({R, K}).to(at::kFloat).contiguous();
  std::optional<at::Tensor> bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "small_linear: bias has ", bias->numel(), " elements, expected ", N);
    bf = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bf ? bf->data_ptr<float>() : nullptr;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(N);
  at::Tensor y = at::empty(shape, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    auto* yp = y.data_ptr<c10::BFloat16>();
    if (w.scalar_type() == at::kFloat)
      run(w.data_ptr<float>(), xf.data_ptr<float>(), bp, yp, N, K, R);
    else
      run(w.data_ptr<c10::BFloat16>(), xf.data_ptr<float>(), bp, yp, N, K, R);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "small_linear: x dtype must be float32 or bfloat16, got ",
                x.scalar_type());
    auto* yp = y.data_ptr<float>();
    if (w.scalar_type() == at::kFloat)
      run(w.data_ptr<float>(), xf.data_ptr<float>(), bp, yp, N, K, R);
    else
      run(w.data_ptr<c10::BFloat16>(), xf.data_ptr<float>(), bp, yp, N, K, R);
  }
  return y;
}

int64_t small_linear_set_isa(int64_t isa) {
  // 0 scalar, 1 AVX2, 2 AVX-512, -1 detect; returns the setting in force (for tests: every path
  // must give the same bits).
  const Isa best = detect_isa();
  if (isa < 0) isa_setting() = best;
  else isa_setting() = static_cast<Isa>(std::min<int64_t>(isa, static_cast<int64_t>(best)));
  return static_cast<int64_t>(isa_setting());
}

TORCH_LIBRARY_IMPL(turbospec, CPU, m) { m.impl("small_linear", &small_linear); }

}  // namespace turbospec

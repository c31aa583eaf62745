// linear with int8 activations (opt-in, `linear(..., activations=8)`): y = x @ W^T (+ b) for GGUF
// block weights, with x quantized per 32 values to int8 and integer dot products — what llama.cpp
// computes, and why it is fast: one byte multiply-add instruction covers 32 weights, where exact
// float32 activations need the weights widened to float32 first. Not the model's float32 result
// (each activation is rounded to 8 bits); still one fixed order, so a row's result never depends on
// the other rows, the thread split or the instruction set (speculative == plain, bit for bit).
//
// Specification: reference.linear_int8 (with reference.quantize_activations, reference.block_parts).
//   activations, per row and block of 32: d_x = max|x| / 127, q_x = nearbyint(x * (1 / d_x));
//   weights, per block of 32: signed integers q_w, a float32 scale per 16 (scale_w), and for Q4_1 /
//   Q4_K / Q5_K an additive term per 32 (min_w), so that the dequantized weight is scale_w*q_w + min_w;
//   lanes j = 0..7 hold the exact integer sum of q_w * q_x over weights 4j..4j+3 of a block and
//   accumulate acc_j = fma(scale_w(j) * d_x, L_j, acc_j) block by block; m = fma(min_w, d_x * sum q_x, m);
//   y = ((acc_j + acc_j+4), + 2, + 1) + m (+ bias).
// Paths: scalar (every format), AVX2 (maddubs + madd; every format), AVX-512 (the K-quant formats:
// two sub-blocks per maddubs + madd; Q4_0 / Q4_1 / Q5_0 / Q8_0: two weight rows per register, tiles
// of four weight rows). All give the same bits (the lane sums are exact integers).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gguf_blocks.h"
#include "isa.h"
#include "linear.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TS_X86 1
#define TS_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#endif

namespace turbospec {
namespace {

constexpr int64_t kRows = 4;  // weight rows per work item

// The int8 activations of one row: q [K], d and d * sum(q) per block of 32, and the eight 4-value
// lane sums of q per block (for the formats whose integers carry an offset).
struct QRow {
  const int8_t* q;
  const float* d;
  const float* s;
  const int32_t* lsum;  // [K / 32][8]
  const int32_t* bsum;  // [K / 32]: sum of q per block (the interleaved formats' offset term)
  // per 256 (the K-quant formats): q256 [K], d256 [K / 256], sums of q256 per 16 [K / 16]
  const int8_t* q256;
  const float* d256;
  const int16_t* bsum16;  // |sum of 16 int8| <= 2032
};

// One block of n activations -> int8 q[n] (nearbyint(x / d), ties to even); returns d = max|x| / 127.
inline float quantize_block(const float* x, int n, int8_t* q) {
  float amax = 0.f;
  for (int j = 0; j < n; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.f;
  const float inv = d > 0.f ? 1.f / d : 0.f;
  for (int j = 0; j < n; ++j) q[j] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[j] * inv))));
  return d;
}

inline int32_t sum_q(const int8_t* q, int n) {
  int32_t s = 0;
  for (int j = 0; j < n; ++j) s += q[j];
  return s;
}

#ifdef TS_X86
// AVX2 quantize_block: the same max (a NaN is skipped, as std::max skips it), the same products and
// round-to-nearest-even, the same clamp (a NaN product gives -127, as std::max(-127, NaN) does).
TS_AVX2 float quantize_block_avx2(const float* x, int n, int8_t* q) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 mx = _mm256_setzero_ps();
  for (int j = 0; j < n; j += 8) mx = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + j), abs_mask), mx);
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float d = _mm_cvtss_f32(m4) / 127.f;
  const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
  const __m256 hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  for (int j = 0; j < n; j += 32) {
    __m256i v[4];
    for (int t = 0; t < 4; ++t) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j + 8 * t), inv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v[t] = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
    }
    // dwords -> words -> bytes; the packs interleave 128-bit halves, the permute restores the order
    const __m256i w01 = _mm256_packs_epi32(v[0], v[1]), w23 = _mm256_packs_epi32(v[2], v[3]);
    const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + j), b);
  }
  return d;
}

// The eight 4-value sums of 32 int8 (lsum[l]: bytes 4l..4l+3); returns their total.
TS_AVX2 int32_t quad_sums_avx2(const int8_t* q, int32_t* lsum) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m256i l = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v), _mm256_set1_epi16(1));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lsum), l);
  return lsum[0] + lsum[1] + lsum[2] + lsum[3] + lsum[4] + lsum[5] + lsum[6] + lsum[7];
}
#endif

inline float quantize_block_isa(const float* x, int n, int8_t* q, Isa isa) {
#ifdef TS_X86
  if (isa != Isa::kScalar) return quantize_block_avx2(x, n, q);
#endif
  return quantize_block(x, n, q);
}

// Per 256 (the K-quant formats): q, d per 256 and the sums of q per 16.
void quantize_row_256(const float* x, int64_t K, int8_t* q, float* d, int16_t* bsum16, Isa isa) {
  for (int64_t b = 0; b < K / 256; ++b) {
    d[b] = quantize_block_isa(x + 256 * b, 256, q + 256 * b, isa);
    for (int g = 0; g < 16; ++g) bsum16[16 * b + g] = static_cast<int16_t>(sum_q(q + 256 * b + 16 * g, 16));
  }
}

// Per 32: q, d, the sum of q and d * sum(q) per block and the eight 4-value lane sums of q per block.
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s, int32_t* lsum, int32_t* bsum, Isa isa) {
  for (int64_t b = 0; b < K / 32; ++b) {
    d[b] = quantize_block_isa(x + 32 * b, 32, q + 32 * b, isa);
#ifdef TS_X86
    if (isa != Isa::kScalar) {
      bsum[b] = quad_sums_avx2(q + 32 * b, lsum + 8 * b);
      s[b] = d[b] * static_cast<float>(bsum[b]);
      continue;
    }
#endif
    bsum[b] = sum_q(q + 32 * b, 32);
    s[b] = d[b] * static_cast<float>(bsum[b]);
    for (int l = 0; l < 8; ++l) lsum[8 * b + l] = sum_q(q + 32 * b + 4 * l, 4);
  }
}

constexpr int64_t block_bytes(int64_t F) {
  return F == kQ4_0 ? 18 : F == kQ4_1 ? 20 : F == kQ5_0 ? 22 : F == kQ8_0 ? 34 : F == kQ4_K ? 144 : F == kQ5_K ? 176 : 210;
}
constexpr bool has_min(int64_t F) { return F == kQ4_1 || F == kQ4_K || F == kQ5_K; }
constexpr bool is_k(int64_t F) { return F == kQ4_K || F == kQ5_K || F == kQ6_K; }

// Block b (32 weights) of a row: signed integers w[32], scale per 16 (sc[2]), additive term (mn).
template <int64_t F>
inline void block_ints(const uint8_t* row, int64_t b, int* w, float* sc, float* mn) {
  *mn = 0.f;
  if constexpr (!is_k(F)) {
    const uint8_t* p = row + b * block_bytes(F);
    sc[0] = sc[1] = half_at(p);
    if constexpr (F == kQ8_0) {
      for (int e = 0; e < 32; ++e) w[e] = static_cast<int8_t>(p[2 + e]);
    } else {
      const uint8_t* qs = p + (F == kQ4_0 ? 2 : F == kQ4_1 ? 4 : 6);
      uint32_t qh = 0;
      if constexpr (F == kQ5_0) std::memcpy(&qh, p + 2, 4);
      for (int e = 0; e < 32; ++e) {
        int q = e < 16 ? (qs[e] & 15) : (qs[e - 16] >> 4);
        if constexpr (F == kQ5_0) q = (q | (((qh >> e) & 1) << 4)) - 16;
        if constexpr (F == kQ4_0) q -= 8;
        w[e] = q;
      }
      if constexpr (F == kQ4_1) *mn = half_at(p + 2);
    }
  } else if constexpr (F == kQ4_K || F == kQ5_K) {
    const uint8_t* p = row + (b >> 3) * block_bytes(F);
    const int j = static_cast<int>(b & 7);
    int s, m;
    scale_min_k4(p + 4, j, &s, &m);
    sc[0] = sc[1] = half_at(p) * static_cast<float>(s);
    *mn = -(half_at(p + 2) * static_cast<float>(m));
    const uint8_t* qs = p + (F == kQ4_K ? 16 : 48) + 32 * (j >> 1);
    for (int e = 0; e < 32; ++e) {
      int q = (j & 1) ? (qs[e] >> 4) : (qs[e] & 15);
      if constexpr (F == kQ5_K) q |= ((p[16 + e] >> j) & 1) << 4;
      w[e] = q;
    }
  } else {  // Q6_K
    const uint8_t* p = row + (b >> 3) * 210;
    const int e0 = static_cast<int>(b & 7) * 32, half = e0 >> 7, c = (e0 & 127) >> 5;
    const float d = half_at(p + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
    sc[0] = d * static_cast<float>(scales[e0 >> 4]);
    sc[1] = d * static_cast<float>(scales[(e0 >> 4) + 1]);
    const uint8_t* ql = p + 64 * half + 32 * (c & 1);
    const uint8_t* qh = p + 128 + 32 * half;
    for (int e = 0; e < 32; ++e) {
      const int lo = (c >> 1) ? (ql[e] >> 4) : (ql[e] & 15);
      w[e] = (lo | (((qh[e] >> (2 * c)) & 3) << 4)) - 32;
    }
  }
}

inline float combine8(const float* a) {
  float t4[4], t2[2];
  for (int j = 0; j < 4; ++j) t4[j] = a[j] + a[j + 4];
  for (int j = 0; j < 2; ++j) t2[j] = t4[j] + t4[j + 2];
  return t2[0] + t2[1];
}

template <int64_t F>
void rows_scalar(const uint8_t* const* wr, int64_t nw, const QRow* xr, int64_t R, int64_t K, float* out,
                 int64_t ldo) {
  int w[32];
  float sc[2], mn;
  for (int64_t i = 0; i < nw; ++i)
    for (int64_t r = 0; r < R; ++r) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, m = 0.f;
      for (int64_t b = 0; b < K / 32; ++b) {
        block_ints<F>(wr[i], b, w, sc, &mn);
        const int8_t* q = xr[r].q + 32 * b;
        for (int l = 0; l < 8; ++l) {
          int32_t L = 0;
          for (int e = 4 * l; e < 4 * l + 4; ++e) L += w[e] * q[e];
          acc[l] = std::fma(sc[l >> 2] * xr[r].d[b], static_cast<float>(L), acc[l]);
        }
        if constexpr (has_min(F)) m = std::fma(mn, xr[r].s[b], m);
      }
      float y = combine8(acc);
      if constexpr (has_min(F)) y = y + m;
      out[r * ldo + i] = y;
    }
}

// K-quant super-block s of a row: unsigned values u[256], integer scale per 32 (Q4_K / Q5_K) or per
// 16 (Q6_K) in sc[16] (per 32: sc[2l] == sc[2l + 1]), and the min term's integer weights per 16
// (mn16, Q4_K / Q5_K: min per 32 on both halves; Q6_K: the scale, times the -32 offset); d_w, neg
// factor (-dmin_w for Q4_K / Q5_K, -32 d_w for Q6_K, both before the d_x product).
template <int64_t F>
inline void superblock_ints(const uint8_t* row, int64_t s, uint8_t* u, int* sc, int* mn16, float* d, float* neg) {
  const uint8_t* p = row + s * block_bytes(F);
  if constexpr (F == kQ4_K || F == kQ5_K) {
    *d = half_at(p);
    *neg = -half_at(p + 2);
    for (int l = 0; l < 8; ++l) {
      int a, m;
      scale_min_k4(p + 4, l, &a, &m);
      sc[2 * l] = sc[2 * l + 1] = a;
      mn16[2 * l] = mn16[2 * l + 1] = m;
      const uint8_t* qs = p + (F == kQ4_K ? 16 : 48) + 32 * (l >> 1);
      for (int e = 0; e < 32; ++e) {
        int q = (l & 1) ? (qs[e] >> 4) : (qs[e] & 15);
        if constexpr (F == kQ5_K) q |= ((p[16 + e] >> l) & 1) << 4;
        u[32 * l + e] = static_cast<uint8_t>(q);
      }
    }
  } else {
    *d = half_at(p + 208);
    *neg = 0.f;  // (-32 * (d_w * d_x): formed after the product)
    for (int g = 0; g < 16; ++g) sc[g] = mn16[g] = reinterpret_cast<const int8_t*>(p + 192)[g];
    for (int l = 0; l < 8; ++l) {
      const int half = l >> 2, c = l & 3;
      const uint8_t* ql = p + 64 * half + 32 * (c & 1);
      const uint8_t* qh = p + 128 + 32 * half;
      for (int e = 0; e < 32; ++e)
        u[32 * l + e] = static_cast<uint8_t>(((c >> 1) ? (ql[e] >> 4) : (ql[e] & 15)) | (((qh[e] >> (2 * c)) & 3) << 4));
    }
  }
}

// The min term's integer: sum over the super-block of (min per 32, Q4_K / Q5_K; scale per 16, Q6_K)
// times the sum of q_x under it.
template <int64_t F>
inline int32_t min_sum(const int* mn16, const int16_t* bsum16) {
  int32_t M = 0;
  if constexpr (F == kQ6_K) {
    for (int g = 0; g < 16; ++g) M += mn16[g] * bsum16[g];
  } else {
    for (int l = 0; l < 8; ++l) M += mn16[2 * l] * (bsum16[2 * l] + bsum16[2 * l + 1]);
  }
  return M;
}

// The per-super-block float factors: lane factor d_w * d_x and the min term's factor.
template <int64_t F>
inline void k_factors(float d, float neg, float dx, float* ddx, float* nm) {
  *ddx = d * dx;
  if constexpr (F == kQ6_K) *nm = -(32.f * *ddx);
  else *nm = neg * dx;  // -(dmin * dx): negation is exact, so == -(dmin * dx)
}

template <int64_t F>
void rows_k_scalar(const uint8_t* const* wr, int64_t nw, const QRow* xr, int64_t R, int64_t K, float* out,
                   int64_t ldo) {
  uint8_t u[256];
  int sc[16], mn16[16];
  float d, neg;
  for (int64_t i = 0; i < nw; ++i)
    for (int64_t r = 0; r < R; ++r) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, m = 0.f;
      for (int64_t s = 0; s < K / 256; ++s) {
        superblock_ints<F>(wr[i], s, u, sc, mn16, &d, &neg);
        const int8_t* q = xr[r].q256 + 256 * s;
        int32_t L[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int l = 0; l < 8; ++l)
          for (int j = 0; j < 8; ++j) {
            int32_t t = 0;
            for (int e = 32 * l + 4 * j; e < 32 * l + 4 * j + 4; ++e) t += u[e] * q[e];
            L[j] += sc[2 * l + (j >> 2)] * t;
          }
        const int32_t M = min_sum<F>(mn16, xr[r].bsum16 + 16 * s);
        float ddx, nm;
        k_factors<F>(d, neg, xr[r].d256[s], &ddx, &nm);
        for (int j = 0; j < 8; ++j) acc[j] = std::fma(ddx, static_cast<float>(L[j]), acc[j]);
        m = std::fma(nm, static_cast<float>(M), m);
      }
      out[r * ldo + i] = combine8(acc) + m;
    }
}

#ifdef TS_X86
// One block of weights as 32 bytes in weight order: unsigned values u (0..31) with an integer
// offset subtracted afterwards (q_w = u - off), or for Q8_0 the signed bytes themselves (the
// 32-weight formats; the K-quant formats decode whole super-blocks in tile_k_avx2).
TS_AVX2 __attribute__((always_inline)) inline float f16c(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);  // the same value as half_at(p), in one instruction
}

template <int64_t F>
TS_AVX2 __attribute__((always_inline)) inline __m256i block_bytes_avx2(const uint8_t* row, int64_t b, __m128* sc,
                                                                       float* mn) {
  const __m128i m4 = _mm_set1_epi8(0x0F);
  if constexpr (!is_k(F)) {
    const uint8_t* p = row + b * block_bytes(F);
    *sc = _mm_set1_ps(f16c(p));
    if constexpr (F == kQ8_0) {
      return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
    } else {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (F == kQ4_0 ? 2 : F == kQ4_1 ? 4 : 6)));
      __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
      if constexpr (F == kQ5_0) {  // bit e of qh -> 0x10 in byte e
        uint32_t qh;
        std::memcpy(&qh, p + 2, 4);
        const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                                                3, 3, 3, 3, 3, 3, 3, 3);
        const __m256i sel = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
        const __m256i bits = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)), spread);
        u = _mm256_or_si256(u, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bits, sel), sel),
                                                _mm256_set1_epi8(0x10)));
      }
      if constexpr (F == kQ4_1) *mn = f16c(p + 2);
      return u;
    }
  } else {
    static_assert(!is_k(F), "K-quant formats run in tile_k_avx2");
    return _mm256_setzero_si256();
  }
}

template <int64_t F>
constexpr int offset_shift() {  // q_w = u - (1 << shift); 0: no offset
  return F == kQ4_0 ? 3 : F == kQ5_0 ? 4 : F == kQ6_K ? 5 : 0;
}

// Exact integer lane sums: lane l = sum over bytes 4l..4l+3 of q_w * q_x.
template <int64_t F>
TS_AVX2 __attribute__((always_inline)) inline __m256i lane_sums(__m256i u, __m256i qx, const int32_t* lsum) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (F == kQ8_0) {  // signed x signed: |w| times x with w's sign
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(u, u), _mm256_sign_epi8(qx, u)), ones);
  } else {
    __m256i L = _mm256_madd_epi16(_mm256_maddubs_epi16(u, qx), ones);
    if constexpr (offset_shift<F>() > 0)
      L = _mm256_sub_epi32(L, _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lsum)),
                                                offset_shift<F>()));
    return L;
  }
}

// ((acc_j + acc_j+4), + 2, + 1)
TS_AVX2 __attribute__((always_inline)) inline float combine8_avx2(__m256 acc) {
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2)));
}

// NW weight rows x NX input rows, all blocks.
template <int64_t F, int NW, int NX>
TS_AVX2 void tile_avx2(const uint8_t* const* wr, int64_t row_bytes, const QRow* xr, int64_t K, float* out,
                       int64_t ldo) {
  // Prefetch the same place one work item (kRows rows) ahead: rows are contiguous, and the hardware
  // prefetcher alone does not keep NW streams fed from DRAM. The hint is the CPU's (isa.h): on the
  // AMD machine of bench/RESULTS.md non-temporal decodes 13-23 % faster than T0, on the Intel one ~12 %
  // slower.
  // per_block: bytes per 32 weights (a constant: a division per call is ~8 % of a short pass)
  const int64_t ahead = kRows * row_bytes;
  constexpr int64_t per_block = block_bytes(F) * 32 / (is_k(F) ? 256 : 32);
  const bool nta = prefetch_nta();
  __m256 acc[NW][NX];
  float m[NW][NX];
  for (int i = 0; i < NW; ++i)
    for (int r = 0; r < NX; ++r) {
      acc[i][r] = _mm256_setzero_ps();
      m[i][r] = 0.f;
    }
  for (int64_t b = 0; b < K / 32; ++b) {
    __m256i qx[NX];
    for (int r = 0; r < NX; ++r) qx[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[r].q + 32 * b));
    for (int i = 0; i < NW; ++i) {
      if ((b & 1) == 0) prefetch_weights(wr[i] + ahead + b * per_block, nta);
      __m128 sc;
      float mn = 0.f;
      const __m256i u = block_bytes_avx2<F>(wr[i], b, &sc, &mn);
      for (int r = 0; r < NX; ++r) {
        const __m256i L = lane_sums<F>(u, qx[r], xr[r].lsum + 8 * b);
        const __m128 s4 = _mm_mul_ps(sc, _mm_set1_ps(xr[r].d[b]));  // scale_w * d_x, per 16 weights
        const __m256 s = _mm256_set_m128(s4, s4);
        acc[i][r] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(L), acc[i][r]);
        if constexpr (has_min(F)) m[i][r] = std::fma(mn, xr[r].s[b], m[i][r]);
      }
    }
  }
  for (int i = 0; i < NW; ++i)
    for (int r = 0; r < NX; ++r) {
      float y = combine8_avx2(acc[i][r]);
      if constexpr (has_min(F)) y = y + m[i][r];
      out[r * ldo + i] = y;
    }
}

// K-quant formats: NW weight rows x NX input rows; per super-block the integer lanes are summed over
// the 8 sub-blocks (scales folded in by madd), then one float FMA per lane. The 6-bit scales and mins
// are unpacked with word operations and broadcast by byte shuffles, and the min term's integer is one
// madd against the activations' sums per 16: the same integers as rows_k_scalar, with no per-sub-block
// scalar work.
TS_AVX2 __attribute__((always_inline)) inline int32_t hsum_epi32(__m256i v) {
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  t = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x55));
  return _mm_cvtsi128_si32(t);
}

// Byte-shuffle patterns over 8 int16 broadcast to both halves: pick_word(a, b) fills the low half
// with word a and the high half with word b.
TS_AVX2 __attribute__((always_inline)) inline __m256i pick_words(int a, int b) {
  const __m128i lo = _mm_set1_epi16(static_cast<short>((2 * a) | ((2 * a + 1) << 8)));
  const __m128i hi = _mm_set1_epi16(static_cast<short>((2 * b) | ((2 * b + 1) << 8)));
  return _mm256_set_m128i(hi, lo);
}

// Q4_K / Q5_K super-block header at p: d_w, -dmin_w, the min term's 16 int16 weights (min per 32
// on both halves of each 32) and the eight 6-bit scales (byte l: sub-block l).
TS_AVX2 __attribute__((always_inline)) inline uint64_t kquant_header(const uint8_t* p, float* d, float* neg,
                                                                    __m256i* mins) {
  const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u32(p))));
  *d = _mm_cvtss_f32(dm);
  *neg = -_mm_cvtss_f32(_mm_movehdup_ps(dm));
  uint64_t sc8, mn8;
  scale_min_k4_all(p + 4, &sc8, &mn8);
  const __m128i mnb = _mm_cvtsi64_si128(static_cast<long long>(mn8));
  *mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mnb, mnb));
  return sc8;
}

// The end of a super-block for one input row: lanes L (exact integers) scaled into acc, the min term
// into m (the order of rows_k_scalar).
template <int64_t F>
TS_AVX2 __attribute__((always_inline)) inline void kquant_accumulate(float d, float neg, __m256i mins, __m256i L,
                                                                     const QRow& x, int64_t s, __m256& acc, float& m) {
  float ddx, nm;
  k_factors<F>(d, neg, x.d256[s], &ddx, &nm);
  const int32_t M = hsum_epi32(_mm256_madd_epi16(mins, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.bsum16 + 16 * s))));
  acc = _mm256_fmadd_ps(_mm256_set1_ps(ddx), _mm256_cvtepi32_ps(L), acc);
  m = std::fma(nm, static_cast<float>(M), m);
}

template <int64_t F, int NW, int NX>
TS_AVX2 void tile_k_avx2(const uint8_t* const* wr, int64_t row_bytes, const QRow* xr, int64_t K, float* out,
                         int64_t ldo) {
  constexpr int64_t bytes = block_bytes(F);
  const int64_t ahead = kRows * row_bytes;
  const bool nta = prefetch_nta();
  __m256 acc[NW][NX];
  float m[NW][NX];
  for (int i = 0; i < NW; ++i)
    for (int r = 0; r < NX; ++r) {
      acc[i][r] = _mm256_setzero_ps();
      m[i][r] = 0.f;
    }
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m256i pick[8];  // Q4_K / Q5_K: sub-block l's scale in every word; Q6_K: scales 2l', 2l'+1 (l' = l % 4)
  for (int l = 0; l < 8; ++l) pick[l] = F == kQ6_K ? pick_words(2 * (l & 3), 2 * (l & 3) + 1) : pick_words(l, l);
  for (int64_t s = 0; s < K / 256; ++s) {
    for (int i = 0; i < NW; ++i) {
      const uint8_t* p = wr[i] + s * bytes;
      for (int64_t c = 0; c < bytes; c += 64)
        prefetch_weights(p + ahead + c, nta);
      float d, neg = 0.f;
      __m256i mins;  // the min term's 16 int16 weights (per 16 activations)
      __m256i L[NX];
      for (int r = 0; r < NX; ++r) L[r] = _mm256_setzero_si256();
      if constexpr (F == kQ4_K || F == kQ5_K) {
        const uint64_t sc8 = kquant_header(p, &d, &neg, &mins);
        const __m256i scw = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(sc8))));
        const uint8_t* qs = p + (F == kQ4_K ? 16 : 48);
        __m256i h = _mm256_setzero_si256();
        if constexpr (F == kQ5_K) h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
        const __m256i bit5 = _mm256_set1_epi8(0x10);
        for (int pp = 0; pp < 4; ++pp) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * pp));
          __m256i u[2] = {_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4)};
          if constexpr (F == kQ5_K) {  // bit l of qh[e] -> bit 4 of byte e
            for (int t = 0; t < 2; ++t) {
              const int l = 2 * pp + t;
              const __m256i hb = l <= 4 ? _mm256_slli_epi16(h, 4 - l) : _mm256_srli_epi16(h, l - 4);
              u[t] = _mm256_or_si256(u[t], _mm256_and_si256(hb, bit5));
            }
          }
          for (int t = 0; t < 2; ++t) {
            const int l = 2 * pp + t;
            const __m256i scv = _mm256_shuffle_epi8(scw, pick[l]);
            for (int r = 0; r < NX; ++r) {
              const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[r].q256 + 256 * s + 32 * l));
              L[r] = _mm256_add_epi32(L[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u[t], qx), scv));
            }
          }
        }
      } else {  // Q6_K
        d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(load_u16(p + 208))));
        const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192));
        mins = _mm256_cvtepi8_epi16(s8);  // scale per 16 (times the -32 offset, in the factor)
        const __m256i scw[2] = {_mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(s8)),
                                _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128(s8, 8)))};
        for (int half = 0; half < 2; ++half) {
          const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * half));
          const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * half + 32));
          const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * half));
          for (int c = 0; c < 4; ++c) {
            const int l = 4 * half + c;
            const __m256i ql = (c & 1) ? ql1 : ql0;
            const __m256i lo = _mm256_and_si256((c >> 1) ? _mm256_srli_epi16(ql, 4) : ql, m4);
            // bits 2c, 2c+1 of qh -> bits 4, 5
            const __m256i hb = c <= 1 ? _mm256_slli_epi16(qh, 4 - 2 * c) : _mm256_srli_epi16(qh, 2 * c - 4);
            const __m256i u = _mm256_or_si256(lo, _mm256_and_si256(hb, _mm256_set1_epi8(0x30)));
            const __m256i scv = _mm256_shuffle_epi8(scw[half], pick[l]);
            for (int r = 0; r < NX; ++r) {
              const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[r].q256 + 256 * s + 32 * l));
              L[r] = _mm256_add_epi32(L[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, qx), scv));
            }
          }
        }
      }
      for (int r = 0; r < NX; ++r) kquant_accumulate<F>(d, neg, mins, L[r], xr[r], s, acc[i][r], m[i][r]);
    }
  }
  for (int i = 0; i < NW; ++i)
    for (int r = 0; r < NX; ++r) out[r * ldo + i] = combine8_avx2(acc[i][r]) + m[i][r];
}

// Word index patterns for vpermw: words a (low 256 bits) and b (high), or a .. a + 3 by 128-bit lane.
TS_AVX512 __attribute__((always_inline)) inline __m512i words_by_half(int a, int b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(static_cast<short>(a))),
                            _mm256_set1_epi16(static_cast<short>(b)), 1);
}
TS_AVX512 __attribute__((always_inline)) inline __m512i words_by_lane(int a) {
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_set_m128i(_mm_set1_epi16(static_cast<short>(a + 1)), _mm_set1_epi16(static_cast<short>(a)))),
      _mm256_set_m128i(_mm_set1_epi16(static_cast<short>(a + 3)), _mm_set1_epi16(static_cast<short>(a + 2))), 1);
}

// AVX-512, K-quant formats: tile_k_avx2 with 64 bytes per instruction. Two sub-blocks whose
// activations are adjacent (Q4_K / Q5_K: the low and high nibbles of the same 32 bytes; Q6_K: two
// quarters of a half) share a register, each sub-block's scale in its 256-bit half; the two halves'
// integer lanes are added at the end of the super-block, giving tile_k_avx2's exact integers.
template <int64_t F, int NW, int NX>
TS_AVX512 void tile_k512(const uint8_t* const* wr, int64_t row_bytes, const QRow* xr, int64_t K, float* out,
                         int64_t ldo) {
  constexpr int64_t bytes = block_bytes(F);
  const int64_t ahead = kRows * row_bytes;
  const bool nta = prefetch_nta();
  __m256 acc[NW][NX];
  float m[NW][NX];
  for (int i = 0; i < NW; ++i)
    for (int r = 0; r < NX; ++r) {
      acc[i][r] = _mm256_setzero_ps();
      m[i][r] = 0.f;
    }
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int64_t s = 0; s < K / 256; ++s) {
    for (int i = 0; i < NW; ++i) {
      const uint8_t* p = wr[i] + s * bytes;
      for (int64_t c = 0; c < bytes; c += 64) prefetch_weights(p + ahead + c, nta);
      float d, neg = 0.f;
      __m256i mins;  // the min term's 16 int16 weights (per 16 activations)
      __m512i L[NX];
      for (int r = 0; r < NX; ++r) L[r] = _mm512_setzero_si512();
      if constexpr (F == kQ4_K || F == kQ5_K) {
        const uint64_t sc8 = kquant_header(p, &d, &neg, &mins);
        const __m512i scw = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(sc8))));
        const uint8_t* qs = p + (F == kQ4_K ? 16 : 48);
        // low nibbles (sub-block 2pp) in the low half, high nibbles (2pp + 1) in the high half
        const __m512i nib = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
        __m512i h = _mm512_setzero_si512();
        if constexpr (F == kQ5_K) h = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)));
        for (int pp = 0; pp < 4; ++pp) {
          const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * pp)));
          __m512i u = _mm512_and_si512(_mm512_srlv_epi64(v, nib), m4);
          if constexpr (F == kQ5_K) {  // bit l of qh[e] -> bit 4 of byte e (l = 2pp, 2pp + 1 by half)
            const __m512i sh = _mm512_setr_epi64(2 * pp, 2 * pp, 2 * pp, 2 * pp, 2 * pp + 1, 2 * pp + 1, 2 * pp + 1, 2 * pp + 1);
            u = _mm512_or_si512(u, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi64(h, sh), _mm512_set1_epi8(1)), 4));
          }
          const __m512i scv = _mm512_permutexvar_epi16(words_by_half(2 * pp, 2 * pp + 1), scw);
          for (int r = 0; r < NX; ++r) {
            const __m512i qx = _mm512_loadu_si512(xr[r].q256 + 256 * s + 64 * pp);
            L[r] = _mm512_add_epi32(L[r], _mm512_madd_epi16(_mm512_maddubs_epi16(u, qx), scv));
          }
        }
      } else {  // Q6_K
        d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(load_u16(p + 208))));
        const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192));
        mins = _mm256_cvtepi8_epi16(s8);  // scale per 16 (times the -32 offset, in the factor)
        const __m512i scw = _mm512_castsi256_si512(mins);
        const __m512i m30 = _mm512_set1_epi8(0x30);
        // qh bits 2c, 2c + 1 -> bits 4, 5: quarters 0 / 1 (low / high half of A), 2 / 3 (of B)
        const __m512i shl_a = _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2), shr_b = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);
        for (int half = 0; half < 2; ++half) {
          const __m512i ql = _mm512_loadu_si512(p + 64 * half);
          const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * half)));
          const __m512i u[2] = {
              _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_and_si512(_mm512_sllv_epi64(qh, shl_a), m30)),
              _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4), _mm512_and_si512(_mm512_srlv_epi64(qh, shr_b), m30))};
          for (int t = 0; t < 2; ++t) {  // weights 128 half + 64 t .. + 63: scales 8 half + 4 t .. + 3
            const __m512i scv = _mm512_permutexvar_epi16(words_by_lane(8 * half + 4 * t), scw);
            for (int r = 0; r < NX; ++r) {
              const __m512i qx = _mm512_loadu_si512(xr[r].q256 + 256 * s + 128 * half + 64 * t);
              L[r] = _mm512_add_epi32(L[r], _mm512_madd_epi16(_mm512_maddubs_epi16(u[t], qx), scv));
            }
          }
        }
      }
      for (int r = 0; r < NX; ++r)  // the two halves' lanes: tile_k_avx2's integers
        kquant_accumulate<F>(d, neg, mins, _mm256_add_epi32(_mm512_castsi512_si256(L[r]), _mm512_extracti64x4_epi64(L[r], 1)),
                             xr[r], s, acc[i][r], m[i][r]);
    }
  }
  for (int i = 0; i < NW; ++i)
    for (int r = 0; r < NX; ++r) out[r * ldo + i] = combine8_avx2(acc[i][r]) + m[i][r];
}

// AVX-512, Q4_0 / Q4_1 / Q5_0 / Q8_0: four weight rows x NX (1..4) input rows. A register holds two
// weight rows' lane sums: lanes 0..7 row 2p, lanes 8..15 row 2p + 1, each lane the exact integer of
// tile_avx2 (maddubs + madd on 64 bytes: both rows' blocks against x's block in both halves), then
// the same fma(scale_w * d_x, L, acc) per lane and block, so the same bits; Q4_1's min terms run as
// 16 lanes (weight row x input row) of the same scalar fma sequence.
template <int64_t F>
TS_AVX512 __attribute__((always_inline)) inline __m512i pair_bytes512(const uint8_t* p0, const uint8_t* p1) {
  if constexpr (F == kQ8_0) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0 + 2))),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1 + 2)), 1);
  } else {
    constexpr int off = F == kQ4_0 ? 2 : F == kQ4_1 ? 4 : 6;
    // 128-bit lanes: row 0's 16 bytes twice, row 1's twice; even lanes take the low nibbles (weights
    // 0..15), odd lanes the high ones (16..31)
    const __m512i v = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0 + off)))),
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p1 + off))), 1);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i u = _mm512_mask_blend_epi64(0xCC, _mm512_and_si512(v, m4), _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
    if constexpr (F == kQ5_0) {  // bit e of qh: 0x10 in byte e of the row's 32
      const uint64_t qh = static_cast<uint64_t>(load_u32(p0 + 2)) | (static_cast<uint64_t>(load_u32(p1 + 2)) << 32);
      u = _mm512_or_si512(u, _mm512_maskz_mov_epi8(static_cast<__mmask64>(qh), _mm512_set1_epi8(0x10)));
    }
    return u;
  }
}

template <int64_t F, int NX>
TS_AVX512 void tile_q512(const uint8_t* const* wr, int64_t row_bytes, const QRow* xr, int64_t K, float* out,
                         int64_t ldo) {
  static_assert(!is_k(F) && NX >= 1 && NX <= 4, "tile_q512: Q4_0 / Q4_1 / Q5_0 / Q8_0, 1..4 input rows");
  const int64_t ahead = kRows * row_bytes;
  constexpr int64_t per_block = block_bytes(F);
  const bool nta = prefetch_nta();
  const __m512i ones = _mm512_set1_epi16(1);
  const __m512 z = _mm512_setzero_ps();
  __m512 a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z;
  __m512 mins = z;  // lane 4 i + r: Q4_1's min term of weight row i, input row r
  const __m512i by_row = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i by_input = _mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* p[4];
    for (int i = 0; i < 4; ++i) {
      p[i] = wr[i] + b * per_block;
      if ((b & 1) == 0) prefetch_weights(wr[i] + ahead + b * per_block, nta);
    }
    const __m512i u0 = pair_bytes512<F>(p[0], p[1]), u1 = pair_bytes512<F>(p[2], p[3]);
    // scale_w per row: lanes 0..7 row 2p, 8..15 row 2p + 1
    const __m512 sw0 = _mm512_insertf32x8(_mm512_set1_ps(f16c(p[0])), _mm256_set1_ps(f16c(p[1])), 1);
    const __m512 sw1 = _mm512_insertf32x8(_mm512_set1_ps(f16c(p[2])), _mm256_set1_ps(f16c(p[3])), 1);
    __m512i a0 = u0, a1 = u1;  // Q8_0: |w| against x with w's sign (maddubs takes unsigned x signed)
    if constexpr (F == kQ8_0) a0 = _mm512_abs_epi8(u0), a1 = _mm512_abs_epi8(u1);
#define TS_INPUT(r)                                                                                        \
  if constexpr (NX > r) {                                                                                  \
    const QRow& x = xr[r];                                                                                 \
    const __m512i qx = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + 32 * b))); \
    __m512i q0 = qx, q1 = qx;                                                                              \
    if constexpr (F == kQ8_0) {                                                                            \
      q0 = _mm512_mask_sub_epi8(qx, _mm512_movepi8_mask(u0), _mm512_setzero_si512(), qx);                 \
      q1 = _mm512_mask_sub_epi8(qx, _mm512_movepi8_mask(u1), _mm512_setzero_si512(), qx);                 \
    }                                                                                                      \
    __m512i L0 = _mm512_madd_epi16(_mm512_maddubs_epi16(a0, q0), ones);                                    \
    __m512i L1 = _mm512_madd_epi16(_mm512_maddubs_epi16(a1, q1), ones);                                    \
    if constexpr (offset_shift<F>() > 0) {                                                                 \
      const __m512i ls = _mm512_slli_epi32(_mm512_broadcast_i64x4(                                         \
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.lsum + 8 * b))), offset_shift<F>());      \
      L0 = _mm512_sub_epi32(L0, ls), L1 = _mm512_sub_epi32(L1, ls);                                        \
    }                                                                                                      \
    const __m512 dx = _mm512_set1_ps(x.d[b]);                                                              \
    a0##r = _mm512_fmadd_ps(_mm512_mul_ps(sw0, dx), _mm512_cvtepi32_ps(L0), a0##r);                        \
    a1##r = _mm512_fmadd_ps(_mm512_mul_ps(sw1, dx), _mm512_cvtepi32_ps(L1), a1##r);                        \
  }
    TS_INPUT(0) TS_INPUT(1) TS_INPUT(2) TS_INPUT(3)
#undef TS_INPUT
    if constexpr (has_min(F)) {
      const __m128 mn4 = _mm_setr_ps(f16c(p[0] + 2), f16c(p[1] + 2), f16c(p[2] + 2), f16c(p[3] + 2));
      const __m128 sx4 = _mm_setr_ps(xr[0].s[b], NX > 1 ? xr[1].s[b] : 0.f, NX > 2 ? xr[2].s[b] : 0.f,
                                     NX > 3 ? xr[3].s[b] : 0.f);
      mins = _mm512_fmadd_ps(_mm512_permutexvar_ps(by_row, _mm512_castps128_ps512(mn4)),
                             _mm512_permutexvar_ps(by_input, _mm512_castps128_ps512(sx4)), mins);
    }
  }
  alignas(64) float m[16];
  _mm512_store_ps(m, mins);
#define TS_OUT(r)                                                                                          \
  if constexpr (NX > r) {                                                                                  \
    const __m512 acc[2] = {a0##r, a1##r};                                                                  \
    for (int i = 0; i < 4; ++i) {                                                                          \
      const __m256 h = (i & 1) ? _mm512_extractf32x8_ps(acc[i >> 1], 1) : _mm512_castps512_ps256(acc[i >> 1]); \
      float y = combine8_avx2(h);                                                                          \
      if constexpr (has_min(F)) y = y + m[4 * i + r];                                                      \
      out[r * ldo + i] = y;                                                                                \
    }                                                                                                      \
  }
  TS_OUT(0) TS_OUT(1) TS_OUT(2) TS_OUT(3)
#undef TS_OUT
}

template <int64_t F, int NW, int NX, bool W512>
TS_AVX2 __attribute__((always_inline)) inline void tile(const uint8_t* const* wr, int64_t row_bytes, const QRow* xr,
                                                        int64_t K, float* out, int64_t ldo) {
  if constexpr (is_k(F) && W512) tile_k512<F, NW, NX>(wr, row_bytes, xr, K, out, ldo);
  else if constexpr (is_k(F)) tile_k_avx2<F, NW, NX>(wr, row_bytes, xr, K, out, ldo);
  else tile_avx2<F, NW, NX>(wr, row_bytes, xr, K, out, ldo);
}

// Register tiles of NW weight rows x NX input rows over R input rows. W512: the AVX-512 K-quant
// kernel (the other formats have none; tile ignores it for them), else the AVX2 kernels.
template <int64_t F, bool W512>
TS_AVX2 void rows_tiles(const uint8_t* const* wr, int64_t nw, int64_t row_bytes, const QRow* xr, int64_t R,
                       int64_t K, float* out, int64_t ldo) {
  if (R == 1) {
    switch (nw) {
      case 4: tile<F, 4, 1, W512>(wr, row_bytes, xr, K, out, ldo); break;
      case 3: tile<F, 3, 1, W512>(wr, row_bytes, xr, K, out, ldo); break;
      case 2: tile<F, 2, 1, W512>(wr, row_bytes, xr, K, out, ldo); break;
      default: tile<F, 1, 1, W512>(wr, row_bytes, xr, K, out, ldo); break;
    }
    return;
  }
  for (int64_t i = 0; i < nw; i += 2) {  // 2 weight rows x 4 input rows: 8 accumulators
    const int64_t ni = std::min<int64_t>(2, nw - i);
    for (int64_t r = 0; r < R; r += 4) {
      const int64_t nr = std::min<int64_t>(4, R - r);
      float* o = out + r * ldo + i;
      const QRow* x = xr + r;
#define TS_TILE(NWv, NXv) tile<F, NWv, NXv, W512>(wr + i, row_bytes, x, K, o, ldo)
      if (ni == 2) {
        switch (nr) { case 4: TS_TILE(2, 4); break; case 3: TS_TILE(2, 3); break; case 2: TS_TILE(2, 2); break; default: TS_TILE(2, 1); }
      } else {
        switch (nr) { case 4: TS_TILE(1, 4); break; case 3: TS_TILE(1, 3); break; case 2: TS_TILE(1, 2); break; default: TS_TILE(1, 1); }
      }
#undef TS_TILE
    }
  }
}
#endif  // TS_X86

template <int64_t F>
void rows(const uint8_t* const* wr, int64_t nw, int64_t row_bytes, const QRow* xr, int64_t R, int64_t K, float* out,
          int64_t ldo, Isa isa) {
#ifdef TS_X86
  if constexpr (!is_k(F)) {
    if (isa == Isa::kAvx512 && nw == kRows) {  // four weight rows x passes of <= 4 input rows
      for (int64_t r = 0; r < R; r += 4) {
        switch (std::min<int64_t>(4, R - r)) {
          case 4: tile_q512<F, 4>(wr, row_bytes, xr + r, K, out + r * ldo, ldo); break;
          case 3: tile_q512<F, 3>(wr, row_bytes, xr + r, K, out + r * ldo, ldo); break;
          case 2: tile_q512<F, 2>(wr, row_bytes, xr + r, K, out + r * ldo, ldo); break;
          default: tile_q512<F, 1>(wr, row_bytes, xr + r, K, out + r * ldo, ldo); break;
        }
      }
      return;
    }
  }
  if constexpr (is_k(F)) {
    if (isa == Isa::kAvx512) {
      rows_tiles<F, true>(wr, nw, row_bytes, xr, R, K, out, ldo);
      return;
    }
  }
  if (isa != Isa::kScalar) {
    rows_tiles<F, false>(wr, nw, row_bytes, xr, R, K, out, ldo);
    return;
  }
#endif
  if constexpr (is_k(F)) rows_k_scalar<F>(wr, nw, xr, R, K, out, ldo);
  else rows_scalar<F>(wr, nw, xr, R, K, out, ldo);
}

using RowsFn = void (*)(const uint8_t* const*, int64_t, int64_t, const QRow*, int64_t, int64_t, float*, int64_t, Isa);

// Grouped layouts (gguf_blocks.h): the rows back in GGUF order, then the GGUF format's kernels.
template <int64_t G>
void rows_grouped(const uint8_t* const* wr, int64_t nw, int64_t row_bytes, const QRow* xr, int64_t R, int64_t K,
                  float* out, int64_t ldo, Isa isa) {
  constexpr int64_t F = grouped_base(G);
  thread_local std::vector<uint8_t> plain;
  const uint8_t* pr[kRows];
  ungroup_into(wr, nw, row_bytes, F, plain, pr);
  rows<F>(pr, nw, row_bytes, xr, R, K, out, ldo, isa);
}


// ---------------------------------------------------------------------------------------------
// Interleaved layouts (Q4_0X / Q4_1X / Q5_0X / Q8_0X, gguf_blocks.h): tiles of 16 weight rows, one integer
// lane per weight row. Order (reference.linear_int8): per output, one accumulator, block by block
// y = fma(d_w * d_x, S, y) with S the exact integer sum of q_w * q_x over the block's 32 values,
// then (Q4_1X) y = fma(min_w, d_x * sum(q_x), y). The stored values are unsigned (u = q_w + off:
// Q4_0 8, Q4_1 0, Q5_0 16, Q8_0 128), so S = sum u * q_x - off * sum(q_x).
constexpr int x_offset(int64_t F) { return F == kQ4_0X ? 8 : F == kQ5_0X ? 16 : F == kQ8_0X ? 128 : 0; }
constexpr int64_t x_chunk(int64_t F) {
  return kInterleaveRows * (F == kQ4_0X ? 18 : F == kQ4_1X ? 20 : F == kQ5_0X ? 22 : 34);
}
constexpr int x_header(int64_t F) { return F == kQ4_1X ? 64 : 32; }
constexpr int x_fifth(int64_t F) { return F == kQ5_0X ? 32 + 256 : 0; }  // Q5_0X: where the fifth bits start

template <int64_t F>
void rows_x_scalar(const uint8_t* g, const QRow* xr, int64_t R, int64_t K, float* out, int64_t ldo) {
  for (int64_t r = 0; r < R; ++r) {
    float acc[kInterleaveRows] = {};
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* p = g + b * x_chunk(F);
      const uint8_t* v = p + x_header(F);
      const int8_t* q = xr[r].q + 32 * b;
      for (int i = 0; i < kInterleaveRows; ++i) {
        int32_t S = 0;
        if constexpr (F == kQ8_0X) {
          for (int c = 0; c < 8; ++c)
            for (int e = 0; e < 4; ++e) S += static_cast<int32_t>(v[64 * c + 4 * i + e]) * q[4 * c + e];
        } else {
          for (int c = 0; c < 4; ++c) {
            const int hb = F == kQ5_0X ? p[x_fifth(F) + 16 * c + i] : 0;
            for (int e = 0; e < 4; ++e) {
              const uint8_t u = v[64 * c + 4 * i + e];
              const int lo = (u & 15) | ((hb >> e) & 1) << 4, hi = (u >> 4) | ((hb >> (4 + e)) & 1) << 4;
              S += lo * q[4 * c + e] + hi * q[16 + 4 * c + e];
            }
          }
        }
        S -= x_offset(F) * xr[r].bsum[b];
        acc[i] = std::fma(half_at(p + 2 * i) * xr[r].d[b], static_cast<float>(S), acc[i]);
        if constexpr (F == kQ4_1X) acc[i] = std::fma(half_at(p + 32 + 2 * i), xr[r].s[b], acc[i]);
      }
    }
    for (int i = 0; i < kInterleaveRows; ++i) out[r * ldo + i] = acc[i];
  }
}

#ifdef TS_X86
#define TS_AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// acc + the exact sums of 4 byte products per 32-bit lane (w unsigned, x signed): vpdpbusd, or
// maddubs + madd where the CPU has no VNNI. maddubs adds two products into 16 bits: exact for the
// 4-bit formats (2 * 15 * 127 < 2^15); Q8_0X's unsigned values (up to 255) take the signed form
// instead (|w| against x with w's sign, w = u - 128: 2 * 128 * 127 < 2^15 too) and its offset is
// then not subtracted (kernel `signed_q8`): the same integers.
template <bool VNNI>
TS_AVX512VNNI __attribute__((always_inline)) inline __m512i dot4(__m512i acc, __m512i w, __m512i x) {
  if constexpr (VNNI) {
    return _mm512_dpbusd_epi32(acc, w, x);
  } else {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
  }
}

// The unsigned values of chunk c (0..3) of a 4-bit interleaved block at p: lo = its low nibbles, hi
// its high ones (values 16 + 4c .. of each row), Q5_0X with its fifth bits (byte i of the part ->
// each byte of lane i; bit e / 4 + e -> 0x10 in byte e). tile_x512's and rows_x_amx's.
template <int64_t F>
TS_AVX512VNNI __attribute__((always_inline)) inline void chunk_values512(const uint8_t* p, int c, __m512i m4,
                                                                       __m512i& lo, __m512i& hi) {
  const __m512i raw = _mm512_loadu_si512(p + x_header(F) + 64 * c);
  lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
  if constexpr (F == kQ5_0X) {
    const __m512i hb = _mm512_shuffle_epi8(
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + x_fifth(F) + 16 * c))),
        _mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0x00000000));
    const __m512i b5 = _mm512_set1_epi8(0x10);
    lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(hb, _mm512_set1_epi32(0x08040201)), b5));
    hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(hb, _mm512_set1_epi32(0x80402010)), b5));
  }
}

template <int64_t F, int NX, bool VNNI>
TS_AVX512VNNI void tile_x512(const uint8_t* g, const QRow* xr, int64_t K, float* out, int64_t ldo) {
  constexpr bool signed_q8 = F == kQ8_0X && !VNNI;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const bool nta = prefetch_nta();
  __m512 acc[NX];
  for (int r = 0; r < NX; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* p = g + b * x_chunk(F);
    const uint8_t* v = p + x_header(F);
    for (int64_t off = 0; off < x_chunk(F); off += 64) prefetch_weights(p + 4 * x_chunk(F) + off, nta);
    __m512i S[NX];
    for (int r = 0; r < NX; ++r) S[r] = _mm512_setzero_si512();
    if constexpr (F == kQ8_0X) {
      for (int c = 0; c < 8; ++c) {
        __m512i w = _mm512_loadu_si512(v + 64 * c);
        __mmask64 neg = 0;
        if constexpr (signed_q8) {
          w = _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80)));  // the signed values
          neg = _mm512_movepi8_mask(w);
          w = _mm512_abs_epi8(w);
        }
        for (int r = 0; r < NX; ++r) {
          __m512i x = _mm512_set1_epi32(load_i32(xr[r].q + 32 * b + 4 * c));
          if constexpr (signed_q8) x = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
          S[r] = dot4<VNNI>(S[r], w, x);
        }
      }
    } else {
      for (int c = 0; c < 4; ++c) {
        __m512i lo, hi;
        chunk_values512<F>(p, c, m4, lo, hi);
        for (int r = 0; r < NX; ++r) {
          S[r] = dot4<VNNI>(S[r], lo, _mm512_set1_epi32(load_i32(xr[r].q + 32 * b + 4 * c)));
          S[r] = dot4<VNNI>(S[r], hi, _mm512_set1_epi32(load_i32(xr[r].q + 32 * b + 16 + 4 * c)));
        }
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    __m512 mw = _mm512_setzero_ps();
    if constexpr (F == kQ4_1X) mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
    for (int r = 0; r < NX; ++r) {
      __m512i s = S[r];
      if constexpr (x_offset(F) != 0 && !signed_q8) s = _mm512_sub_epi32(s, _mm512_set1_epi32(x_offset(F) * xr[r].bsum[b]));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(xr[r].d[b])), _mm512_cvtepi32_ps(s), acc[r]);
      if constexpr (F == kQ4_1X) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xr[r].s[b]), acc[r]);
    }
  }
  for (int r = 0; r < NX; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

template <int64_t F, bool VNNI>
void rows_x512(const uint8_t* g, const QRow* xr, int64_t R, int64_t K, float* out, int64_t ldo) {
  constexpr int kPass = 6;  // input rows per pass: 6 integer + 6 float accumulators
  int64_t r = 0;
  for (; r + kPass <= R; r += kPass) tile_x512<F, kPass, VNNI>(g, xr + r, K, out + r * ldo, ldo);
  switch (R - r) {
    case 5: tile_x512<F, 5, VNNI>(g, xr + r, K, out + r * ldo, ldo); break;
    case 4: tile_x512<F, 4, VNNI>(g, xr + r, K, out + r * ldo, ldo); break;
    case 3: tile_x512<F, 3, VNNI>(g, xr + r, K, out + r * ldo, ldo); break;
    case 2: tile_x512<F, 2, VNNI>(g, xr + r, K, out + r * ldo, ldo); break;
    case 1: tile_x512<F, 1, VNNI>(g, xr + r, K, out + r * ldo, ldo); break;
    default: break;
  }
}

// AMX (isa.h, amx_int8): 16 input rows x the group's 16 weight rows per tile, block by block. For
// block b, tdpbsud gives C[m][i] = sum over the block's 32 values of q_x (signed, A: 16 rows of 32
// bytes straight from the quantized rows) times u_w (unsigned, B: the block's 8 x 64 bytes in
// VNNI order, byte 4 i + e of row c being value 4 c + e of weight row i), the exact integer the
// vector kernels get from vpdpbusd; then the same S = C - off * sum(q_x), acc = fma(d_w * d_x, S,
// acc) (and Q4_1X's min term), so the same bits. The interleaved chunks are that B order already:
// Q8_0X's 8 x 64 bytes as stored, the 4-bit formats' low nibbles of chunk c are row c and their
// high nibbles row 4 + c (Q5_0X with its fifth bits), unpacked once per group into a buffer.
// Two tile sets alternate between blocks, so the tile unit works on block b + 1 while the vector
// units scale block b.
#define TS_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")))

struct alignas(64) AmxTileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

template <int64_t F>
TS_AMX __attribute__((always_inline)) inline void amx_unpack_block(const uint8_t* p, uint8_t* dst) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int c = 0; c < 4; ++c) {
    __m512i lo, hi;
    chunk_values512<F>(p, c, m4, lo, hi);
    _mm512_store_si512(dst + 64 * c, lo);
    _mm512_store_si512(dst + 64 * (4 + c), hi);
  }
}

// The float steps of block b for 16 input rows, from its integer sums C [16 rows][16 weight rows].
template <int64_t F>
TS_AMX __attribute__((always_inline)) inline void amx_scale(const int32_t* C, const uint8_t* p, const QRow* xr,
                                                            int64_t b, __m512* acc) {
  const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  __m512 mw = _mm512_setzero_ps();
  if constexpr (F == kQ4_1X) mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
#pragma GCC unroll 16
  for (int m = 0; m < 16; ++m) {
    __m512i s = _mm512_load_si512(C + 16 * m);
    if constexpr (x_offset(F) != 0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(x_offset(F) * xr[m].bsum[b]));
    acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(xr[m].d[b])), _mm512_cvtepi32_ps(s), acc[m]);
    if constexpr (F == kQ4_1X) acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xr[m].s[b]), acc[m]);
  }
}

// C [16 x 16 int32] = one block's tdpbsud in tile set (tc, ta, tb): A = the 16 input rows' 32 bytes at a
// (row stride K), B = the block's 512 bytes at bt. A macro: the tile intrinsics take their tile numbers
// as literals (GCC pastes them into the instruction's register names).
#define TS_AMX_BLOCK_SUMS(tc, ta, tb, a, bt, C) \
  do {                                          \
    _tile_zero(tc);                             \
    _tile_loadd(ta, (a), K);                    \
    _tile_loadd(tb, (bt), 64);                  \
    _tile_dpbsud(tc, ta, tb);                   \
    _tile_stored(tc, (C), 64);                  \
  } while (0)

// R16 (a multiple of 16) input rows whose quantized rows lie K bytes apart (xr[m].q = xr[0].q + m K).
template <int64_t F>
TS_AMX void rows_x_amx(const uint8_t* g, const QRow* xr, int64_t R16, int64_t K, float* out, int64_t ldo) {
  const int64_t nb = K / 32;
  const uint8_t* bt;  // the B tiles: 512 bytes per block
  thread_local std::vector<uint8_t> unpacked;
  if constexpr (F == kQ8_0X) {
    bt = nullptr;  // read in place: block b's 512 bytes at g + b * x_chunk + x_header
  } else {
    unpacked.resize(static_cast<size_t>(nb) * 512 + 64);
    uint8_t* dst = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(unpacked.data()) + 63) & ~uintptr_t{63});
    for (int64_t b = 0; b < nb; ++b) amx_unpack_block<F>(g + b * x_chunk(F), dst + 512 * b);
    bt = dst;
  }
  const auto btile = [&](int64_t b) { return F == kQ8_0X ? g + b * x_chunk(F) + x_header(F) : bt + 512 * b; };
  AmxTileConfig cfg{};
  cfg.palette = 1;
  for (int t : {0, 3}) cfg.rows[t] = 16, cfg.colsb[t] = 32;  // A
  for (int t : {1, 4}) cfg.rows[t] = 8, cfg.colsb[t] = 64;   // B
  for (int t : {2, 5}) cfg.rows[t] = 16, cfg.colsb[t] = 64;  // C
  _tile_loadconfig(&cfg);
  alignas(64) int32_t C0[256], C1[256];
  for (int64_t r0 = 0; r0 < R16; r0 += 16) {
    const QRow* x = xr + r0;
    const int8_t* q = x[0].q;
    __m512 acc[16];
    for (int m = 0; m < 16; ++m) acc[m] = _mm512_setzero_ps();
    // block b in tiles 0-2 (C0), block b + 1 in tiles 3-5 (C1): b + 1's tile work overlaps b's scaling
    TS_AMX_BLOCK_SUMS(2, 0, 1, q, btile(0), C0);
    for (int64_t b = 0; b < nb; b += 2) {
      if (b + 1 < nb) TS_AMX_BLOCK_SUMS(5, 3, 4, q + 32 * (b + 1), btile(b + 1), C1);
      amx_scale<F>(C0, g + b * x_chunk(F), x, b, acc);
      if (b + 1 < nb) {
        if (b + 2 < nb) TS_AMX_BLOCK_SUMS(2, 0, 1, q + 32 * (b + 2), btile(b + 2), C0);
        amx_scale<F>(C1, g + (b + 1) * x_chunk(F), x, b + 1, acc);
      }
    }
    for (int m = 0; m < 16; ++m) _mm512_storeu_ps(out + (r0 + m) * ldo, acc[m]);
  }
  _tile_release();
}
#undef TS_AMX_BLOCK_SUMS

// An accumulator the compiler must take as it is at this point: integer adds associate, and GCC
// otherwise rebalances a tile's per-row sums into trees that hold every product of a block live at
// once (AVX2: 16 registers), spilling them to the stack; 0.4-0.5x the tile's speed (perf annotate).
TS_AVX2 __attribute__((always_inline)) inline void keep_order(__m256i& v) { asm("" : "+x"(v)); }

// The AVX2 path of the same tiles: each 64-byte chunk as two registers of 8 weight rows (the halves h);
// maddubs + madd (exact, as above; Q8_0X in the signed form), the same per-block order. An input
// row's broadcast feeds both halves. Q4: a block's eight maddubs per row and half are summed in
// int16 before the one madd (each is at most 2 * 15 * 128 = 3,840 in size, eight 30,720 < 2^15:
// exact); Q5: in pairs (2 * 7,936).
template <int64_t F, int NX>
TS_AVX2 void tile_x256(const uint8_t* g, const QRow* xr, int64_t K, float* out, int64_t ldo) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const bool nta = prefetch_nta();
  __m256 acc[NX][2];
  for (int r = 0; r < NX; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* p = g + b * x_chunk(F);
    const uint8_t* v = p + x_header(F);
    for (int64_t off = 0; off < x_chunk(F); off += 64) prefetch_weights(p + 4 * x_chunk(F) + off, nta);
    __m256i S[NX][2];
    if constexpr (F == kQ8_0X) {
      for (int r = 0; r < NX; ++r) S[r][0] = S[r][1] = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        __m256i w[2], a[2];
        for (int h = 0; h < 2; ++h) {
          w[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 64 * c + 32 * h)),
                                  _mm256_set1_epi8(static_cast<char>(0x80)));  // the signed values
          a[h] = _mm256_abs_epi8(w[h]);
        }
        for (int r = 0; r < NX; ++r) {
          const __m256i xb = _mm256_set1_epi32(load_i32(xr[r].q + 32 * b + 4 * c));
          for (int h = 0; h < 2; ++h) {
            S[r][h] = _mm256_add_epi32(S[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(a[h], _mm256_sign_epi8(xb, w[h])), ones));
            keep_order(S[r][h]);
          }
        }
      }
    } else {
      __m256i P[NX][2];  // int16 sums of maddubs (Q5_0X: of one chunk's pair)
      for (int r = 0; r < NX; ++r) P[r][0] = P[r][1] = S[r][0] = S[r][1] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        __m256i lo[2], hi[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 64 * c + 32 * h));
          lo[h] = _mm256_and_si256(raw, m4), hi[h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
          if constexpr (F == kQ5_0X) {  // as in tile_x512, rows 8 h .. 8 h + 7
            const __m256i hb = _mm256_shuffle_epi8(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + x_fifth(F) + 16 * c + 8 * h))),
                _mm256_set_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0x00000000, 0x0C0C0C0C, 0x08080808, 0x04040404,
                                 0x00000000));
            const __m256i b5 = _mm256_set1_epi8(0x10);
            const __m256i pl = _mm256_set1_epi32(0x08040201), ph = _mm256_set1_epi32(static_cast<int>(0x80402010u));
            lo[h] = _mm256_or_si256(lo[h], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hb, pl), pl), b5));
            hi[h] = _mm256_or_si256(hi[h], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hb, ph), ph), b5));
          }
        }
        for (int r = 0; r < NX; ++r) {
          const __m256i xl = _mm256_set1_epi32(load_i32(xr[r].q + 32 * b + 4 * c));
          const __m256i xh = _mm256_set1_epi32(load_i32(xr[r].q + 32 * b + 16 + 4 * c));
          for (int h = 0; h < 2; ++h) {
            const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xl), _mm256_maddubs_epi16(hi[h], xh));
            if constexpr (F == kQ5_0X) {
              S[r][h] = _mm256_add_epi32(S[r][h], _mm256_madd_epi16(pair, ones));
              keep_order(S[r][h]);
            } else {
              P[r][h] = _mm256_add_epi16(P[r][h], pair);
              keep_order(P[r][h]);
            }
          }
        }
      }
      if constexpr (F != kQ5_0X)
        for (int r = 0; r < NX; ++r)
          for (int h = 0; h < 2; ++h) S[r][h] = _mm256_madd_epi16(P[r][h], ones);
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
      __m256 mw = _mm256_setzero_ps();
      if constexpr (F == kQ4_1X) mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 16 * h)));
      for (int r = 0; r < NX; ++r) {
        __m256i si = S[r][h];
        if constexpr (F == kQ4_0X || F == kQ5_0X) si = _mm256_sub_epi32(si, _mm256_set1_epi32(x_offset(F) * xr[r].bsum[b]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(xr[r].d[b])), _mm256_cvtepi32_ps(si), acc[r][h]);
        if constexpr (F == kQ4_1X) acc[r][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xr[r].s[b]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < NX; ++r) {
    _mm256_storeu_ps(out + r * ldo, acc[r][0]);
    _mm256_storeu_ps(out + r * ldo + 8, acc[r][1]);
  }
}

// Input rows per AVX2 tile: the weights' nibbles are unpacked once for them (16 ymm registers; 3 and
// 5 measured slower on a Zen 3, bench/results/2026-11-30-avx2-int8-tiles-ci.md).
constexpr int kX256Rows = 4;

template <int64_t F>
TS_AVX2 void rows_x256(const uint8_t* g, const QRow* xr, int64_t R, int64_t K, float* out, int64_t ldo) {
  int64_t r = 0;
  for (; r + kX256Rows <= R; r += kX256Rows) tile_x256<F, kX256Rows>(g, xr + r, K, out + r * ldo, ldo);
  switch (R - r) {
    case 3: tile_x256<F, 3>(g, xr + r, K, out + r * ldo, ldo); break;
    case 2: tile_x256<F, 2>(g, xr + r, K, out + r * ldo, ldo); break;
    case 1: tile_x256<F, 1>(g, xr + r, K, out + r * ldo, ldo); break;
    default: break;
  }
}

bool has_vnni() {
  // TURBOSPEC_VNNI=0 (read once) takes the maddubs form on a CPU with VNNI too: the tests' way to
  // run it; the two forms give the same integers
  static const bool v = __builtin_cpu_supports("avx512vnni") && !(std::getenv("TURBOSPEC_VNNI") &&
                                                                   std::string(std::getenv("TURBOSPEC_VNNI")) == "0");
  return v;
}
#endif  // TS_X86


// Q4_KX (activations per 256): per super-block and output the exact integers L = sum over the 8
// sub-blocks of sc * (sum of u_w * q_x) and M = sum of mn * (sum of q_x over the sub-block), then
// y = fma(d_w * d_x, L, y), y = fma(-(dmin_w * d_x), M, y) (reference._linear_int8_q4kx).
inline void q4k_scale_min(const uint8_t* p, int i, int j, int* sc, int* mn) {  // p: the super-block's group part
  const uint8_t* a = p + 64 + 4 * i;         // packed bytes 0..3 of row i
  const uint8_t* b = p + 128 + 4 * i;        // 4..7
  const uint8_t* c = p + 192 + 4 * i;        // 8..11
  if (j < 4) {
    *sc = a[j] & 63, *mn = b[j] & 63;
  } else {
    *sc = (c[j - 4] & 15) | ((a[j - 4] >> 6) << 4);
    *mn = (c[j - 4] >> 4) | ((b[j - 4] >> 6) << 4);
  }
}

void rows_q4kx_scalar(const uint8_t* g, const QRow* xr, int64_t R, int64_t K, float* out, int64_t ldo) {
  for (int64_t r = 0; r < R; ++r) {
    float acc[kInterleaveRows] = {};
    for (int64_t s = 0; s < K / 256; ++s) {
      const uint8_t* p = g + s * kInterleaveRows * 144;
      const int8_t* q = xr[r].q256 + 256 * s;
      const int16_t* b16 = xr[r].bsum16 + 16 * s;
      for (int i = 0; i < kInterleaveRows; ++i) {
        int32_t L = 0, M = 0;
        for (int sub = 0; sub < 8; ++sub) {
          int sc, mn;
          q4k_scale_min(p, i, sub, &sc, &mn);
          const int j = sub >> 1, hi = sub & 1;
          int32_t S = 0;
          for (int c = 0; c < 8; ++c)
            for (int e = 0; e < 4; ++e) {
              const uint8_t u = p[256 + 64 * (8 * j + c) + 4 * i + e];
              S += static_cast<int32_t>(hi ? u >> 4 : u & 15) * q[64 * j + 32 * hi + 4 * c + e];
            }
          L += sc * S;
          M += mn * (b16[2 * sub] + b16[2 * sub + 1]);
        }
        const float dx = xr[r].d256[s];
        acc[i] = std::fma(half_at(p + 2 * i) * dx, static_cast<float>(L), acc[i]);
        acc[i] = std::fma(-(half_at(p + 32 + 2 * i) * dx), static_cast<float>(M), acc[i]);
      }
    }
    for (int i = 0; i < kInterleaveRows; ++i) out[r * ldo + i] = acc[i];
  }
}

#ifdef TS_X86
// Sixteen rows' 6-bit scale or min of sub-block `sub`, one per lane (GGUF's get_scale_min_k4): X holds
// the packed bytes 0..3 (scales: part A) or 4..7 (mins: part B), C bytes 8..11, whose low nibbles
// are the scales' and high nibbles the mins' (c_shift 0 / 4).
TS_AVX512VNNI __attribute__((always_inline)) inline __m512i q4k_six_bits(__m512i X, __m512i C, int sub, int c_shift) {
  const __m512i m6 = _mm512_set1_epi32(63), m15 = _mm512_set1_epi32(15), m3 = _mm512_set1_epi32(3);
  if (sub < 4) return _mm512_and_si512(_mm512_srli_epi32(X, 8 * sub), m6);
  return _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(C, 8 * (sub - 4) + c_shift), m15),
                         _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(X, 8 * (sub - 4) + 6), m3), 4));
}

template <int NX, bool VNNI>
TS_AVX512VNNI void tile_q4kx512(const uint8_t* g, const QRow* xr, int64_t K, float* out, int64_t ldo) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const bool nta = prefetch_nta();
  __m512 acc[NX];
  for (int r = 0; r < NX; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < K / 256; ++s) {
    const uint8_t* p = g + s * kInterleaveRows * 144;
    for (int64_t off = 0; off < kInterleaveRows * 144; off += 64) prefetch_weights(p + 2 * kInterleaveRows * 144 + off, nta);
    const __m512i A = _mm512_loadu_si512(p + 64), B = _mm512_loadu_si512(p + 128), C = _mm512_loadu_si512(p + 192);
    __m512i L[NX];
    for (int r = 0; r < NX; ++r) L[r] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {  // sub-blocks 2 j (low nibbles) and 2 j + 1 (high)
      __m512i Slo[NX], Shi[NX];
      for (int r = 0; r < NX; ++r) Slo[r] = Shi[r] = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) {
        const __m512i raw = _mm512_loadu_si512(p + 256 + 64 * (8 * j + c));
        const __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
        for (int r = 0; r < NX; ++r) {
          const int8_t* q = xr[r].q256 + 256 * s + 64 * j + 4 * c;
          Slo[r] = dot4<VNNI>(Slo[r], lo, _mm512_set1_epi32(load_i32(q)));
          Shi[r] = dot4<VNNI>(Shi[r], hi, _mm512_set1_epi32(load_i32(q + 32)));
        }
      }
      // the 6-bit scales of sub-blocks 2 j, 2 j + 1 for the 16 rows (lanes)
      const __m512i sc0 = q4k_six_bits(A, C, 2 * j, 0), sc1 = q4k_six_bits(A, C, 2 * j + 1, 0);
      for (int r = 0; r < NX; ++r)
        L[r] = _mm512_add_epi32(L[r], _mm512_add_epi32(_mm512_mullo_epi32(Slo[r], sc0), _mm512_mullo_epi32(Shi[r], sc1)));
    }
    // the mins, two 16-bit values per lane (sub-blocks 2 t, 2 t + 1), against the inputs' sums per 32
    __m512i mnp[4];
    for (int t = 0; t < 4; ++t)
      mnp[t] = _mm512_or_si512(q4k_six_bits(B, C, 2 * t, 4), _mm512_slli_epi32(q4k_six_bits(B, C, 2 * t + 1, 4), 16));
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512 dmw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
    for (int r = 0; r < NX; ++r) {
      const int16_t* b16 = xr[r].bsum16 + 16 * s;
      __m512i M = _mm512_setzero_si512();
      for (int t = 0; t < 4; ++t) {
        const int32_t b0 = b16[4 * t] + b16[4 * t + 1], b1 = b16[4 * t + 2] + b16[4 * t + 3];
        M = _mm512_add_epi32(M, _mm512_madd_epi16(mnp[t], _mm512_set1_epi32((b0 & 0xFFFF) | (b1 << 16))));
      }
      const __m512 dx = _mm512_set1_ps(xr[r].d256[s]);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(L[r]), acc[r]);
      acc[r] = _mm512_fnmadd_ps(_mm512_mul_ps(dmw, dx), _mm512_cvtepi32_ps(M), acc[r]);
    }
  }
  for (int r = 0; r < NX; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

template <bool VNNI>
void rows_q4kx512(const uint8_t* g, const QRow* xr, int64_t R, int64_t K, float* out, int64_t ldo) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) tile_q4kx512<4, VNNI>(g, xr + r, K, out + r * ldo, ldo);
  switch (R - r) {
    case 3: tile_q4kx512<3, VNNI>(g, xr + r, K, out + r * ldo, ldo); break;
    case 2: tile_q4kx512<2, VNNI>(g, xr + r, K, out + r * ldo, ldo); break;
    case 1: tile_q4kx512<1, VNNI>(g, xr + r, K, out + r * ldo, ldo); break;
    default: break;
  }
}

// The AVX2 form: the 16 rows as two halves of 8 (h), each a pass over the super-blocks.
TS_AVX2 __attribute__((always_inline)) inline __m256i q4k_six_bits256(__m256i X, __m256i C, int sub, int c_shift) {
  const __m256i m6 = _mm256_set1_epi32(63), m15 = _mm256_set1_epi32(15), m3 = _mm256_set1_epi32(3);
  if (sub < 4) return _mm256_and_si256(_mm256_srli_epi32(X, 8 * sub), m6);
  return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(C, 8 * (sub - 4) + c_shift), m15),
                         _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(X, 8 * (sub - 4) + 6), m3), 4));
}

template <int NX>
TS_AVX2 void tile_q4kx256(const uint8_t* g, int h, const QRow* xr, int64_t K, float* out, int64_t ldo) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[NX];
  for (int r = 0; r < NX; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < K / 256; ++s) {
    const uint8_t* p = g + s * kInterleaveRows * 144;
    const __m256i A = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 + 32 * h));
    const __m256i B = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
    const __m256i C = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 192 + 32 * h));
    __m256i L[NX];
    for (int r = 0; r < NX; ++r) L[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      __m256i Slo[NX], Shi[NX];
      for (int r = 0; r < NX; ++r) Slo[r] = Shi[r] = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 256 + 64 * (8 * j + c) + 32 * h));
        const __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        for (int r = 0; r < NX; ++r) {
          const int8_t* q = xr[r].q256 + 256 * s + 64 * j + 4 * c;
          Slo[r] = _mm256_add_epi32(Slo[r], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(q))), ones));
          Shi[r] = _mm256_add_epi32(Shi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(q + 32))), ones));
          keep_order(Slo[r]), keep_order(Shi[r]);
        }
      }
      const __m256i sc0 = q4k_six_bits256(A, C, 2 * j, 0), sc1 = q4k_six_bits256(A, C, 2 * j + 1, 0);
      for (int r = 0; r < NX; ++r)
        L[r] = _mm256_add_epi32(L[r], _mm256_add_epi32(_mm256_mullo_epi32(Slo[r], sc0), _mm256_mullo_epi32(Shi[r], sc1)));
    }
    __m256i mnp[4];
    for (int t = 0; t < 4; ++t)
      mnp[t] = _mm256_or_si256(q4k_six_bits256(B, C, 2 * t, 4), _mm256_slli_epi32(q4k_six_bits256(B, C, 2 * t + 1, 4), 16));
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
    const __m256 dmw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 + 16 * h)));
    for (int r = 0; r < NX; ++r) {
      const int16_t* b16 = xr[r].bsum16 + 16 * s;
      __m256i M = _mm256_setzero_si256();
      for (int t = 0; t < 4; ++t) {
        const int32_t b0 = b16[4 * t] + b16[4 * t + 1], b1 = b16[4 * t + 2] + b16[4 * t + 3];
        M = _mm256_add_epi32(M, _mm256_madd_epi16(mnp[t], _mm256_set1_epi32((b0 & 0xFFFF) | (b1 << 16))));
      }
      const __m256 dx = _mm256_set1_ps(xr[r].d256[s]);
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(L[r]), acc[r]);
      acc[r] = _mm256_fnmadd_ps(_mm256_mul_ps(dmw, dx), _mm256_cvtepi32_ps(M), acc[r]);
    }
  }
  for (int r = 0; r < NX; ++r) _mm256_storeu_ps(out + r * ldo + 8 * h, acc[r]);
}

TS_AVX2 void rows_q4kx256(const uint8_t* g, const QRow* xr, int64_t R, int64_t K, float* out, int64_t ldo) {
  for (int h = 0; h < 2; ++h) {
    int64_t r = 0;
    for (; r + 2 <= R; r += 2) tile_q4kx256<2>(g, h, xr + r, K, out + r * ldo, ldo);
    if (r < R) tile_q4kx256<1>(g, h, xr + r, K, out + r * ldo, ldo);
  }
}
#endif  // TS_X86

// One group of 16 interleaved rows (wr[0]: the group's first byte; nw == 16) against R input rows.
template <int64_t F>
void rows_x(const uint8_t* const* wr, int64_t nw, int64_t row_bytes, const QRow* xr, int64_t R, int64_t K, float* out,
            int64_t ldo, Isa isa) {
  (void)nw, (void)row_bytes;
  const uint8_t* g = wr[0];
#ifdef TS_X86
  if (isa == Isa::kAvx512) {
    const bool vnni = has_vnni();
    if constexpr (F == kQ4_KX) {
      vnni ? rows_q4kx512<true>(g, xr, R, K, out, ldo) : rows_q4kx512<false>(g, xr, R, K, out, ldo);
    } else {
      // AMX for whole tiles of 16 input rows (their quantized rows K bytes apart, as linear_int8_f32
      // lays them out), the vector kernel for the rest: the same bits either way
      const int64_t R16 = R >= 16 && amx_int8() && xr[R - 1].q == xr[0].q + (R - 1) * K ? R / 16 * 16 : 0;
      if (R16 > 0) rows_x_amx<F>(g, xr, R16, K, out, ldo);
      if (R16 < R)
        vnni ? rows_x512<F, true>(g, xr + R16, R - R16, K, out + R16 * ldo, ldo)
             : rows_x512<F, false>(g, xr + R16, R - R16, K, out + R16 * ldo, ldo);
    }
    return;
  }
  if (isa == Isa::kAvx2) {
    if constexpr (F == kQ4_KX) rows_q4kx256(g, xr, R, K, out, ldo);
    else rows_x256<F>(g, xr, R, K, out, ldo);
    return;
  }
#endif
  if constexpr (F == kQ4_KX) rows_q4kx_scalar(g, xr, R, K, out, ldo);
  else rows_x_scalar<F>(g, xr, R, K, out, ldo);
}

RowsFn rows_fn(int64_t f) {
  switch (f) {
    case kQ4_0: return &rows<kQ4_0>;
    case kQ4_1: return &rows<kQ4_1>;
    case kQ5_0: return &rows<kQ5_0>;
    case kQ8_0: return &rows<kQ8_0>;
    case kQ4_K: return &rows<kQ4_K>;
    case kQ5_K: return &rows<kQ5_K>;
    case kQ6_K: return &rows<kQ6_K>;
    case kQ4_0G: return &rows_grouped<kQ4_0G>;
    case kQ4_1G: return &rows_grouped<kQ4_1G>;
    case kQ5_0G: return &rows_grouped<kQ5_0G>;
    case kQ8_0G: return &rows_grouped<kQ8_0G>;
    case kQ4_0X: return &rows_x<kQ4_0X>;
    case kQ4_1X: return &rows_x<kQ4_1X>;
    case kQ5_0X: return &rows_x<kQ5_0X>;
    case kQ4_KX: return &rows_x<kQ4_KX>;
    case kQ8_0X: return &rows_x<kQ8_0X>;
    default: return nullptr;
  }
}

}  // namespace

bool int8_format(int64_t format) { return rows_fn(format) != nullptr; }

constexpr int64_t kParallelQuantRows = 16;  // input rows from which every thread quantizes a share

void linear_int8_f32(const float* xp, int64_t R, int64_t K, at::TensorList weights, at::IntArrayRef formats,
                     const float* bias, float* yp) {
  TORCH_CHECK(K % 32 == 0, "linear: activations=8 needs K % 32 == 0, got K = ", K);
  struct Seg {
    const uint8_t* w;
    int64_t rows, row_bytes, col0, item0, per_item;  // per_item: weight rows per work item
    RowsFn fn;
  };
  std::vector<Seg> segs;
  std::vector<at::Tensor> keep;
  int64_t N = 0, items = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const RowsFn fn = rows_fn(formats[i]);
    TORCH_CHECK(fn != nullptr, "linear: activations=8 needs GGUF block weights (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, "
                "Q6_K, or grouped Q4_0G, Q4_1G, Q5_0G, Q8_0G); weights[", i, "] has format ", formats[i]);
    const int64_t rb = format_row_bytes(formats[i], K);
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.dim() == 2 && w.is_cpu() && w.scalar_type() == at::kByte && w.size(1) == rb, "linear: weights[", i,
                "] (format ", formats[i], ", K = ", K, ") must be uint8 [N, ", rb, "], got ", w.scalar_type(), " ",
                w.sizes());
    const int64_t per_item = interleaved_base(formats[i]) >= 0 ? kInterleaveRows : kRows;
    TORCH_CHECK(w.size(0) % per_item == 0 || per_item == kRows, "linear: weights[", i, "] (format ", formats[i],
                ", interleaved) holds rows in groups of ", per_item, ", got ", w.size(0), " rows");
    keep.push_back(w.contiguous());
    segs.push_back({keep.back().data_ptr<uint8_t>(), w.size(0), rb, N, items, per_item, fn});
    N += w.size(0);
    items += (w.size(0) + per_item - 1) / per_item;
  }
  const int64_t nb = K / 32;
  // activations per 256: the K-quants and Q4_KX; per 32: the others
  const auto per256 = [](int64_t f) { return is_k(f) || f == kQ4_KX; };
  const bool need32 = std::any_of(formats.begin(), formats.end(), [&](int64_t f) { return !per256(f); });
  const bool need256 = std::any_of(formats.begin(), formats.end(), per256);
  TORCH_CHECK(!need256 || K % 256 == 0, "linear: K-quant weights need K % 256 == 0, got K = ", K);
  if (R == 0 || N == 0) return;
  const size_t n32 = need32 ? static_cast<size_t>(R) : 0, n256 = need256 ? static_cast<size_t>(R) : 0;
  // Reused between calls (a decode step makes ~200 of them): no allocation once they are big enough.
  thread_local std::vector<int8_t> q, q256;
  thread_local std::vector<float> d, s, d256;
  thread_local std::vector<int32_t> lsum, bsum;
  thread_local std::vector<int16_t> bsum16;
  thread_local std::vector<QRow> xr;
  q.resize(n32 * K), q256.resize(n256 * K), d.resize(n32 * nb), s.resize(n32 * nb), d256.resize(n256 * (K / 256));
  lsum.resize(n32 * nb * 8), bsum.resize(n32 * nb), bsum16.resize(n256 * (K / 16)), xr.resize(static_cast<size_t>(R));
  const Isa isa = cpu_isa();
  // The buffers are this thread's (thread_local): the workers get pointers (a lambda would name their own).
  QRow* rows_q = xr.data();
  int8_t *qp = q.data(), *q256p = q256.data();
  float *dp = d.data(), *sp = s.data(), *d256p = d256.data();
  int32_t *lsump = lsum.data(), *bsump = bsum.data();
  int16_t* bsum16p = bsum16.data();
  const auto quantize = [&](int64_t r) {
    QRow& row = rows_q[r];
    row = {};
    if (need32) {
      row.q = qp + r * K, row.d = dp + r * nb, row.s = sp + r * nb, row.lsum = lsump + r * nb * 8, row.bsum = bsump + r * nb;
      quantize_row(xp + r * K, K, qp + r * K, dp + r * nb, sp + r * nb, lsump + r * nb * 8, bsump + r * nb, isa);
    }
    if (need256) {
      row.q256 = q256p + r * K, row.d256 = d256p + r * (K / 256), row.bsum16 = bsum16p + r * (K / 16);
      quantize_row_256(xp + r * K, K, q256p + r * K, d256p + r * (K / 256), bsum16p + r * (K / 16), isa);
    }
  };
  const auto run = [&](int64_t a, int64_t b) {
    size_t si = 0;
    for (int64_t it = a; it < b; ++it) {
      while (si + 1 < segs.size() && segs[si + 1].item0 <= it) ++si;
      const Seg& sg = segs[si];
      const int64_t o0 = (it - sg.item0) * sg.per_item, nw = std::min(sg.per_item, sg.rows - o0);
      const uint8_t* wr[kRows];
      for (int64_t i = 0; i < std::min(nw, kRows); ++i) wr[i] = sg.w + (o0 + i) * sg.row_bytes;
      sg.fn(wr, nw, sg.row_bytes, rows_q, R, K, yp + sg.col0 + o0, N, isa);
    }
  };
  // One parallel region: from kParallelQuantRows input rows each thread quantizes a share of them and,
  // after a barrier, computes a contiguous share of the work items (what at::parallel_for's OpenMP
  // backend would hand it). The calling thread quantized them alone, the other waiting: a quarter of
  // a 17-row verify pass on a 2-core Zen 4 spent idle (perf). Fewer rows are quantized before
  // at::parallel_for, as they were. Each row and each output is computed as before: the same bits.
  const int64_t grain = std::max<int64_t>(1, items / (4 * std::max(1, at::get_num_threads())));
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), (items + grain - 1) / grain);
  if (nt <= 1 || at::in_parallel_region() || R < kParallelQuantRows) {
    for (int64_t r = 0; r < R; ++r) quantize(r);
    at::parallel_for(0, items, grain, run);  // (the 1-row calls of a decode step: 5 % slower in a region of our own)
  } else {
    // (no num_threads clause: GOMP's pool, as at::parallel_for's OpenMP backend avoids it)
#pragma omp parallel
    {
      const int64_t t = omp_get_thread_num(), T = omp_get_num_threads(), Tw = std::min(T, nt);
      for (int64_t r = R * t / T; r < R * (t + 1) / T; ++r) quantize(r);
#pragma omp barrier
      const int64_t chunk = (items + Tw - 1) / Tw, a = t * chunk;
      if (a < items) {
        at::internal::ThreadIdGuard tid_guard(static_cast<int>(t));
        run(a, std::min(items, a + chunk));
      }
    }
  }
  if (bias != nullptr)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < N; ++c) yp[r * N + c] = yp[r * N + c] + bias[c];
}

at::Tensor linear_int8(const at::Tensor& x, at::TensorList weights, at::IntArrayRef formats,
                       const std::optional<at::Tensor>& bias) {
  const int64_t K = x.size(-1);
  int64_t N = 0;
  for (const at::Tensor& w : weights) N += w.size(0);
  const int64_t R = K == 0 ? 0 : x.numel() / K;
  at::Tensor xf = x.reshape({R, K}).to(at::kFloat).contiguous();
  std::optional<at::Tensor> bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "linear: bias has ", bias->numel(), " elements, expected ", N);
    bf = bias->to(at::kFloat).contiguous();
  }
  at::Tensor yf = at::empty({R, N}, xf.options());
  linear_int8_f32(xf.data_ptr<float>(), R, K, weights, formats, bf ? bf->data_ptr<float>() : nullptr,
                  yf.data_ptr<float>());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(N);
  return yf.to(x.scalar_type()).view(shape);
}

}  // namespace turbospec

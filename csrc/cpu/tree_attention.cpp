// tree_attention, CPU: the attention of the target's verify pass over one layer's static KV cache
// (spec: reference.tree_attention; CUDA twin: csrc/cuda/tree_attention.cu).
//
// Work items are (batch row b, kv head, block of query rows) and run in parallel (a pair's rows are
// split when the (b, kv head) pairs do not share out evenly among the threads). An item's rows are
// the (query i, head of the GQA group) pairs that read the same kv head, row = i * G + head, so
// every key tile is read and widened to float32 once for all of them. Over tiles of kTile keys an item runs the attention
// softmax in float32, in base 2 (q is pre-scaled by scale * log2(e)), in two passes (see attend_rows):
//   S = Q K^T; keys past the end or outside the row's tree mask -> -inf; m = max over all tiles;
//   then per tile P = 2^(S - m); l += P and O += P V key by key.
// Both products are small GEMMs run by one register-blocked 4 x 16 micro-kernel written with GCC
// vector types (GCC's auto-vectoriser turns the plain loop nest into shuffles); it, the exp2 (a
// polynomial the compiler vectorises, relative error ~1e-7) and the widening loops are compiled for
// AVX-512, AVX2+FMA and the baseline ISA, picked at run time. cache_len is validated before anything
// runs: 0 <= cache_len[b] and cache_len[b] + n <= S, else the op raises.
// bf16_products (bfloat16 caches; turbospec's int8-activation mode): q and P are rounded to bfloat16, so
// both products are of bfloat16 values, exact in float32; where the CPU has AVX-512 BF16 both GEMMs run
// on vdpbf16ps (32 multiply-adds an instruction against the float32 kernels' 16 in two), elsewhere on
// the float32 micro-kernel over the rounded values: the same bits (see bf16_round).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "../checks.h"
#include "isa.h"
#include "tree_attention.h"

#if defined(__x86_64__) || defined(_M_X64)
#define TS_ATTN_X86 1
#include <immintrin.h>
#endif
#define TS_INLINE inline __attribute__((always_inline))
#pragma GCC diagnostic ignored "-Wpsabi"  // 64-byte vector types only reach the AVX-512 path
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's own maskz / rol intrinsics (their __Y)

namespace turbospec {
namespace {

constexpr int64_t kTile = 64;  // keys per tile
constexpr int64_t kMr = 4;     // micro-kernel rows
constexpr int64_t kNr = 16;    // micro-kernel columns
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

typedef float VecF4 __attribute__((vector_size(16)));
typedef float VecF8 __attribute__((vector_size(32)));
typedef float VecF16 __attribute__((vector_size(64)));

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

template <typename V>
TS_INLINE V load_vec(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename V>
TS_INLINE void store_vec(float* p, const V& v) {
  std::memcpy(p, &v, sizeof v);
}

// C[4 x 16] (row stride ldc) += A[4 x K] (row stride lda) * B[K x 16] (row stride ldb); V is the
// vector type of the ISA (16 / lanes vectors per row of C, all in registers).
template <typename V>
TS_INLINE void micro_4x16(const float* __restrict A, int64_t lda, const float* __restrict B, int64_t ldb, int64_t K,
                          float* __restrict C, int64_t ldc) {
  constexpr int W = sizeof(V) / sizeof(float), NV = kNr / W;
  V c[kMr][NV];
#pragma GCC unroll 4
  for (int i = 0; i < kMr; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) c[i][v] = load_vec<V>(C + i * ldc + v * W);
  for (int64_t k = 0; k < K; ++k) {
    V b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = load_vec<V>(B + k * ldb + v * W);
#pragma GCC unroll 4
    for (int i = 0; i < kMr; ++i) {
      const float a = A[i * lda + k];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[i][v] += a * b[v];
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < kMr; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) store_vec<V>(C + i * ldc + v * W, c[i][v]);
}

// 2^x for x <= 0 (-inf -> 0; below -127 -> 0): x = k + f with k integer, |f| <= 1/2, and 2^f by its
// degree-7 Taylor polynomial (error < 1e-8). T is float or a vector of floats (GCC vector type): the
// same operations in the same order on every lane, so each lane's bits are the scalar function's
// (the row loop over the scalar function stayed unvectorised: a quarter of a decode step's attention).
template <typename T>
TS_INLINE T exp2_neg(T x) {
  const T lo = T{} - 127.0f;
  x = x < lo ? lo : x;
  const T k = (x + 12582912.0f) - 12582912.0f;  // round to nearest integer (1.5 * 2^23 trick)
  const T f = x - k;
  T p = T{} + 1.525273380405984e-05f;
  p = p * f + 1.5403530393381606e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.618129107628477e-03f;
  p = p * f + 5.550410866482158e-02f;
  p = p * f + 2.402265069591007e-01f;
  p = p * f + 6.931471805599453e-01f;
  p = p * f + 1.0f;
  T two_k;  // 2^k; k = -127 gives +0
  if constexpr (std::is_same_v<T, float>) {
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    std::memcpy(&two_k, &bits, sizeof two_k);
  } else {
    typedef int32_t VecI __attribute__((vector_size(sizeof(T))));
    const VecI bits = (__builtin_convertvector(k, VecI) + 127) << 23;
    std::memcpy(&two_k, &bits, sizeof two_k);
  }
  return p * two_k;
}

// The largest of p[0..n) (-inf for n = 0). Every order gives the same maximum; 16 running maxima
// let the loop vectorise (a single running maximum is a chain the compiler keeps scalar).
TS_INLINE float row_max(const float* p, int64_t n) {
  float mx[16];
  for (int j = 0; j < 16; ++j) mx[j] = kNegInf;
  int64_t t = 0;
  for (; t + 16 <= n; t += 16)
    for (int j = 0; j < 16; ++j) mx[j] = std::max(mx[j], p[t + j]);
  for (; t < n; ++t) mx[0] = std::max(mx[0], p[t]);
  float out = mx[0];
  for (int j = 1; j < 16; ++j) out = std::max(out, mx[j]);
  return out;
}

// bf16_products: q and P rounded to bfloat16 (to nearest, ties to even), and every value read as a
// bfloat16 value; a value below 2^-50 in magnitude reads as +0. Products of two bfloat16 values are exact in
// float32, so the float32 kernels' multiply-then-add over these values and vdpbf16ps's fused
// multiply-adds (the odd element of a pair first, operands packed so that this is the earlier one) give
// the same bits. With every nonzero operand at least 2^-50 in magnitude each product is a multiple of
// 2^-114 and so is every running sum (see linear.cpp's dot-product kernel): no denormal arises for vdpbf16ps to flush.
// kBf16MinExp (tree_attention.h): the biased float32 exponent of 2^-50

TS_INLINE float bf16_round(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  if ((u & 0x7FFFFFFFu) < (kBf16MinExp << 23)) u = 0;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

// bf16_round on every lane of a GCC vector of floats (the same operations, so the same bits)
template <typename V>
TS_INLINE V bf16_round_vec(V x) {
  typedef uint32_t VU __attribute__((vector_size(sizeof(V))));
  VU u;
  std::memcpy(&u, &x, sizeof u);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  const VU keep = (VU)((u & 0x7FFFFFFFu) >= (kBf16MinExp << 23));
  u &= keep;
  V r;
  std::memcpy(&r, &u, sizeof r);
  return r;
}

// A widened bfloat16 value as bf16_products reads it (below 2^-50 in magnitude: +0)
TS_INLINE float bf16_flush(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7FFFFFFFu) < (kBf16MinExp << 23)) u = 0;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

// Where pack_values_bf16 puts dimension d (of a multiple-of-32 head dimension) in a packed value row,
// and so where the vdpbf16ps PV product leaves it in O: within each block of 32, unpacklo_epi16 gives
// the low 4 dimensions of each 8 (positions 0-15), unpackhi_epi16 the high 4 (16-31).
TS_INLINE int64_t dot_dim_pos(int64_t d) {
  const int64_t e = d % 32, lane = e / 8, w = e % 8;
  return d - e + (w < 4 ? 4 * lane + w : 16 + 4 * lane + w - 4);
}

// bfloat16 bits of a float32 that is a bfloat16 value
TS_INLINE uint32_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u >> 16;
}

struct Args {
  const void* q;  // [B, n, Hq, D], last dim contiguous
  int64_t qs0, qs1, qs2;
  const void* k;  // [B, Hkv, S, D], last dim contiguous
  const void* v;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;
  const int64_t* cache_len;  // [B]
  const int64_t* mask;       // [B, n]
  void* out;                 // [B, n, Hq, D] contiguous
  float* lse;                // [B, Hq, n] contiguous, or nullptr
  int64_t n, Hq, G, D, Dp;
  float scale_log2;
  bool include_prefix;
  int64_t window;        // 0, or the sliding window (positions)
  float softcap_log2;    // 0, or the logit soft-cap in log2 units (cap * log2(e))
  const int64_t* depth;  // [B, n]: each new token's depth in its tree (window > 0 only)
  bool bf16;             // bf16_products (bfloat16 caches): q and P rounded, see bf16_round
  bool dot;              // bf16 with vdpbf16ps (the AVX-512 path on a CPU with AVX-512 BF16)
  bool flushed;          // bf16: the cache's writer made every value below 2^-50 in magnitude +0 already
                         // (the C++ layer loop's, kv_flushed): the reads skip that flush
  const int64_t* nodes;  // [B] or nullptr: row b's new tokens are its first nodes[b] (see tree_attention_cpu)
};

// Per-item buffers (float32): Q and O [rows, Dp], S / P [rows, kTile], the key tile transposed
// [Dp, kTile], the value tile [kTile, Dp], running max and sum [rows].
// Kept per thread between calls (no allocation per layer once sized). kt and v only ever hold
// finite values (zeros, then widened keys / values), which is all their unused columns need.
// s_all: every tile's scores from pass 1, reused by pass 2 when they fit (kScoreCap floats).
constexpr int64_t kScoreCap = int64_t{1} << 20;

struct Scratch {
  std::vector<float> q, o, kt, v, m, l, s_all;
  std::vector<uint32_t> qp, pp;  // dot: q [rows, Dp / 2] and a tile's P [rows, kTile / 2] as bfloat16 pairs
  void reset(int64_t rows, int64_t Dp, int64_t tiles, bool dot) {
    q.assign(rows * Dp, 0.f);
    if (dot) {
      qp.assign(rows * Dp / 2, 0u);
      if (static_cast<int64_t>(pp.size()) < rows * kTile / 2) pp.resize(rows * kTile / 2, 0u);
    }
    o.assign(rows * Dp, 0.f);
    if (static_cast<int64_t>(kt.size()) < Dp * kTile) kt.resize(Dp * kTile, 0.f);
    if (static_cast<int64_t>(v.size()) < kTile * Dp) v.resize(kTile * Dp, 0.f);
    m.assign(rows, kNegInf);
    l.assign(rows, 0.f);
    const int64_t keep = std::max<int64_t>(1, rows * kTile * tiles <= kScoreCap ? tiles : 1);
    if (static_cast<int64_t>(s_all.size()) < rows * kTile * keep) s_all.resize(rows * kTile * keep, 0.f);
  }
};

#ifdef TS_ATTN_X86
// kt[d * ldt + t] = k[t * ldk + d] for t < nk, d < D (nk and D multiples of 8): a key tile widened
// to float32 and transposed in 8 x 8 blocks in registers (unpack pairs, shuffle quads, swap 128-bit
// halves). Moves
// values only: the bits are the scalar loop's. Not inlined: one call per tile, from the AVX2 and
// AVX-512 kernels (an always-inlined target function cannot be inlined into the ISA-neutral
// attend_rows that they instantiate).
// 8 consecutive cache elements widened to float32 (exactly: float16 and bfloat16 values are floats).
template <typename KV>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256 load8_avx2(const KV* p) {
  if constexpr (std::is_same_v<KV, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<KV, c10::Half>) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
}

template <typename KV>
__attribute__((target("avx2,fma,f16c"), noinline)) void transpose_tile_avx2(const KV* k, int64_t ldk, int64_t nk,
                                                                           int64_t D, float* kt, int64_t ldt) {
  for (int64_t t0 = 0; t0 < nk; t0 += 8)
    for (int64_t d = 0; d < D; d += 8) {
      const KV* src = k + t0 * ldk + d;
      float* dst = kt + d * ldt + t0;
      __m256 r[8], t[8], u[8];
      for (int i = 0; i < 8; ++i) r[i] = load8_avx2(src + i * ldk);
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);      // a0 b0 a1 b1 | a4 b4 a5 b5
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);  // a2 b2 a3 b3 | a6 b6 a7 b7
      }
      for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);      // a0 b0 c0 d0 | a4 b4 c4 d4
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);  // a1 b1 c1 d1 | a5 b5 c5 d5
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
      }
      for (int j = 0; j < 4; ++j) {
        _mm256_storeu_ps(dst + j * ldt, _mm256_permute2f128_ps(u[j], u[j + 4], 0x20));
        _mm256_storeu_ps(dst + (j + 4) * ldt, _mm256_permute2f128_ps(u[j], u[j + 4], 0x31));
      }
    }
}

// vt[t * ldv + d] = v[t * lds + d] for t < nk, d < D (D a multiple of 8): a 16-bit value tile widened.
template <typename KV>
__attribute__((target("avx2,fma,f16c"), noinline)) void widen_tile_avx2(const KV* v, int64_t lds, int64_t nk,
                                                                       int64_t D, float* vt, int64_t ldv) {
  for (int64_t t = 0; t < nk; ++t)
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(vt + t * ldv + d, load8_avx2(v + t * lds + d));
}

// ---- bf16_products with vdpbf16ps (AVX-512 BF16). A dword of a packed operand holds two bfloat16
// values, the earlier one (d, or key t) in its high half: vdpbf16ps adds the high half's product first,
// so each lane sums in the float32 kernels' order. Only called where bf16_dot() holds (a.dot).
#define TS_ATTN_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c"), noinline))
#define TS_ATTN_BF16_INL __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c"), always_inline)) inline

// 32 bfloat16 values with those below 2^-50 in magnitude made +0
TS_ATTN_BF16_INL __m512i flush32(__m512i w) {
  const __mmask32 tiny = _mm512_cmplt_epu16_mask(_mm512_and_si512(w, _mm512_set1_epi16(0x7FFF)),
                                                 _mm512_set1_epi16(static_cast<short>(kBf16MinExp << 7)));
  return _mm512_maskz_mov_epi16(~tiny, w);
}

// out[j] = dword j of every r[i] (a 16 x 16 transpose of dwords)
TS_ATTN_BF16_INL void transpose16(const __m512i* r, __m512i* out) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // u[4g + c], lane L: rows 4g .. 4g + 3 of column 4L + c
    u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    out[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    out[8 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    out[4 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    out[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// 32 bfloat16 values as bf16_products reads them: flushed (flush32), or as they are when the cache's
// writer flushed them already (Args::flushed)
template <bool Flush>
TS_ATTN_BF16_INL __m512i load32(const c10::BFloat16* p) {
  const __m512i w = _mm512_loadu_si512(p);
  if constexpr (Flush) return flush32(w);
  return w;
}

// kp[p * kTile + t] = (k[t][2p] << 16) | k[t][2p + 1] for t < nkp (keys >= nk: 0), p < D / 2; k: bfloat16
// rows of stride ldk; D % 32 == 0
template <bool Flush>
TS_ATTN_BF16 void pack_keys_bf16(const c10::BFloat16* k, int64_t ldk, int64_t nk, int64_t D, uint32_t* kp) {
  const int64_t nkp = round_up(nk, 16);
  for (int64_t t0 = 0; t0 < nkp; t0 += 16)
    for (int64_t p0 = 0; p0 < D / 2; p0 += 16) {
      __m512i r[16], out[16];
      for (int i = 0; i < 16; ++i)
        r[i] = t0 + i < nk ? _mm512_rol_epi32(load32<Flush>(k + (t0 + i) * ldk + 2 * p0), 16)
                           : _mm512_setzero_si512();
      transpose16(r, out);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(kp + (p0 + j) * kTile + t0, out[j]);
    }
}

// vp[j * Dp + d + pos(e)] = (v[2j][d + e] << 16) | v[2j + 1][d + e] for 2j < nk (a key >= nk: 0), each block of
// 32 dimensions d in the order unpacklo / unpackhi_epi16 leave it (pos below: one instruction a register,
// where an in-order interleave took vpermt2w's three): the PV products then hold the dimensions in that
// order too, each dimension's sum the same, and the output is read back through pos (dot_dim_pos).
template <bool Flush>
TS_ATTN_BF16 void pack_values_bf16(const c10::BFloat16* v, int64_t ldv, int64_t nk, int64_t D, int64_t Dp,
                                   uint32_t* vp) {
  for (int64_t j = 0; 2 * j < nk; ++j)
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i a = load32<Flush>(v + 2 * j * ldv + d);
      const __m512i b = 2 * j + 1 < nk ? load32<Flush>(v + (2 * j + 1) * ldv + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + j * Dp + d, _mm512_unpacklo_epi16(b, a));
      _mm512_storeu_si512(vp + j * Dp + d + 16, _mm512_unpackhi_epi16(b, a));
    }
}

// pp[r * (kTile / 2) + j] = (P[r][2j] << 16) | P[r][2j + 1] (bfloat16 bits of the rounded probabilities
// s[r * kTile + t], t < nk; a key >= nk: 0), rows r < rows
TS_ATTN_BF16 void pack_probs_bf16(const float* s, int64_t rows, int64_t nk, uint32_t* pp) {
  // the high words of dwords 2j (earlier key: out high half) and 2j + 1 (low half) of 32 floats
  alignas(64) static const uint16_t idx[32] = {3, 1, 7, 5, 11, 9, 15, 13, 19, 17, 23, 21, 27, 25, 31, 29,
                                               35, 33, 39, 37, 43, 41, 47, 45, 51, 49, 55, 53, 59, 57, 63, 61};
  const __m512i ix = _mm512_load_si512(idx);
  for (int64_t r = 0; r < rows; ++r) {
    const float* srow = s + r * kTile;
    uint32_t* prow = pp + r * (kTile / 2);
    for (int64_t t = 0; t < nk; t += 32) {
      const int64_t left = nk - t;
      const __mmask16 m0 = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
      const __mmask16 m1 = left >= 32 ? 0xFFFF : left <= 16 ? 0 : static_cast<__mmask16>((1u << (left - 16)) - 1);
      const __m512i a = _mm512_castps_si512(_mm512_maskz_loadu_ps(m0, srow + t));
      const __m512i b = _mm512_castps_si512(_mm512_maskz_loadu_ps(m1, srow + t + 16));
      _mm512_storeu_si512(prow + t / 2, _mm512_permutex2var_epi16(a, ix, b));
    }
  }
}

// s[r * kTile + c] = sum over p of the pairs qp[r * ldq + p] . kp[p * kTile + c] for rows r in
// [rb, rb + MR), columns c < 16 * NB, each lane from +0 in the order of d
template <int NB, int MR>
TS_ATTN_BF16_INL void dot_scores_rows(const uint32_t* qp, int64_t ldq, const uint32_t* kp, int64_t D2, int64_t rb,
                                      float* s) {
  __m512 acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < D2; ++p) {
    __m512bh kv[NB];
    for (int b = 0; b < NB; ++b) kv[b] = (__m512bh)_mm512_loadu_si512(kp + p * kTile + 16 * b);
    for (int r = 0; r < MR; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[(rb + r) * ldq + p]));
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], qb, kv[b]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(s + (rb + r) * kTile + 16 * b, acc[r][b]);
}

// The scores of rows r < rows, four at a time, then the last 1-3 (a decode step's GQA group of 3
// computes 3 rows, not 4: each lane's sum is the same whatever rows share the block)
template <int NB>
TS_ATTN_BF16 void dot_scores(const uint32_t* qp, int64_t ldq, const uint32_t* kp, int64_t D2, int64_t rows, float* s) {
  int64_t rb = 0;
  for (; rb + 4 <= rows; rb += 4) dot_scores_rows<NB, 4>(qp, ldq, kp, D2, rb, s);
  switch (rows - rb) {
    case 3: dot_scores_rows<NB, 3>(qp, ldq, kp, D2, rb, s); break;
    case 2: dot_scores_rows<NB, 2>(qp, ldq, kp, D2, rb, s); break;
    case 1: dot_scores_rows<NB, 1>(qp, ldq, kp, D2, rb, s); break;
    default: break;
  }
}

// o[r * Dp + d] += sum over pairs j < np of pp[r * ldp + j] . vp[j * Dp + d], key order; rows r in
// [rb, rb + MR), d in [c, c + 16 NB)
template <int NB, int MR>
TS_ATTN_BF16_INL void dot_pv_block(const uint32_t* pp, int64_t ldp, const uint32_t* vp, int64_t np, int64_t Dp,
                                   int64_t rb, int64_t c, float* o) {
  __m512 acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_loadu_ps(o + (rb + r) * Dp + c + 16 * b);
  for (int64_t j = 0; j < np; ++j) {
    __m512bh vv[NB];
    for (int b = 0; b < NB; ++b) vv[b] = (__m512bh)_mm512_loadu_si512(vp + j * Dp + c + 16 * b);
    for (int r = 0; r < MR; ++r) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[(rb + r) * ldp + j]));
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], pb, vv[b]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(o + (rb + r) * Dp + c + 16 * b, acc[r][b]);
}

template <int MR>
TS_ATTN_BF16_INL void dot_pv_rows(const uint32_t* pp, int64_t ldp, const uint32_t* vp, int64_t np, int64_t D,
                                  int64_t Dp, int64_t rb, float* o) {
  for (int64_t c = 0; c < D; c += 64) {
    switch (std::min<int64_t>(4, (D - c) / 16)) {
      case 4: dot_pv_block<4, MR>(pp, ldp, vp, np, Dp, rb, c, o); break;
      case 3: dot_pv_block<3, MR>(pp, ldp, vp, np, Dp, rb, c, o); break;
      case 2: dot_pv_block<2, MR>(pp, ldp, vp, np, Dp, rb, c, o); break;
      default: dot_pv_block<1, MR>(pp, ldp, vp, np, Dp, rb, c, o); break;
    }
  }
}

// O += P V for rows r < rows, four at a time, then the last 1-3 (as dot_scores)
TS_ATTN_BF16 void dot_pv(const uint32_t* pp, int64_t ldp, const uint32_t* vp, int64_t np, int64_t D, int64_t Dp,
                         int64_t rows, float* o) {
  int64_t rb = 0;
  for (; rb + 4 <= rows; rb += 4) dot_pv_rows<4>(pp, ldp, vp, np, D, Dp, rb, o);
  switch (rows - rb) {
    case 3: dot_pv_rows<3>(pp, ldp, vp, np, D, Dp, rb, o); break;
    case 2: dot_pv_rows<2>(pp, ldp, vp, np, D, Dp, rb, o); break;
    case 1: dot_pv_rows<1>(pp, ldp, vp, np, D, Dp, rb, o); break;
    default: break;
  }
}
#undef TS_ATTN_BF16
#undef TS_ATTN_BF16_INL
#endif

// One key tile's scores for rows [r0, r0 + rows) (Rp padded): widen the keys transposed into kt, S = Q K^T
// in log2 units, then the soft-cap, the tree mask and the sliding window. A function, not a lambda:
// a lambda's body is its own function and does not take the target ISA of the kernel it sits in
// (GCC compiled it for the baseline ISA, emulating the vector types: the AVX2 path ran 3x slower
// than the scalar one), while an always-inlined function does.
template <typename KV, typename V>
TS_INLINE void tile_scores_into(const Args& a, const KV* kb, const float* q, const uint32_t* qp, float* kt,
                                const int64_t* mask, const int64_t* depth, int64_t L, int64_t r0, int64_t rows,
                                int64_t Rp, int64_t p0, int64_t nk, float* s) {
  const int64_t D = a.D, Dp = a.Dp, G = a.G;
  const int64_t nkp = round_up(nk, kNr);
#ifdef TS_ATTN_X86
  if (a.dot) {  // bf16_products with vdpbf16ps: the keys packed in pairs, transposed (columns >= nk: 0)
    uint32_t* kp = reinterpret_cast<uint32_t*>(kt);
    const auto* kbf = reinterpret_cast<const c10::BFloat16*>(kb) + p0 * a.ks2;
    if (a.flushed)
      pack_keys_bf16<false>(kbf, a.ks2, nk, D, kp);
    else
      pack_keys_bf16<true>(kbf, a.ks2, nk, D, kp);
    switch (nkp / kNr) {
      case 4: dot_scores<4>(qp, Dp / 2, kp, D / 2, rows, s); break;
      case 3: dot_scores<3>(qp, Dp / 2, kp, D / 2, rows, s); break;
      case 2: dot_scores<2>(qp, Dp / 2, kp, D / 2, rows, s); break;
      default: dot_scores<1>(qp, Dp / 2, kp, D / 2, rows, s); break;
    }
  } else
#endif
  {
  // Widen the tile, transposed; columns >= nk of kt keep finite stale values (never used).
  int64_t t0 = 0;
#ifdef TS_ATTN_X86
  if constexpr (sizeof(V) >= 32) {  // AVX2 / AVX-512: 8 x 8 blocks in registers
    if (D % 8 == 0) {
      t0 = nk / 8 * 8;
      if (t0 > 0) transpose_tile_avx2(kb + p0 * a.ks2, a.ks2, t0, D, kt, kTile);
    }
  }
#endif
  for (int64_t t = t0; t < nk; ++t) {
    const KV* kr = kb + (p0 + t) * a.ks2;
    for (int64_t d = 0; d < D; ++d) kt[d * kTile + t] = static_cast<float>(kr[d]);
  }
  if (a.bf16 && !a.flushed)
    for (int64_t d = 0; d < D; ++d)
      for (int64_t t = 0; t < nk; ++t) kt[d * kTile + t] = bf16_flush(kt[d * kTile + t]);
  // S = Q K^T (log2 units), then the tree mask
  std::fill(s, s + Rp * kTile, 0.f);
  for (int64_t rb = 0; rb < Rp; rb += kMr)
    for (int64_t c = 0; c < nkp; c += kNr) micro_4x16<V>(q + rb * Dp, Dp, kt + c, kTile, D, s + rb * kTile + c, kTile);
  }
  if (a.softcap_log2 > 0.f) {  // Gemma 2: s = cap * tanh(s / cap), in log2 units
    const float cap = a.softcap_log2, inv = 1.f / a.softcap_log2;
    for (int64_t rr = 0; rr < rows; ++rr)
      for (int64_t t = 0; t < nk; ++t) s[rr * kTile + t] = cap * std::tanh(s[rr * kTile + t] * inv);
  }
  if (p0 + nk > L)
    for (int64_t rr = 0; rr < rows; ++rr) {
      float* srow = s + rr * kTile;
      const uint64_t bits = static_cast<uint64_t>(mask[(r0 + rr) / G]);
      for (int64_t t = std::max<int64_t>(0, L - p0); t < nk; ++t)
        if (!((bits >> (p0 + t - L)) & 1)) srow[t] = kNegInf;
    }
  if (depth != nullptr)
    for (int64_t rr = 0; rr < rows; ++rr) {
      float* srow = s + rr * kTile;
      const int64_t lo = L + depth[(r0 + rr) / G] + 1 - a.window;  // the first position attended
      if (p0 >= lo && p0 + nk <= L) continue;  // a prefix tile inside the window
      for (int64_t t = 0; t < nk; ++t) {
        const int64_t p = p0 + t, pos = p < L ? p : L + depth[p - L];
        if (pos < lo) srow[t] = kNegInf;
      }
    }
}

// Prefetch rows [p0, p1) of a key or value cache (row stride ld elements, D used): a tile's work runs
// while the next tile's rows arrive. A decode step's attention (few query rows per kv head: a handful
// of multiply-adds per loaded value) read its cache at ~5 GB/s on a 2-vCPU Zen 3 that streams ~15 GB/s
// a thread; its gain alone was inside that machine's noise (bench/results/2026-11-30-attention-16bit-kv.md).
template <typename T>
TS_INLINE void prefetch_rows(const T* base, int64_t ld, int64_t p0, int64_t p1, int64_t D) {
  const int64_t bytes = D * static_cast<int64_t>(sizeof(T));
  for (int64_t p = p0; p < p1; ++p) {
    const char* row = reinterpret_cast<const char*>(base + p * ld);
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(row + o, 0, 3);
  }
}

// Rows [r0, r1) of kv head hk of batch row b. sc is sized for round_up(r1 - r0, kMr) rows. q and out
// are T, the caches KV (T, or 16-bit caches behind float32 queries).
template <typename T, typename KV, typename V>
TS_INLINE void attend_rows(const Args& a, int64_t b, int64_t hk, int64_t r0, int64_t r1, Scratch& sc) {
  const int64_t rows = r1 - r0, Rp = round_up(rows, kMr), D = a.D, Dp = a.Dp, G = a.G, n = a.n;
  float *q = sc.q.data(), *o = sc.o.data(), *kt = sc.kt.data(), *vt = sc.v.data();
  float *m = sc.m.data(), *l = sc.l.data();
  const T* qb = static_cast<const T*>(a.q) + b * a.qs0;
  for (int64_t rr = 0; rr < rows; ++rr) {
    const int64_t r = r0 + rr;
    const T* src = qb + (r / G) * a.qs1 + (hk * G + r % G) * a.qs2;
    for (int64_t d = 0; d < D; ++d) q[rr * Dp + d] = static_cast<float>(src[d]) * a.scale_log2;
    if (a.bf16)
      for (int64_t d = 0; d < D; ++d) q[rr * Dp + d] = bf16_round(q[rr * Dp + d]);
    if (a.dot)
      for (int64_t p = 0; p < D / 2; ++p)
        sc.qp[rr * (Dp / 2) + p] = (bf16_bits(q[rr * Dp + 2 * p]) << 16) | bf16_bits(q[rr * Dp + 2 * p + 1]);
  }
  const int64_t L = a.cache_len[b];
  int64_t start = a.include_prefix ? 0 : L;
  const int64_t end = L + (a.nodes != nullptr ? a.nodes[b] : n);  // padding nodes' keys: never attended
  // Sliding window: query i (position L + depth_i) attends keys at positions >= lo_i = L + depth_i +
  // 1 - window; the prefix before the smallest lo_i is skipped, the rest masked key by key (masked
  // keys add exact zeros, so skipping and masking give the same bits).
  const int64_t* depth = a.window > 0 ? a.depth + b * n : nullptr;
  if (depth != nullptr) {
    int64_t lo = end;
    for (int64_t rr = 0; rr < rows; ++rr) lo = std::min(lo, L + depth[(r0 + rr) / G] + 1 - a.window);
    start = std::max(start, std::min(lo, L));
  }
  const KV* kb = static_cast<const KV*>(a.k) + b * a.ks0 + hk * a.ks1;
  const KV* vb = static_cast<const KV*>(a.v) + b * a.vs0 + hk * a.vs1;
  const int64_t* mask = a.mask + b * n;
  // Two passes over the key tiles, so that a row's result depends only on the sequence of keys it
  // attends, not on where they sit or on the tiling: pass 1 finds the row's maximum score (exact,
  // order-free); pass 2 takes P = 2^(S - max), adds P to the row sum and P V to the output one key
  // after another in key order. Masked keys add exact zeros. A token verified inside a tree (its
  // ancestors scattered among siblings) thus gets the bits it gets decoded alone after its path.
  // The scores are recomputed in pass 2 (identically) rather than stored.
  // Pass 1 keeps every tile's scores when they fit (s_all), so pass 2 reads them back instead of
  // recomputing them: the same values, half the work.
  const int64_t tiles = (end - start + kTile - 1) / kTile;
  const bool keep_scores = static_cast<int64_t>(sc.s_all.size()) >= Rp * kTile * tiles;
  float* s_all = sc.s_all.data();
  auto tile_scores = [&](int64_t p0) { return keep_scores ? s_all + (p0 - start) / kTile * Rp * kTile : s_all; };
  for (int64_t p0 = start; p0 < end; p0 += kTile) {
    const int64_t nk = std::min(kTile, end - p0);
    float* s = tile_scores(p0);
    tile_scores_into<KV, V>(a, kb, q, sc.qp.data(), kt, mask, depth, L, r0, rows, Rp, p0, nk, s);
    for (int64_t rr = 0; rr < rows; ++rr) m[rr] = std::max(m[rr], row_max(s + rr * kTile, nk));
  }
  // float32 values with D a multiple of the micro-kernel width are read in place from the cache
  constexpr bool kF32 = std::is_same_v<KV, float>;
  const bool v_in_place = kF32 && Dp == D;
  for (int64_t p0 = start; p0 < end; p0 += kTile) {
    const int64_t nk = std::min(kTile, end - p0);
    float* s = tile_scores(p0);
    if (!keep_scores) tile_scores_into<KV, V>(a, kb, q, sc.qp.data(), kt, mask, depth, L, r0, rows, Rp, p0, nk, s);
    const float* vsrc = vt;
    int64_t ldv = Dp;
    if (a.dot) {
      // packed in pass 2's PV below
    } else if (v_in_place) {
      vsrc = reinterpret_cast<const float*>(vb + p0 * a.vs2);
      ldv = a.vs2;
    } else {
      int64_t d0 = 0;
#ifdef TS_ATTN_X86
      if constexpr (sizeof(V) >= 32) {
        d0 = D / 8 * 8;
        if (d0 > 0) widen_tile_avx2(vb + p0 * a.vs2, a.vs2, nk, d0, vt, Dp);
      }
#endif
      for (int64_t t = 0; t < nk; ++t) {
        const KV* vr = vb + (p0 + t) * a.vs2;
        for (int64_t d = d0; d < D; ++d) vt[t * Dp + d] = static_cast<float>(vr[d]);
      }
      if (a.bf16 && !a.flushed)
        for (int64_t t = 0; t < nk; ++t)
          for (int64_t d = 0; d < D; ++d) vt[t * Dp + d] = bf16_flush(vt[t * Dp + d]);
    }
    for (int64_t rr = 0; rr < rows; ++rr) {
      float* srow = s + rr * kTile;
      const float mr = m[rr];  // a local: the loop below vectorises (m could alias srow)
      if (mr == kNegInf) {  // the row attends nothing
        std::fill(srow, srow + nk, 0.f);
        continue;
      }
      constexpr int64_t W = sizeof(V) / sizeof(float);
      int64_t t = 0;
      if (a.bf16) {  // P rounded to bfloat16 (the row sum adds the rounded values)
        for (; t + W <= nk; t += W) store_vec<V>(srow + t, bf16_round_vec<V>(exp2_neg<V>(load_vec<V>(srow + t) - mr)));
        for (; t < nk; ++t) srow[t] = bf16_round(exp2_neg(srow[t] - mr));
      } else {
        for (; t + W <= nk; t += W) store_vec<V>(srow + t, exp2_neg<V>(load_vec<V>(srow + t) - mr));
        for (; t < nk; ++t) srow[t] = exp2_neg(srow[t] - mr);
      }
    }
    // l += P key by key, each row's sum in key order; eight rows' sums at a time, independent chains
    // in registers (with l[rr] += ... in the inner loop every add went through memory: l may alias s)
    {
      int64_t rr = 0;
      for (; rr + 8 <= rows; rr += 8) {
        float acc[8];
        for (int i = 0; i < 8; ++i) acc[i] = l[rr + i];
        for (int64_t t = 0; t < nk; ++t)
          for (int i = 0; i < 8; ++i) acc[i] += s[(rr + i) * kTile + t];
        for (int i = 0; i < 8; ++i) l[rr + i] = acc[i];
      }
      for (; rr < rows; ++rr) {
        float acc = l[rr];
        for (int64_t t = 0; t < nk; ++t) acc += s[rr * kTile + t];
        l[rr] = acc;
      }
    }
    // O += P V, key by key (padding rows of S hold the scores of zero queries, 0: never written out)
#ifdef TS_ATTN_X86
    if (a.dot) {  // P and V packed in pairs of keys (a key >= nk: 0)
      const int64_t np = (nk + 1) / 2;
      uint32_t* pp = sc.pp.data();
      pack_probs_bf16(s, rows, nk, pp);
      uint32_t* vp = reinterpret_cast<uint32_t*>(vt);
      const auto* vbf = reinterpret_cast<const c10::BFloat16*>(vb) + p0 * a.vs2;
      if (a.flushed)
        pack_values_bf16<false>(vbf, a.vs2, nk, D, Dp, vp);
      else
        pack_values_bf16<true>(vbf, a.vs2, nk, D, Dp, vp);
      dot_pv(pp, kTile / 2, vp, np, D, Dp, rows, o);
      continue;
    }
#endif
    for (int64_t rb = 0; rb < Rp; rb += kMr)
      for (int64_t c = 0; c < Dp; c += kNr) micro_4x16<V>(s + rb * kTile, kTile, vsrc + c, ldv, nk, o + rb * Dp + c, Dp);
  }
  T* out = static_cast<T*>(a.out);
  for (int64_t rr = 0; rr < rows; ++rr) {
    const int64_t r = r0 + rr, i = r / G, h = hk * G + r % G;
    const float inv = l[rr] > 0.f ? 1.f / l[rr] : 0.f;
    T* dst = out + ((b * n + i) * a.Hq + h) * D;
    if (a.dot)  // O holds the dimensions in pack_values_bf16's order
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[rr * Dp + dot_dim_pos(d)] * inv);
    else
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[rr * Dp + d] * inv);
    if (a.lse != nullptr)
      a.lse[(b * a.Hq + h) * n + i] = l[rr] > 0.f ? (m[rr] + std::log2(l[rr])) * kLn2 : kNegInf;
  }
}

using AttendFn = void (*)(const Args&, int64_t, int64_t, int64_t, int64_t, Scratch&);

template <typename T, typename KV>
void attend_base(const Args& a, int64_t b, int64_t hk, int64_t r0, int64_t r1, Scratch& sc) {
  attend_rows<T, KV, VecF4>(a, b, hk, r0, r1, sc);
}

#ifdef TS_ATTN_X86
template <typename T, typename KV>
__attribute__((target("avx2,fma,f16c"))) void attend_avx2(const Args& a, int64_t b, int64_t hk, int64_t r0,
                                                          int64_t r1, Scratch& sc) {
  attend_rows<T, KV, VecF8>(a, b, hk, r0, r1, sc);
}

template <typename T, typename KV>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"))) void attend_avx512(
    const Args& a, int64_t b, int64_t hk, int64_t r0, int64_t r1, Scratch& sc) {
  attend_rows<T, KV, VecF16>(a, b, hk, r0, r1, sc);
}
#endif

template <typename T, typename KV = T>
AttendFn pick_attend() {
#ifdef TS_ATTN_X86
  switch (cpu_isa()) {  // csrc/cpu/isa.h: every path gives the same bits
    case Isa::kAvx512: return &attend_avx512<T, KV>;
    case Isa::kAvx2: return &attend_avx2<T, KV>;
    default: break;
  }
#endif
  return &attend_base<T, KV>;
}

}  // namespace

void tree_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& cache_len_in, const at::Tensor& tree_mask_in, double scale,
                        bool include_prefix, const at::Tensor& out, const std::optional<at::Tensor>& lse,
                        int64_t window, double softcap, bool bf16_products, const int64_t* nodes, bool kv_flushed) {
  const AttnDims d = check_tree_attention_args(q_in, k_cache, v_cache, cache_len_in, tree_mask_in, scale, out, lse,
                                               c10::DeviceType::CPU);
  TORCH_CHECK(window >= 0, "tree_attention: window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(softcap >= 0, "tree_attention: softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK(!bf16_products || (k_cache.scalar_type() == c10::kBFloat16 && q_in.scalar_type() != c10::kHalf),
              "tree_attention: bf16_products=True needs bfloat16 caches and float32 or bfloat16 q, got q ",
              q_in.scalar_type(), " over ", k_cache.scalar_type(), " caches");
  if (d.B == 0) return;
  const at::Tensor cache_len = cache_len_in.contiguous();
  const at::Tensor tree_mask = tree_mask_in.contiguous();
  const int64_t* len = cache_len.data_ptr<int64_t>();
  for (int64_t b = 0; b < d.B; ++b)
    TORCH_CHECK(len[b] >= 0 && len[b] + d.n <= d.S, "tree_attention: cache_len[", b, "] = ", len[b], " with n = ", d.n,
                " new tokens: needs 0 <= cache_len and cache_len + n <= S = ", d.S);
  const at::Tensor q = d.D == 1 ? q_in.contiguous() : q_in;  // D == 1 may have any last stride
  const at::Tensor kc = d.D == 1 ? k_cache.contiguous() : k_cache;
  const at::Tensor vc = d.D == 1 ? v_cache.contiguous() : v_cache;
  Args a{};
  a.q = q.data_ptr();
  a.qs0 = q.stride(0);
  a.qs1 = q.stride(1);
  a.qs2 = q.stride(2);
  a.k = kc.data_ptr();
  a.v = vc.data_ptr();
  a.ks0 = kc.stride(0);
  a.ks1 = kc.stride(1);
  a.ks2 = kc.stride(2);
  a.vs0 = vc.stride(0);
  a.vs1 = vc.stride(1);
  a.vs2 = vc.stride(2);
  a.cache_len = len;
  a.mask = tree_mask.data_ptr<int64_t>();
  a.out = out.data_ptr();
  a.lse = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  a.n = d.n;
  a.Hq = d.Hq;
  a.G = d.Hq / d.Hkv;
  a.D = d.D;
  a.Dp = round_up(d.D, kNr);
  a.scale_log2 = static_cast<float>(scale) * kLog2e;
  a.include_prefix = include_prefix;
  a.softcap_log2 = static_cast<float>(softcap * kLog2e);
  a.bf16 = bf16_products;
  a.dot = bf16_products && d.D % 32 == 0 && cpu_isa() == Isa::kAvx512 && bf16_dot();
  a.flushed = bf16_products && kv_flushed;
  if (nodes != nullptr)
    for (int64_t b = 0; b < d.B; ++b)
      TORCH_CHECK(nodes[b] >= 0 && nodes[b] <= d.n, "tree_attention: nodes[", b, "] = ", nodes[b], " must be in [0, ",
                  d.n, "]");
  a.nodes = nodes;
  // each new token's depth: the bits of its mask row (its ancestors and itself; bits >= n ignored), less one
  std::vector<int64_t> depth;
  if (window > 0) {
    depth.resize(d.B * d.n);
    const uint64_t keep = d.n >= 64 ? ~uint64_t{0} : (uint64_t{1} << d.n) - 1;
    for (int64_t i = 0; i < d.B * d.n; ++i)
      depth[i] = __builtin_popcountll(static_cast<uint64_t>(a.mask[i]) & keep) - 1;
    a.window = window;
    a.depth = depth.data();
  }
  AttendFn fn = nullptr;
  switch (q.scalar_type()) {
    case c10::kFloat:  // float32 queries over float32, float16 or bfloat16 caches
      fn = kc.scalar_type() == c10::kHalf       ? pick_attend<float, c10::Half>()
           : kc.scalar_type() == c10::kBFloat16 ? pick_attend<float, c10::BFloat16>()
                                                : pick_attend<float>();
      break;
    case c10::kBFloat16: fn = pick_attend<c10::BFloat16>(); break;
    default: fn = pick_attend<c10::Half>(); break;
  }
  // Split the rows of a (b, kv head) pair when the pairs do not share out evenly among the threads
  // (SmolLM2: 3 kv heads on 2 threads left one thread idle a third of a prefill's attention), into
  // chunks of at least 16 rows: the smallest count of chunks per pair that makes the items a
  // multiple of the threads.
  const int64_t units = d.B * d.Hkv, R = d.n * a.G;
  const int64_t threads = at::get_num_threads();
  int64_t chunk_rows = R;
  if (units % threads != 0) {
    int64_t want = 1;
    while ((units * want) % threads != 0 && want < threads) ++want;
    const int64_t chunks = std::min(want, (R + 15) / 16);
    chunk_rows = round_up((R + chunks - 1) / chunks, kMr);
  }
  const int64_t chunks = (R + chunk_rows - 1) / chunk_rows;
  int64_t max_keys = 0;
  for (int64_t b = 0; b < d.B; ++b) max_keys = std::max(max_keys, (include_prefix ? len[b] : 0) + d.n);
  const int64_t tiles = (max_keys + kTile - 1) / kTile;
  // The items go to the threads as they free up, longest first (work ~ keys x rows): batch rows of
  // different lengths split into equal counts left one thread waiting on the other. Each item is
  // computed alone, so the assignment does not change the bits.
  const int64_t items = units * chunks;
  thread_local std::vector<int64_t> order, work;  // the calling thread's, kept between calls
  order.resize(items);
  work.resize(items);
  // the rows of batch row b: its nodes' (padding nodes are skipped)
  const auto rows_of = [&](int64_t b) { return nodes != nullptr ? nodes[b] * a.G : R; };
  for (int64_t it = 0; it < items; ++it) {
    const int64_t b = it / (d.Hkv * chunks), c = it % chunks;
    const int64_t rows = std::max<int64_t>(0, std::min(rows_of(b), (c + 1) * chunk_rows) - c * chunk_rows);
    order[it] = it;
    work[it] = ((include_prefix ? len[b] : 0) + d.n + kTile) * round_up(rows, kMr);
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return work[x] > work[y]; });
  const int64_t* sorted = order.data();  // the workers' own thread_local `order` would be empty
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, items), 1, [&](int64_t, int64_t) {
    thread_local Scratch sc;
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < items;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t it = sorted[i];
      const int64_t b = it / (d.Hkv * chunks), hk = (it / chunks) % d.Hkv, c = it % chunks;
      const int64_t r0 = c * chunk_rows, r1 = std::min(rows_of(b), r0 + chunk_rows);
      if (r1 <= r0) continue;  // padding rows only
      sc.reset(round_up(r1 - r0, kMr), a.Dp, tiles, a.dot);
      fn(a, b, hk, r0, r1, sc);
    }
  });
}

}  // namespace turbospec

namespace {
// the op (its schema has no nodes: every row is a request's)
void tree_attention_op(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& cache_len, const at::Tensor& tree_mask, double scale, bool include_prefix,
                       const at::Tensor& out, const std::optional<at::Tensor>& lse, int64_t window, double softcap,
                       bool bf16_products) {
  turbospec::tree_attention_cpu(q, k_cache, v_cache, cache_len, tree_mask, scale, include_prefix, out, lse, window,
                                softcap, bf16_products);
}
}  // namespace

TORCH_LIBRARY_IMPL(turbospec, CPU, m) { m.impl("tree_attention", &tree_attention_op); }

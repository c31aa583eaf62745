// linear: y = x @ W^T (+ b) on CPU, weights in their storage format, one fixed reduction order.
//
// At batch 1 a decode step is a chain of matrix-vector products whose cost is reading W once; a
// verify pass adds a few rows. Weights stay as stored: float32, float16, bfloat16, or GGUF blocks
// (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K), dequantized in registers exactly as GGUF defines
// (every dequantized weight is the float32 value gguf's dequantize gives; the products d * q are
// exact in float32, so d * q + m is one rounding, the same whether fused or not).
//
// The reduction order is fixed: lane j (0..15) accumulates w[k] * x[k] for k = j, j+16, j+32, ...
// with fused multiply-adds in increasing k, then the 16 lanes are summed pairwise (j + 8, then + 4,
// + 2, + 1), then the bias is added. It does not depend on how many rows x has, on the thread split,
// on the instruction set or on the weight format's storage, so
//   * a verify pass over k+1 tokens computes for each token exactly what a one-token step computes;
//   * a quantized model computes exactly what the same model dequantized to float32 computes.
//
// Variants (picked per call; all give the same bits, tests/ops/test_linear.py):
//   scalar   every format, std::fma lane by lane (the baseline ISA)
//   avx2     fused: weights dequantized in registers; 4 weight rows x 1 input row, or (up to
//            kFusedRows input rows: 16, Q4_K 64) 1 weight row x passes of 2-4 input rows (Q4_0 /
//            Q4_1 / Q8_0 at 4-16 rows: passes of up to 8, half the lanes at a time); dense weights 2 x 3
//   panel    more than kFusedRows input rows and a block format: a block of weight rows is
//            dequantized once to float32 (L1/L2), then the dense kernel runs over all input rows
//   avx512   dense float32/bfloat16 weights (past 4 input rows and a long K, chunk by chunk of K),
//            and every block format at 1-16 input rows, dequantized in registers of 16 lanes (past
//            16 rows: the panel)
//   dpbf16   bfloat16 weights x bfloat16-valued inputs, 4+ rows, where the CPU has AVX-512 BF16:
//            vdpbf16ps, two of the same fused multiply-adds per lane (rows_dpbf16 says when)
// x: float32 / bfloat16 / float16 (widened exactly); y has x's dtype (rounded to nearest even).
#include "linear.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "gguf_blocks.h"
#include "isa.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TS_X86 1
#endif

namespace turbospec {
namespace {

constexpr int kLanes = 16;
constexpr int64_t kRowBlock = 4;   // weight rows per work item
constexpr int64_t kMaxRows = 64;   // input rows per pass (fewer for a long K: rows_per_pass; same order)
// Up to this many input rows quantized weights are dequantized in registers (once per pass of <= 4
// rows); past it, once per row block into a float32 panel. Q4_K, whose panel dequantization costs
// most, is 20-40 % faster fused at 24-64 rows on the AVX2 machine of bench/RESULTS.md (2026-11-25,
// 2 threads, 3 alternated rounds); Q5_K and Q6_K were slower fused past 16 rows and Q4_0 / Q4_1 /
// Q8_0 within the noise between two builds (about 10 %), so they keep 16. The AVX-512 kernels take
// 16 (kFusedRows512): on the AVX-512 machine Q4_K at 17-64 rows ran 1.2-2.8x faster through the
// panel than through the AVX2 fused kernel (2026-11-27).
template <int64_t F>
constexpr int64_t kFusedRows = F == kQ4_K ? 64 : 16;
constexpr int64_t kFusedRows512 = 16;

struct FormatInfo {
  int64_t block;  // weights per block
  int64_t bytes;  // bytes per block
  const char* name;
};

constexpr FormatInfo info_of(int64_t f) {
  switch (f) {
    case kF32: return {1, 4, "F32"};
    case kF16: return {1, 2, "F16"};
    case kBF16: return {1, 2, "BF16"};
    case kQ4_0: return {32, 18, "Q4_0"};
    case kQ4_1: return {32, 20, "Q4_1"};
    case kQ5_0: return {32, 22, "Q5_0"};
    case kQ8_0: return {32, 34, "Q8_0"};
    case kQ4_K: return {256, 144, "Q4_K"};
    case kQ5_K: return {256, 176, "Q5_K"};
    case kQ6_K: return {256, 210, "Q6_K"};
    case kQ4_0G: return {32, 18, "Q4_0G"};
    case kQ4_1G: return {32, 20, "Q4_1G"};
    case kQ5_0G: return {32, 22, "Q5_0G"};
    case kQ8_0G: return {32, 34, "Q8_0G"};
    case kQ4_0X: return {32, 18, "Q4_0X"};
    case kQ4_1X: return {32, 20, "Q4_1X"};
    case kQ5_0X: return {32, 22, "Q5_0X"};
    case kQ4_KX: return {256, 144, "Q4_KX"};
    case kQ8_0X: return {32, 34, "Q8_0X"};
    default: return {0, 0, nullptr};
  }
}

bool format_info(int64_t f, FormatInfo* out) {
  *out = info_of(f);
  return out->block != 0;
}

// Bytes of a row that hold `weights` weights (rounded down; at least 1): the kernels' prefetch step,
// row_bytes * weights / K, as a constant (a 64-bit division per kernel call cost ~8 % of a
// Q4_1 8-row pass; bench/RESULTS.md, run 18).
template <int64_t F>
constexpr int64_t bytes_for(int64_t weights) {
  return std::max<int64_t>(1, info_of(F).bytes * weights / info_of(F).block);
}

FormatInfo checked_info(int64_t f) {
  FormatInfo fi{};
  TORCH_CHECK(format_info(f, &fi), "linear: weight format ", f, " is not supported; supported (GGML type ids): ",
              "0 F32, 1 F16, 30 BF16, 2 Q4_0, 3 Q4_1, 6 Q5_0, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K, ",
              "1002 Q4_0G, 1003 Q4_1G, 1006 Q5_0G, 1008 Q8_0G, 2002 Q4_0X, 2003 Q4_1X, 2006 Q5_0X, 2008 Q8_0X, 2012 Q4_KX");
  return fi;
}

inline float combine_lanes(const float* s) {
  float t8[8], t4[4], t2[2];
  for (int j = 0; j < 8; ++j) t8[j] = s[j] + s[j + 8];
  for (int j = 0; j < 4; ++j) t4[j] = t8[j] + t8[j + 4];
  for (int j = 0; j < 2; ++j) t2[j] = t4[j] + t4[j + 2];
  return t2[0] + t2[1];
}

// ---------------------------------------------------------------------------------------------
// Scalar dequantization: the 16 weights of a row starting at element k (k % 16 == 0). left = K - k;
// dense formats may end in a partial group (the missing lanes are 0); block formats never do.
template <int64_t F>
inline void dequant16(const uint8_t* row, int64_t k, int64_t left, float* out) {
  const int64_t n = std::min<int64_t>(left, kLanes);
  if constexpr (F == kF32 || F == kF16 || F == kBF16) {
    for (int64_t j = 0; j < kLanes; ++j) {
      if (j >= n) { out[j] = 0.f; continue; }
      if constexpr (F == kF32) std::memcpy(&out[j], row + 4 * (k + j), 4);
      else if constexpr (F == kF16) out[j] = half_at(row + 2 * (k + j));
      else {
        uint16_t b;
        std::memcpy(&b, row + 2 * (k + j), 2);
        const uint32_t u = static_cast<uint32_t>(b) << 16;
        std::memcpy(&out[j], &u, 4);
      }
    }
  } else if constexpr (F == kQ4_0 || F == kQ4_1) {
    const uint8_t* b = row + (k >> 5) * (F == kQ4_0 ? 18 : 20);
    const float d = half_at(b);
    const uint8_t* qs = b + (F == kQ4_0 ? 2 : 4);
    const int sh = (k & 31) ? 4 : 0;
    if constexpr (F == kQ4_0) {
      for (int j = 0; j < 16; ++j) out[j] = d * static_cast<float>(((qs[j] >> sh) & 15) - 8);
    } else {
      const float m = half_at(b + 2);
      for (int j = 0; j < 16; ++j) out[j] = std::fma(d, static_cast<float>((qs[j] >> sh) & 15), m);
    }
  } else if constexpr (F == kQ5_0) {
    const uint8_t* b = row + (k >> 5) * 22;
    const float d = half_at(b);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const uint8_t* qs = b + 6;
    const int off = static_cast<int>(k & 31), sh = off ? 4 : 0;
    for (int j = 0; j < 16; ++j) {
      const int q = ((qs[j] >> sh) & 15) | (((qh >> (off + j)) & 1) << 4);
      out[j] = d * static_cast<float>(q - 16);
    }
  } else if constexpr (F == kQ8_0) {
    const uint8_t* b = row + (k >> 5) * 34;
    const float d = half_at(b);
    const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2) + (k & 31);
    for (int j = 0; j < 16; ++j) out[j] = static_cast<float>(qs[j]) * d;
  } else if constexpr (F == kQ4_K || F == kQ5_K) {
    const uint8_t* b = row + (k >> 8) * (F == kQ4_K ? 144 : 176);
    const int e0 = static_cast<int>(k & 255), sub = e0 >> 5, l0 = e0 & 31;
    int sc, mn;
    scale_min_k4(b + 4, sub, &sc, &mn);
    const float d1 = half_at(b) * static_cast<float>(sc), dm = half_at(b + 2) * static_cast<float>(mn);
    const uint8_t* qs = b + (F == kQ4_K ? 16 : 48) + 32 * (e0 >> 6) + l0;
    const int sh = (sub & 1) ? 4 : 0;
    for (int j = 0; j < 16; ++j) {
      int q = (qs[j] >> sh) & 15;
      if constexpr (F == kQ5_K) q |= ((b[16 + l0 + j] >> sub) & 1) << 4;
      out[j] = std::fma(d1, static_cast<float>(q), -dm);
    }
  } else {
    static_assert(F == kQ6_K, "unknown format");
    const uint8_t* b = row + (k >> 8) * 210;
    const int e0 = static_cast<int>(k & 255), half = e0 >> 7, e = e0 & 127;
    const float d1 = half_at(b + 208) * static_cast<float>(reinterpret_cast<const int8_t*>(b + 192)[e0 >> 4]);
    const uint8_t* ql = b + 64 * half + (e & 63);
    const uint8_t* qh = b + 128 + 32 * half + (e & 31);
    const int shl = (e >> 6) * 4, shh = (e >> 5) * 2;
    for (int j = 0; j < 16; ++j) {
      const int q = (((ql[j] >> shl) & 15) | (((qh[j] >> shh) & 3) << 4)) - 32;
      out[j] = d1 * static_cast<float>(q);
    }
  }
}

template <int64_t F>
void block_scalar(const uint8_t* const* wr, int64_t nw, const float* const* xr, int64_t nx, int64_t K,
                  float (*out)[kMaxRows], int64_t r0) {
  float acc[kRowBlock][kMaxRows][kLanes];
  std::memset(acc, 0, sizeof acc);
  float w[kLanes];
  for (int64_t k = 0; k < K; k += kLanes) {
    const int64_t n = std::min<int64_t>(K - k, kLanes);
    for (int64_t i = 0; i < nw; ++i) {
      dequant16<F>(wr[i], k, K - k, w);
      for (int64_t r = 0; r < nx; ++r)
        for (int64_t j = 0; j < n; ++j) acc[i][r][j] = std::fma(w[j], xr[r][k + j], acc[i][r][j]);
    }
  }
  for (int64_t i = 0; i < nw; ++i)
    for (int64_t r = 0; r < nx; ++r) out[i][r0 + r] = combine_lanes(acc[i][r]);
}

#ifdef TS_X86
#define TS_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

// combine_lanes in registers: the same additions in the same order (lanes j and j + 8, then the
// two 128-bit halves (+ 4), then + 2, then + 1).
TS_AVX2 inline float combine_lanes_avx2(__m256 lo, __m256 hi) {
  const __m256 t8 = _mm256_add_ps(lo, hi);
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2)));
}

// The 16-lane sums of v[0..15] -> out[0..15], each by exactly the additions of
// combine_lanes_avx2(lanes 0-7, lanes 8-15) (lane j + j+8, then + 4, then + 2, then + 1; float
// addition is commutative, so the bits are those of the one-at-a-time reduction), as four rounds of
// shuffles and adds over all 16 vectors: 45 instructions instead of ~8 per sum. After round 1 vector
// p holds the 8 partial sums of v[2p] then v[2p+1]; after round 2, 128-bit lane L of vector q those
// of v[4q + L]; the last round leaves the sum of v[L + 4e] in lane 4L + e.
TS_AVX512 inline void combine16(const __m512* v, float* out) {
  __m512 s8[8], s4[4], s2[2];
  for (int p = 0; p < 8; ++p)  // lanes 0-7 + lanes 8-15 of v[2p] and of v[2p + 1]
    s8[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44),
                          _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
  for (int q = 0; q < 4; ++q)  // each v's lanes 0-3 + 4-7
    s4[q] = _mm512_add_ps(_mm512_shuffle_f32x4(s8[2 * q], s8[2 * q + 1], 0x88),
                          _mm512_shuffle_f32x4(s8[2 * q], s8[2 * q + 1], 0xDD));
  for (int m = 0; m < 2; ++m)  // within each 128-bit lane: elements 0, 1 + 2, 3
    s2[m] = _mm512_add_ps(_mm512_shuffle_ps(s4[2 * m], s4[2 * m + 1], 0x44),
                          _mm512_shuffle_ps(s4[2 * m], s4[2 * m + 1], 0xEE));
  const __m512 s1 = _mm512_add_ps(_mm512_shuffle_ps(s2[0], s2[1], 0x88), _mm512_shuffle_ps(s2[0], s2[1], 0xDD));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, s1);
  for (int a = 0; a < 16; ++a) out[a] = lanes[4 * (a % 4) + a / 4];
}

// out[j] = the 16-lane sum of a[j], j < n, with combine_lanes_avx2's additions: 16 at a time from
// 6 sums up (the last group padded with zeros), one at a time below. Used by the Q4 / Q8 AVX-512
// kernels from 4 input rows (bench/bench_linear.py, Q4_1 / Q8_0 at 5-16 rows: 1-4 % faster,
// bench/results/2026-11-29-q4-lane-sums.md); the bfloat16 dot-product and dense kernels
// measured no gain with it and keep the one-at-a-time sums.
TS_AVX512 inline void combine_sums(const __m512* a, int n, float* out) {
  int j = 0;
  for (; n - j >= 6; j += 16) {
    if (n - j >= 16) {
      combine16(a + j, out + j);
      continue;
    }
    __m512 v[16];
    alignas(64) float res[16];
    for (int t = 0; t < 16; ++t) v[t] = j + t < n ? a[j + t] : _mm512_setzero_ps();
    combine16(v, res);
    for (int t = 0; j + t < n; ++t) out[j + t] = res[t];
    return;
  }
  for (; j < n; ++j) out[j] = combine_lanes_avx2(_mm512_castps512_ps256(a[j]), _mm512_extractf32x8_ps(a[j], 1));
}

// out[i][r0 + r] = the lane sum of acc[i * NX + r] for nw (<= NWMAX) weight rows x NX input rows:
// with combine_sums from 4 input rows up, one at a time below (1-3 input rows measured 1-9 %
// slower with it: the padded groups of 16 and the buffer cost more than they save).
template <int NWMAX, int NX>
TS_AVX512 inline void store_sums(const __m512* acc, int64_t nw, float (*out)[kMaxRows], int64_t r0) {
  if constexpr (NX >= 4) {
    alignas(64) float res[NWMAX * NX];
    combine_sums(acc, static_cast<int>(nw) * NX, res);
    for (int64_t i = 0; i < nw; ++i)
      for (int r = 0; r < NX; ++r) out[i][r0 + r] = res[i * NX + r];
  } else {
    for (int64_t i = 0; i < nw; ++i)
      for (int r = 0; r < NX; ++r)
        out[i][r0 + r] = combine_lanes_avx2(_mm512_castps512_ps256(acc[i * NX + r]),
                                            _mm512_extractf32x8_ps(acc[i * NX + r], 1));
  }
}

TS_AVX2 inline __m128i nibbles(const uint8_t* p, int shift) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm_and_si128(shift ? _mm_srli_epi16(v, 4) : v, _mm_set1_epi8(0x0F));
}

TS_AVX2 inline float half_avx2(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Q4_K / Q5_K super-block at b: d * scale -> d1[0..7] and -(dmin * min) -> m1[0..7] of its 8
// sub-blocks (exact products: 11 x 6 bits), 32-byte aligned.
TS_AVX2 inline void kquant_scales(const uint8_t* b, float* d1, float* m1) {
  uint64_t sc8, mn8;
  scale_min_k4_all(b + 4, &sc8, &mn8);
  _mm256_store_ps(d1, _mm256_mul_ps(_mm256_set1_ps(half_avx2(b)),
                                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(sc8))))));
  _mm256_store_ps(m1, _mm256_mul_ps(_mm256_set1_ps(-half_avx2(b + 2)),
                                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(mn8))))));
}

constexpr bool is_dense(int64_t f) { return f == kF32 || f == kF16 || f == kBF16; }
// Weights per step of the AVX2 kernels: 16 (one lane group) for dense formats, 32 (one block or
// sub-block, whose scale is read once) for block formats.
template <int64_t F>
constexpr int64_t kStep = is_dense(F) ? 16 : 32;

// One 32-weight block of Q4_0 / Q4_1 / Q8_0, read once, dequantized by halves: half(h) gives the
// weights 8h + 0..7 and 16 + 8h + 0..7 (h = 0: what the low 8 of the 16 lanes take, h = 1: the high
// 8), so a kernel may dequantize either half alone (block_split_avx2) or both (dequant_step_avx2).
template <int64_t F>
constexpr bool kHasHalf = F == kQ4_0 || F == kQ4_1 || F == kQ8_0;

// bytes per 32-weight block of Q4_0 / Q4_1 / Q8_0
template <int64_t F>
constexpr int64_t kBlockBytes = F == kQ4_0 ? 18 : F == kQ4_1 ? 20 : 34;

template <int64_t F>
struct HalfBlock {
  static_assert(kHasHalf<F>, "HalfBlock: Q4_0, Q4_1, Q8_0");
  const uint8_t* b;
  __m128 dm;  // d (and Q4_1's m: d and m are adjacent halves, one conversion)
  __m256i v;  // Q4: the 16 bytes in both 128-bit lanes

  TS_AVX2 HalfBlock(const uint8_t* row, int64_t k)
      : b(row + (k >> 5) * kBlockBytes<F>),
        dm(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(F == kQ4_1 ? load_u32(b) : load_u16(b))))) {
    if constexpr (F != kQ8_0)
      v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (F == kQ4_0 ? 2 : 4))));
  }

  TS_AVX2 void half(int h, __m256& first, __m256& second) const {
    const __m256 d = _mm256_broadcastss_ps(dm);
    if constexpr (F == kQ8_0) {  // sign-extending loads of 8 bytes each
      __m256 out[2];
      for (int j = 0; j < 2; ++j)
        out[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                   _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * h + 16 * j)))),
                               d);
      first = out[0];
      second = out[1];
    } else {
      // bytes 8h .. 8h + 7 -> the low byte of dwords 0..7 (a shuffle; the -1s give zero bytes): the
      // low nibbles are weights 8h + j, the high nibbles (a dword shift) 16 + 8h + j
      const __m256i sel = _mm256_add_epi32(_mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                                            4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1),
                                           _mm256_set1_epi32(8 * h));
      const __m256i bh = _mm256_shuffle_epi8(v, sel);
      const __m256i q[2] = {_mm256_and_si256(bh, _mm256_set1_epi32(0x0F)), _mm256_srli_epi32(bh, 4)};
      __m256 out[2];
      if constexpr (F == kQ4_1) {
        const __m256 m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
        for (int j = 0; j < 2; ++j) out[j] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q[j]), m);
      } else {
        const __m256i eight = _mm256_set1_epi32(8);
        for (int j = 0; j < 2; ++j) out[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[j], eight)));
      }
      first = out[0];
      second = out[1];
    }
  }
};

// AVX2 dequantization of one step of weights starting at element k (the same values as dequant16):
// w[2g], w[2g + 1] hold weights k + 16g + 0..7, 8..15.
template <int64_t F>
TS_AVX2 inline void dequant_step_avx2(const uint8_t* row, int64_t k, int64_t left, __m256* w) {
  if constexpr (is_dense(F)) {
    constexpr int64_t es = F == kF32 ? 4 : 2;
    alignas(32) uint8_t buf[kLanes * es];
    const uint8_t* p = row + es * k;
    if (left < kLanes) {
      std::memset(buf, 0, sizeof buf);
      std::memcpy(buf, p, es * left);
      p = buf;
    }
    if constexpr (F == kF32) {
      w[0] = _mm256_loadu_ps(reinterpret_cast<const float*>(p));
      w[1] = _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8);
    } else if constexpr (F == kF16) {
      w[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      w[1] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
    } else {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
      w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16));
      w[1] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
    }
  } else if constexpr (F == kQ4_0 || F == kQ4_1 || F == kQ8_0) {
    // both halves of the step: w[0], w[2] (low lanes) and w[1], w[3] (high lanes)
    const HalfBlock<F> blk(row, k);
    blk.half(0, w[0], w[2]);
    blk.half(1, w[1], w[3]);
  } else if constexpr (F == kQ5_0) {
    const uint8_t* b = row + (k >> 5) * 22;
    const __m256 d = _mm256_set1_ps(half_avx2(b));
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 6));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    __m128i q[2] = {_mm_and_si128(v, m4), _mm_and_si128(_mm_srli_epi16(v, 4), m4)};
    // bit e of qh -> 0x10 in byte e
    const uint32_t qh = load_u32(b + 2);
    const __m128i sel = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int g = 0; g < 2; ++g) {
      const __m128i bits = _mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>((qh >> (16 * g)) & 0xFFFF)), spread);
      q[g] = _mm_or_si128(q[g], _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(bits, sel), sel), _mm_set1_epi8(0x10)));
    }
    const __m256 sixteen = _mm256_set1_ps(16.f);
    for (int g = 0; g < 2; ++g) {
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q[g]));
      const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(q[g], q[g])));
      w[2 * g] = _mm256_mul_ps(d, _mm256_sub_ps(lo, sixteen));
      w[2 * g + 1] = _mm256_mul_ps(d, _mm256_sub_ps(hi, sixteen));
    }
  } else if constexpr (F == kQ4_K || F == kQ5_K) {
    const uint8_t* b = row + (k >> 8) * (F == kQ4_K ? 144 : 176);
    const int e0 = static_cast<int>(k & 255), sub = e0 >> 5;
    int sc, mn;
    scale_min_k4(b + 4, sub, &sc, &mn);
    const __m256 d1 = _mm256_set1_ps(half_avx2(b) * static_cast<float>(sc));
    const __m256 ndm = _mm256_set1_ps(-(half_avx2(b + 2) * static_cast<float>(mn)));
    const uint8_t* qs = b + (F == kQ4_K ? 16 : 48) + 32 * (e0 >> 6);
    for (int g = 0; g < 2; ++g) {
      __m128i q = nibbles(qs + 16 * g, sub & 1);
      if constexpr (F == kQ5_K) {
        const __m128i sel = _mm_set1_epi8(static_cast<char>(1 << sub));
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 + 16 * g));
        q = _mm_or_si128(q, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(h, sel), sel), _mm_set1_epi8(0x10)));
      }
      w[2 * g] = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), ndm);
      w[2 * g + 1] = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(q, q))), ndm);
    }
  } else {
    static_assert(F == kQ6_K, "unknown format");
    const uint8_t* b = row + (k >> 8) * 210;
    const int e0 = static_cast<int>(k & 255), half = e0 >> 7, e = e0 & 127;
    const float dd = half_avx2(b + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const __m256 off = _mm256_set1_ps(32.f);
    const __m128i shh = _mm_cvtsi32_si128((e >> 5) * 2);
    for (int g = 0; g < 2; ++g) {
      const __m256 d1 = _mm256_set1_ps(dd * static_cast<float>(scales[(e0 >> 4) + g]));
      const __m128i lq = nibbles(b + 64 * half + (e & 63) + 16 * g, (e >> 6) * 4);
      const __m128i hv = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 128 + 32 * half + (e & 31) + 16 * g));
      const __m128i hq = _mm_and_si128(_mm_srl_epi16(hv, shh), _mm_set1_epi8(3));
      const __m128i q = _mm_or_si128(lq, _mm_slli_epi16(hq, 4));
      w[2 * g] = _mm256_mul_ps(d1, _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), off));
      w[2 * g + 1] =
          _mm256_mul_ps(d1, _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(q, q))), off));
    }
  }
}

// One step of weights -> w[0 .. kStep<F>).
template <int64_t F>
TS_AVX2 void dequant_step_store_avx2(const uint8_t* row, int64_t k, int64_t left, float* w) {
  __m256 v[4];
  dequant_step_avx2<F>(row, k, left, v);
  for (int j = 0; j < kStep<F> / 8; ++j) _mm256_storeu_ps(w + 8 * j, v[j]);
}

TS_AVX2 inline void load_x16(const float* p, int64_t left, __m256& lo, __m256& hi) {
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

// One step of the lane-ordered accumulation of NW weight rows x NX input rows; `left` < step only in
// a dense row's last step.
template <int64_t F, int NW, int NX>
TS_AVX2 __attribute__((always_inline)) inline void accumulate_step(const uint8_t* const* wr, const float* const* xr,
                                                                   int64_t k, int64_t pf, bool nta, int64_t left,
                                                                   __m256 (&lo)[NW][NX], __m256 (&hi)[NW][NX]) {
  constexpr int64_t groups = kStep<F> / kLanes;
  __m256 xl[groups][NX], xh[groups][NX];
  for (int g = 0; g < groups; ++g)
    for (int r = 0; r < NX; ++r) load_x16(xr[r] + k + kLanes * g, left - kLanes * g, xl[g][r], xh[g][r]);
  for (int i = 0; i < NW; ++i) {
    prefetch_weights(wr[i] + pf, nta);
    __m256 w[4];
    dequant_step_avx2<F>(wr[i], k, left, w);
    for (int g = 0; g < groups; ++g)  // lane order: group g's weights come after group g - 1's
      for (int r = 0; r < NX; ++r) {
        lo[i][r] = _mm256_fmadd_ps(w[2 * g], xl[g][r], lo[i][r]);
        hi[i][r] = _mm256_fmadd_ps(w[2 * g + 1], xh[g][r], hi[i][r]);
      }
  }
}

// Q4_K / Q5_K: one 256-weight super-block of NW weight rows x NX input rows, the same values and the
// same lane order as 8 calls of accumulate_step, with the scales decoded once per super-block and
// the 4-bit values widened by byte shuffles (no per-sub-block scalar work, no branches). Rows are
// interleaved 64 weights at a time: each lane's sum is a chain of dependent FMAs, and NW rows give
// the core NW independent chains per lane to overlap.
template <int64_t F, int NW, int NX>
TS_AVX2 __attribute__((always_inline)) inline void accumulate_kquant(const uint8_t* const* wr, const float* const* xr,
                                                                     int64_t k, int64_t pf, bool nta,
                                                                     __m256 (&lo)[NW][NX], __m256 (&hi)[NW][NX]) {
  constexpr int64_t bytes = F == kQ4_K ? 144 : 176;
  const __m256i s0 = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                      4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
  const __m256i s1 = _mm256_add_epi32(s0, _mm256_set1_epi32(8));
  const __m256i m4 = _mm256_set1_epi32(0x0F);
  // d * scale and -(dmin * min) of the 8 sub-blocks of each row (exact products: 11 x 6 bits)
  alignas(32) float d1[NW][8], m1[NW][8];
  const uint8_t* b[NW];
  for (int i = 0; i < NW; ++i) {
    b[i] = wr[i] + (k >> 8) * bytes;
    prefetch_weights(wr[i] + pf, nta);
    prefetch_weights(wr[i] + pf + 64, nta);
    kquant_scales(b[i], d1[i], m1[i]);
  }
  for (int p = 0; p < 4; ++p) {  // 64 weights: sub-block 2p (low nibbles), 2p + 1 (high nibbles)
#pragma GCC unroll 4
    for (int i = 0; i < NW; ++i) {
      const uint8_t* qs = b[i] + (F == kQ4_K ? 16 : 48);
      __m256i q[2][4];  // [sub-block][8-weight group]
      for (int h = 0; h < 2; ++h) {  // bytes 16h..16h+15 of the 32: weights 16h..16h+15 of both sub-blocks
        const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 32 * p + 16 * h)));
        const __m256i b0 = _mm256_shuffle_epi8(v, s0), b1 = _mm256_shuffle_epi8(v, s1);
        q[0][2 * h] = _mm256_and_si256(b0, m4);
        q[0][2 * h + 1] = _mm256_and_si256(b1, m4);
        q[1][2 * h] = _mm256_srli_epi32(b0, 4);
        q[1][2 * h + 1] = _mm256_srli_epi32(b1, 4);
        if constexpr (F == kQ5_K) {  // the fifth bit: bit (2p + sub) of qh[weight]
          const __m256i hv = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b[i] + 16 + 16 * h)));
          const __m256i h0 = _mm256_shuffle_epi8(hv, s0), h1 = _mm256_shuffle_epi8(hv, s1);
          const __m256i one = _mm256_set1_epi32(1);
          for (int sub = 0; sub < 2; ++sub) {
            const __m128i sh = _mm_cvtsi32_si128(2 * p + sub);
            q[sub][2 * h] = _mm256_or_si256(q[sub][2 * h], _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(h0, sh), one), 4));
            q[sub][2 * h + 1] =
                _mm256_or_si256(q[sub][2 * h + 1], _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(h1, sh), one), 4));
          }
        }
      }
      for (int sub = 0; sub < 2; ++sub) {
        const int j = 2 * p + sub;
        const __m256 dv = _mm256_set1_ps(d1[i][j]), mv = _mm256_set1_ps(m1[i][j]);
        const int64_t kk = k + 32 * j;
        for (int g = 0; g < 2; ++g) {  // lane group g: weights kk + 16g .. kk + 16g + 15
          const __m256 wl = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(q[sub][2 * g]), mv);
          const __m256 wh = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(q[sub][2 * g + 1]), mv);
          for (int r = 0; r < NX; ++r) {
            lo[i][r] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(xr[r] + kk + 16 * g), lo[i][r]);
            hi[i][r] = _mm256_fmadd_ps(wh, _mm256_loadu_ps(xr[r] + kk + 16 * g + 8), hi[i][r]);
          }
        }
      }
    }
  }
}

// Q6_K: one 256-weight super-block of NW weight rows x NX input rows, the same values and lane
// order as 8 calls of accumulate_step. Per 32 weights (half h, quarter c): 6-bit values from a nibble
// of ql and two bits of qh, minus 32 in bytes, sign-extended to dwords; each weight is the exact
// product (d * scale) * (q - 32). Rows interleaved as in accumulate_kquant.
template <int NW, int NX>
TS_AVX2 __attribute__((always_inline)) inline void accumulate_q6k(const uint8_t* const* wr, const float* const* xr,
                                                                  int64_t k, int64_t pf, bool nta,
                                                                  __m256 (&lo)[NW][NX], __m256 (&hi)[NW][NX]) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
  alignas(32) float d1[NW][16];  // d * scale per 16 weights (exact: 11 x 8 bits)
  const uint8_t* b[NW];
  for (int i = 0; i < NW; ++i) {
    b[i] = wr[i] + (k >> 8) * 210;
    for (int c = 0; c < 4; ++c) prefetch_weights(wr[i] + pf + 64 * c, nta);
    const __m256 d = _mm256_set1_ps(half_avx2(b[i] + 208));
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[i] + 192));
    _mm256_store_ps(d1[i], _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
    _mm256_store_ps(d1[i] + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
  }
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < 4; ++c) {  // weights 128h + 32c .. + 31
#pragma GCC unroll 4
      for (int i = 0; i < NW; ++i) {
        const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[i] + 64 * h + 32 * (c & 1)));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[i] + 128 + 32 * h));
        const __m256i lo4 = _mm256_and_si256((c >> 1) ? _mm256_srli_epi16(ql, 4) : ql, m4);
        // bits 2c, 2c + 1 of qh -> bits 4, 5
        const __m256i hb = c == 0 ? _mm256_slli_epi16(qh, 4) : c == 1 ? _mm256_slli_epi16(qh, 2)
                           : c == 2 ? qh : _mm256_srli_epi16(qh, 2);
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo4, _mm256_and_si256(hb, m30)), off);
        const __m128i qa = _mm256_castsi256_si128(q), qb = _mm256_extracti128_si256(q, 1);
        const __m256i qd[4] = {_mm256_cvtepi8_epi32(qa), _mm256_cvtepi8_epi32(_mm_srli_si128(qa, 8)),
                               _mm256_cvtepi8_epi32(qb), _mm256_cvtepi8_epi32(_mm_srli_si128(qb, 8))};
        const int64_t kk = k + 128 * h + 32 * c;
        for (int g = 0; g < 2; ++g) {  // lane group g: weights kk + 16g .. + 15, scale 8h + 2c + g
          const __m256 dv = _mm256_set1_ps(d1[i][8 * h + 2 * c + g]);
          const __m256 wl = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(qd[2 * g]));
          const __m256 wh = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(qd[2 * g + 1]));
          for (int r = 0; r < NX; ++r) {
            lo[i][r] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(xr[r] + kk + 16 * g), lo[i][r]);
            hi[i][r] = _mm256_fmadd_ps(wh, _mm256_loadu_ps(xr[r] + kk + 16 * g + 8), hi[i][r]);
          }
        }
      }
    }
}

// NW weight rows x NX input rows over all of K (16 lanes as two 8-wide halves, in registers).
template <int64_t F, int NW, int NX>
TS_AVX2 void block_avx2(const uint8_t* const* wr, int64_t row_bytes, const float* const* xr, int64_t K,
                        float (*out)[kMaxRows], int64_t r0) {
  __m256 lo[NW][NX], hi[NW][NX];
  for (int i = 0; i < NW; ++i)
    for (int r = 0; r < NX; ++r) lo[i][r] = hi[i][r] = _mm256_setzero_ps();
  // Prefetch the same place one row block ahead (rows are contiguous): a DRAM stream that the
  // hardware prefetcher alone does not sustain across rows. The hint is the CPU's (isa.h:
  // non-temporal on AMD, T0 on Intel).
  constexpr int64_t step = kStep<F>;
  const bool nta = prefetch_nta();
  constexpr int64_t pf_step = bytes_for<F>(step);
  const int64_t ahead = kRowBlock * row_bytes;
  const int64_t full = K / step * step;
  int64_t k = 0, pf = 0;
  if constexpr (F == kQ4_K || F == kQ5_K) {  // K % 256 == 0
    for (; k < K; k += 256, pf += 8 * pf_step) accumulate_kquant<F, NW, NX>(wr, xr, k, ahead + pf, nta, lo, hi);
  } else if constexpr (F == kQ6_K) {  // K % 256 == 0
    for (; k < K; k += 256, pf += 8 * pf_step) accumulate_q6k<NW, NX>(wr, xr, k, ahead + pf, nta, lo, hi);
  } else {
    for (; k < full; k += step, pf += pf_step) accumulate_step<F, NW, NX>(wr, xr, k, ahead + pf, nta, step, lo, hi);
    if (k < K) accumulate_step<F, NW, NX>(wr, xr, k, ahead + pf, nta, K - k, lo, hi);
  }
  for (int i = 0; i < NW; ++i)
    for (int r = 0; r < NX; ++r) out[i][r0 + r] = combine_lanes_avx2(lo[i][r], hi[i][r]);
}

template <int64_t F, int NW>
TS_AVX2 void rows_nx(const uint8_t* const* wr, int64_t row_bytes, const float* const* xr, int64_t nx, int64_t K,
                     float (*out)[kMaxRows], int64_t r0) {
  switch (nx) {
    case 4: block_avx2<F, NW, 4>(wr, row_bytes, xr + r0, K, out, r0); break;
    case 3: block_avx2<F, NW, 3>(wr, row_bytes, xr + r0, K, out, r0); break;
    case 2: block_avx2<F, NW, 2>(wr, row_bytes, xr + r0, K, out, r0); break;
    default: block_avx2<F, NW, 1>(wr, row_bytes, xr + r0, K, out, r0); break;
  }
}

// nw (1..4) weight rows x NX (4..8) input rows of Q4_0 / Q4_1 / Q8_0, each weight dequantized once
// for all NX rows (passes of <= 4 rows dequantize it once per pass). NX accumulators fit the
// registers only for 8 of the 16 lanes, so each chunk of a weight row runs twice, the low 8 lanes then
// the high 8, the other accumulators waiting on the stack; the chunk of x stays in L1 for all nw weight
// rows and both halves. Each lane accumulates the same products in the same order as block_avx2, so
// the bits are the same.
template <int64_t F, int NX>
TS_AVX2 void block_split_avx2(const uint8_t* const* wr, int64_t nw, int64_t row_bytes, const float* const* xr,
                              int64_t K, float (*out)[kMaxRows], int64_t r0) {
  // the whole row when NX rows of x fit comfortably in L1 (24 KB), else chunks of 256 weights
  const int64_t chunk = NX * K * 4 <= 24 * 1024 ? K : 256;
  __m256 lanes[kRowBlock][2][NX];
  for (int64_t i = 0; i < nw; ++i)
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < NX; ++r) lanes[i][h][r] = _mm256_setzero_ps();
  const int64_t ahead = kRowBlock * row_bytes;
  constexpr int64_t pf_step = bytes_for<F>(32);
  const bool nta = prefetch_nta();
  for (int64_t c = 0; c < K; c += chunk) {
    const int64_t end = std::min(K, c + chunk);
    for (int64_t i = 0; i < nw; ++i) {
      const uint8_t* row = wr[i];
      for (int h = 0; h < 2; ++h) {
        __m256 acc[NX];
        for (int r = 0; r < NX; ++r) acc[r] = lanes[i][h][r];
        for (int64_t k = c; k < end; k += 32) {
          if (h == 0) prefetch_weights(row + ahead + k / 32 * pf_step, nta);
          __m256 w[2];
          HalfBlock<F>(row, k).half(h, w[0], w[1]);
          for (int r = 0; r < NX; ++r) acc[r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr[r] + k + 8 * h), acc[r]);
          for (int r = 0; r < NX; ++r)
            acc[r] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr[r] + k + 16 + 8 * h), acc[r]);
        }
        for (int r = 0; r < NX; ++r) lanes[i][h][r] = acc[r];
      }
    }
  }
  for (int64_t i = 0; i < nw; ++i)
    for (int r = 0; r < NX; ++r) out[i][r0 + r] = combine_lanes_avx2(lanes[i][0][r], lanes[i][1][r]);
}

template <int64_t F>
TS_AVX2 void rows_split(const uint8_t* const* wr, int64_t nw, int64_t row_bytes, const float* const* xr, int64_t nx,
                        int64_t K, float (*out)[kMaxRows], int64_t r0) {
  switch (nx) {
    case 8: block_split_avx2<F, 8>(wr, nw, row_bytes, xr + r0, K, out, r0); break;
    case 7: block_split_avx2<F, 7>(wr, nw, row_bytes, xr + r0, K, out, r0); break;
    case 6: block_split_avx2<F, 6>(wr, nw, row_bytes, xr + r0, K, out, r0); break;
    case 5: block_split_avx2<F, 5>(wr, nw, row_bytes, xr + r0, K, out, r0); break;
    default: block_split_avx2<F, 4>(wr, nw, row_bytes, xr + r0, K, out, r0); break;  // balanced passes: >= 4 rows
  }
}

// nw (1..4) weight rows x R input rows, register-blocked so that the accumulators (two registers
// per weight row x input row) and the weights fit the 16 ymm registers: one input row takes all nw
// weight rows at once (4 weight streams); more input rows take weight rows in pairs (x 3 inputs,
// dense) or one by one (x up to 4 inputs, block formats: their dequantization needs registers too).
template <int64_t F>
TS_AVX2 void rows_avx2(const uint8_t* const* wr, int64_t nw, int64_t row_bytes, const float* const* xr, int64_t R,
                       int64_t K, float (*out)[kMaxRows]) {
  if (R == 1 && (F == kBF16 || F == kF16)) {
    // 16-bit dense weights at batch 1: one row at a time (a single sequential stream per thread)
    // decodes SmolLM2 in bfloat16 ~14% faster than 4 interleaved rows on the AVX2 machine of
    // bench/RESULTS.md run 6; float32 weights are ~4% faster with 4 rows, quantized ones no slower.
    for (int64_t i = 0; i < nw; ++i) block_avx2<F, 1, 1>(wr + i, row_bytes, xr, K, out + i, 0);
    return;
  }
  if (R == 1) {
    switch (nw) {
      case 4: block_avx2<F, 4, 1>(wr, row_bytes, xr, K, out, 0); break;
      case 3: block_avx2<F, 3, 1>(wr, row_bytes, xr, K, out, 0); break;
      case 2: block_avx2<F, 2, 1>(wr, row_bytes, xr, K, out, 0); break;
      default: block_avx2<F, 1, 1>(wr, row_bytes, xr, K, out, 0); break;
    }
    return;
  }
  if constexpr (is_dense(F)) {
    for (int64_t i = 0; i < nw; i += 2) {
      for (int64_t r = 0; r < R; r += 3) {
        const int64_t nx = std::min<int64_t>(3, R - r);
        if (nw - i >= 2) rows_nx<F, 2>(wr + i, row_bytes, xr, nx, K, out + i, r);
        else rows_nx<F, 1>(wr + i, row_bytes, xr, nx, K, out + i, r);
      }
    }
  } else {
    if constexpr (kHasHalf<F>) {
      // 4..16 rows: split-lane passes of up to 8 rows (one pass dequantizes every weight once for
      // all its rows). On an AVX2-only Zen 3 (bench/results/2026-11-29-avx2-split-passes.md)
      // they took 0.61-0.83x the time of passes of <= 4 rows at 4, 9, 12 and 16 rows; 2-3 rows were
      // no faster; past 16 rows the float32 panel is as fast (17-64 rows: 0.91-1.15x).
      if (R >= 4) {
        const int64_t passes = (R + 7) / 8, per = (R + passes - 1) / passes;  // balanced: 12 rows = 6 + 6
        for (int64_t r = 0; r < R; r += per) rows_split<F>(wr, nw, row_bytes, xr, std::min(per, R - r), K, out, r);
        return;
      }
    }
    const int64_t passes = (R + 3) / 4, per = (R + passes - 1) / passes;  // balanced: 6 rows = 3 + 3
    for (int64_t i = 0; i < nw; ++i)
      for (int64_t r = 0; r < R; r += per) rows_nx<F, 1>(wr + i, row_bytes, xr, std::min(per, R - r), K, out + i, r);
  }
}

TS_AVX512 inline __m512 load16_512(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
TS_AVX512 inline __m512 load16_512(const c10::BFloat16* p, __mmask16 m) {
  __m256i h = _mm256_maskz_loadu_epi16(m, reinterpret_cast<const void*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// 16 whole weights (no mask: the widening load folds into one instruction)
TS_AVX512 inline __m512 load16_512(const float* p) { return _mm512_loadu_ps(p); }
TS_AVX512 inline __m512 load16_512(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Dense float32 / bfloat16 weights: NW (1-4) weight rows x NX (1-4) input rows, 16 lanes in one
// register, steps k0, k0 + 16, ... < k1 (k0 % 16 == 0; k1 % 16 == 0 or k1 == K, whose last step loads
// under a mask: zeros add nothing), added to the lane sums acc[4 i + r]. PF: the prefetch of the next
// row block (kRowBlock rows ahead): 0 none, 1 T0, 2 non-temporal. The accumulators are named
// variables: as an array [NW][NX], GCC 12 at -O3 kept them in memory too and stored every one of
// them at every step (store-bound from 2 x 2 up; bench/RESULTS.md, run 18).
template <int NW, int NX, typename W, int PF>
TS_AVX512 void span_avx512(const W* const* wr, const float* const* xr, int64_t k0, int64_t k1, int64_t K,
                           __m512* acc) {
  static_assert(NW >= 1 && NW <= 4 && NX >= 1 && NX <= 4, "span_avx512: 1-4 weight rows x 1-4 input rows");
  const __m512 z = _mm512_setzero_ps();
#define TS_ACC(i, r) ((NW > i && NX > r) ? acc[4 * i + r] : z)
  __m512 a00 = TS_ACC(0, 0), a01 = TS_ACC(0, 1), a02 = TS_ACC(0, 2), a03 = TS_ACC(0, 3);
  __m512 a10 = TS_ACC(1, 0), a11 = TS_ACC(1, 1), a12 = TS_ACC(1, 2), a13 = TS_ACC(1, 3);
  __m512 a20 = TS_ACC(2, 0), a21 = TS_ACC(2, 1), a22 = TS_ACC(2, 2), a23 = TS_ACC(2, 3);
  __m512 a30 = TS_ACC(3, 0), a31 = TS_ACC(3, 1), a32 = TS_ACC(3, 2), a33 = TS_ACC(3, 3);
#undef TS_ACC
  // one step of 16 weights at k: LOADX(p) / LOADW(p) read 16 input / weight values at p
#define TS_DENSE_ROW(i, LOADW)                                           \
  if constexpr (NW > i) {                                                \
    if constexpr (PF > 0) prefetch_weights(wr[i] + kRowBlock * K + k, PF == 2); \
    const __m512 w = LOADW(wr[i] + k);                                   \
    a##i##0 = _mm512_fmadd_ps(w, x0, a##i##0);                           \
    if constexpr (NX > 1) a##i##1 = _mm512_fmadd_ps(w, x1, a##i##1);     \
    if constexpr (NX > 2) a##i##2 = _mm512_fmadd_ps(w, x2, a##i##2);     \
    if constexpr (NX > 3) a##i##3 = _mm512_fmadd_ps(w, x3, a##i##3);     \
  }
#define TS_DENSE_STEP(LOADX, LOADW)                                      \
  {                                                                      \
    const __m512 x0 = LOADX(xr[0] + k);                                  \
    const __m512 x1 = NX > 1 ? LOADX(xr[NX > 1 ? 1 : 0] + k) : z;        \
    const __m512 x2 = NX > 2 ? LOADX(xr[NX > 2 ? 2 : 0] + k) : z;        \
    const __m512 x3 = NX > 3 ? LOADX(xr[NX > 3 ? 3 : 0] + k) : z;        \
    TS_DENSE_ROW(0, LOADW) TS_DENSE_ROW(1, LOADW) TS_DENSE_ROW(2, LOADW) TS_DENSE_ROW(3, LOADW) \
  }
  const int64_t full = std::min(k1, K / kLanes * kLanes);
  int64_t k = k0;
  for (; k < full; k += kLanes) TS_DENSE_STEP(_mm512_loadu_ps, load16_512)
  if (k < k1) {
    const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
#define TS_XLOAD_TAIL(p) _mm512_maskz_loadu_ps(m, p)
#define TS_WLOAD_TAIL(p) load16_512(p, m)
    TS_DENSE_STEP(TS_XLOAD_TAIL, TS_WLOAD_TAIL)
#undef TS_WLOAD_TAIL
#undef TS_XLOAD_TAIL
  }
#undef TS_DENSE_STEP
#undef TS_DENSE_ROW
  const __m512 sums[16] = {a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33};
  for (int i = 0; i < NW; ++i)
    for (int r = 0; r < NX; ++r) acc[4 * i + r] = sums[4 * i + r];
}

// Past 4 input rows and a K of more than kDenseChunkAbove, K runs in chunks of kDenseChunk weights:
// the row block's slice (8 KB of float32) stays in L1 while every group of 4 input rows passes over
// it, the lane sums waiting in memory between chunks (the same additions in the same order). Over
// all of a long K, a row block and a group of x rows outgrow L1 and the weights come from L2 once
// per group. One core of the AVX-512 machine of bench/RESULTS.md (2026-11-27, alternated in one
// process), GFMA/s: float32 1024 x 1536 at 64 rows 27.8 -> 34.3, 16 rows 23.6 -> 27.6; the panel
// of Q6_K 1024 x 1536 at 64 rows 21.7 -> 27.0; at K = 576-1024 chunks gained nothing or lost up to 5 %.
// The AVX2 dense kernel (2 x 3 tiles), chunked the same way and forced on that machine, gained
// nothing beyond the noise (~10 %), so it keeps whole rows.
constexpr int64_t kDenseChunk = 512, kDenseChunkAbove = 1024;

template <int NW, int NX, typename W>
TS_AVX512 void span_avx512_pf(const W* const* wr, const float* const* xr, int64_t k0, int64_t k1, int64_t K,
                              __m512* acc, int pf) {
  switch (pf) {
    case 0: span_avx512<NW, NX, W, 0>(wr, xr, k0, k1, K, acc); break;
    case 2: span_avx512<NW, NX, W, 2>(wr, xr, k0, k1, K, acc); break;
    default: span_avx512<NW, NX, W, 1>(wr, xr, k0, k1, K, acc); break;
  }
}

template <int NW, typename W>
TS_AVX512 void span_avx512_rows(const W* const* wr, const float* const* xr, int64_t nx, int64_t k0, int64_t k1,
                                int64_t K, __m512* acc, int pf) {
  switch (nx) {
    case 4: span_avx512_pf<NW, 4>(wr, xr, k0, k1, K, acc, pf); break;
    case 3: span_avx512_pf<NW, 3>(wr, xr, k0, k1, K, acc, pf); break;
    case 2: span_avx512_pf<NW, 2>(wr, xr, k0, k1, K, acc, pf); break;
    default: span_avx512_pf<NW, 1>(wr, xr, k0, k1, K, acc, pf); break;
  }
}

// NW weight rows x R input rows in groups of 4: over all of K per group up to 4 rows (or when K
// fits one chunk), else chunk by chunk of K (kDenseChunk), every group per chunk.
template <int NW, typename W>
TS_AVX512 void rows_avx512_n(const W* const* wr, const float* const* xr, int64_t R, int64_t K, float (*out)[kMaxRows]) {
  const int pf = prefetch_nta() ? 2 : 1;
  const int64_t groups = (R + 3) / 4;
  alignas(64) __m512 acc[kMaxRows / 4][16];
  for (int64_t g = 0; g < groups; ++g)
    for (int j = 0; j < 16; ++j) acc[g][j] = _mm512_setzero_ps();
  const int64_t chunk = R <= 4 || K <= kDenseChunkAbove ? K : kDenseChunk;
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t k1 = std::min(K, k0 + chunk);
    // the next row block is prefetched once per chunk, by the first group
    for (int64_t g = 0; g < groups; ++g)
      span_avx512_rows<NW>(wr, xr + 4 * g, std::min<int64_t>(4, R - 4 * g), k0, k1, K, acc[g], g == 0 ? pf : 0);
  }
  for (int64_t g = 0; g < groups; ++g)
    for (int i = 0; i < NW; ++i)
      for (int64_t r = 4 * g; r < std::min<int64_t>(R, 4 * g + 4); ++r) {
        const __m512 a = acc[g][4 * i + (r - 4 * g)];
        out[i][r] = combine_lanes_avx2(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
      }
}

template <typename W>
TS_AVX512 void rows_avx512(const uint8_t* const* wr_bytes, int64_t nw, const float* const* xr, int64_t R, int64_t K,
                           float (*out)[kMaxRows]) {
  const W* wr[kRowBlock];
  for (int64_t i = 0; i < nw; ++i) wr[i] = reinterpret_cast<const W*>(wr_bytes[i]);
  switch (nw) {
    case 4: rows_avx512_n<4>(wr, xr, R, K, out); break;
    case 3: rows_avx512_n<3>(wr, xr, R, K, out); break;
    case 2: rows_avx512_n<2>(wr, xr, R, K, out); break;
    default: rows_avx512_n<1>(wr, xr, R, K, out); break;
  }
}

// ---------------------------------------------------------------------------------------------
// AVX-512, Q4_0 / Q4_1 / Q5_0 / Q8_0, up to 16 input rows: one 32-weight block is two registers of
// 16 lanes (weights k .. k + 15, k + 16 .. k + 31), so a step is two fused multiply-adds per input
// row in exactly the lane order above; each weight is dequantized once for all NX input rows. Q4:
// byte j holds weight j (low nibble) and j + 16 (high nibble); the 16 possible values of a block
// (d * q + m, or d * (q - 8)) are computed once per block (one register) and each weight is picked by
// its nibble with a lane permutation (vpermps reads only the index's low 4 bits: the high nibble
// needs one shift, the low one nothing). The picked value is the one dequant16 computes, so the bits
// are those of every other path. Shuffles (port 5 on Intel cores) bound this kernel, so the blocks'
// half-precision scales are first widened for a chunk of blocks into a float32 buffer, from which
// they are broadcast by the load ports (a register broadcast would be one more shuffle per block).
// Q5_0's 32 possible values take two registers, and a two-register permutation (vpermt2ps) picks
// each weight by its 5-bit value.
// The grouped layouts (gguf_blocks.h) hold the same blocks with 16 scales side by side, so the
// widening is one load and one conversion per 16 blocks instead of one per block: on the AVX-512
// machine of bench/RESULTS.md a one-row Q4_1 pass ran 1.2-1.3x faster, SmolLM2 decode 1.15-1.3x (run 19).
template <int64_t F>
constexpr int64_t kBase = grouped_base(F) >= 0 ? grouped_base(F) : F;
template <int64_t F>
constexpr bool kGrouped = grouped_base(F) >= 0;
template <int64_t F>
constexpr bool kBlock512 = kHasHalf<kBase<F>> || kBase<F> == kQ5_0;

template <int64_t F>
struct Block512 {
  static constexpr int64_t G = kBase<F>;
  static_assert(kBlock512<F>, "Block512: Q4_0, Q4_1, Q5_0, Q8_0 (GGUF or grouped)");
  static constexpr int64_t kBytes = G == kQ5_0 ? 22 : kBlockBytes<G>;
  static constexpr int kHalves = header_halves(G);  // d (and m) per block

  // Offset in a row of nb blocks of block j's bytes after its header (Q5_0: qh, then qs).
  static int64_t rest(int64_t j, int64_t nb) {
    if constexpr (kGrouped<F>) return grouped_rest(j, nb, kBytes, kHalves);
    else return j * kBytes + 2 * kHalves;
  }

  // The same for block g0 + jj of a group of n blocks starting at g0 (g0 % 16 == 0, n <= 16).
  static int64_t rest_in_group(int64_t g0, int64_t n, int64_t jj) {
    if constexpr (kGrouped<F>) return grouped_rest_in(g0, n, jj, kBytes, kHalves);
    else return (g0 + jj) * kBytes + 2 * kHalves;
  }

  // d (and m) of the group of n blocks starting at g0 (g0 % 16 == 0, n <= 16) -> d[0..16), m[0..16)
  TS_AVX512 static __attribute__((always_inline)) inline void group_scales(const uint8_t* row, int64_t g0, int64_t n,
                                                                           float* d, float* m) {
    if constexpr (kGrouped<F>) {
      const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
      const uint8_t* p = row + g0 * kBytes;
      _mm512_store_ps(d, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p)));
      if constexpr (kHalves == 2) _mm512_store_ps(m, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p + 2 * n)));
    } else {
      scales(row, 0, g0, n, d, m);
    }
  }

  // d (and m) of blocks c .. c + n - 1 of a row of nb blocks -> d[0..n), m[0..n) (room for n + 15)
  TS_AVX512 static void scales(const uint8_t* row, int64_t nb, int64_t c, int64_t n, float* d, float* m) {
    if constexpr (kGrouped<F>) {
      for (int64_t j = c; j < c + n;) {  // runs of blocks within one group: 16 halves per conversion
        const int64_t run = std::min(c + n, j - j % kGroupBlocks + kGroupBlocks) - j;
        const __mmask16 mask = static_cast<__mmask16>((1u << run) - 1);
        for (int h = 0; h < kHalves; ++h)
          _mm512_storeu_ps((h ? m : d) + (j - c),
                           _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, row + grouped_field(j, nb, kBytes, h))));
        j += run;
      }
    } else {
      const uint8_t* b = row + c * kBytes;
      for (int64_t j = 0; j < n; ++j, b += kBytes) {
        const __m128 v = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));  // 4 halves, 1-2 used
        _mm_store_ss(d + j, v);
        if constexpr (G == kQ4_1) _mm_store_ss(m + j, _mm_movehdup_ps(v));
      }
    }
  }

  // the block whose bytes after the header are at q, its scales d (and m) -> weights 0..15 (w0) and
  // 16..31 (w1)
  TS_AVX512 static __attribute__((always_inline)) inline void load(const uint8_t* q, const float* dp, const float* mp,
                                                                   __m512& w0, __m512& w1) {
    const __m512 d = _mm512_set1_ps(*dp);
    if constexpr (G == kQ8_0) {
      w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))), d);
      w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)))), d);
    } else if constexpr (G == kQ5_0) {
      // 32 values d * (q - 16): two registers, q = 0..15 and 16..31; the index is the nibble with
      // the weight's bit of qh as bit 4, which picks the register (vpermt2ps)
      const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512 t_lo = _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(16.f))), t_hi = _mm512_mul_ps(d, iota);
      const uint32_t qh = load_u32(q);
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 4)));
      const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(v, 4);
      const __m512i bit4 = _mm512_set1_epi32(16);
      w0 = _mm512_permutex2var_ps(t_lo, _mm512_mask_or_epi32(lo, static_cast<__mmask16>(qh), lo, bit4), t_hi);
      w1 = _mm512_permutex2var_ps(t_lo, _mm512_mask_or_epi32(hi, static_cast<__mmask16>(qh >> 16), hi, bit4), t_hi);
    } else {
      const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      __m512 table;
      if constexpr (G == kQ4_1) table = _mm512_fmadd_ps(d, iota, _mm512_set1_ps(*mp));
      else table = _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(8.f)));
      const __m512i qv = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
      w0 = _mm512_permutexvar_ps(qv, table);
      w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(qv, 4), table);
    }
  }
};

// AVX-512, Q4_K / Q5_K / Q6_K, up to 16 input rows: a 256-weight super-block of NW weight rows x NX input
// rows, 16 weights per register in the lane order above (weights k + 16c + 0..15 in step c of 16),
// the scales decoded once per super-block and row.
//   Q4_K: each sub-block's 16 possible values d * sc * q - dmin * mn are one register (one fused
//   multiply-add on iota, the value dequant16 computes), and each weight is picked by its nibble
//   with a lane permutation, as Block512 does for Q4_0 / Q4_1; Q5_K as Q5_0, with two registers of
//   values per sub-block.
//   Q6_K: the 6-bit values minus 32 are assembled as bytes, 64 at a time, sign-extended to dwords and
//   multiplied by d * scale (the one rounding dequant16 does).
template <int64_t F>
constexpr bool kSuper512 = F == kQ4_K || F == kQ5_K || F == kQ6_K;

template <int64_t F, int NW, int NX>
TS_AVX512 __attribute__((always_inline)) inline void super_k512(const uint8_t* const* b, const float* const* xr,
                                                                int64_t k, __m512 (&acc)[NW][NX]) {
  static_assert(kSuper512<F>, "super_k512: Q4_K, Q5_K, Q6_K");
  if constexpr (F == kQ4_K || F == kQ5_K) {
    alignas(32) float d1[NW][8], m1[NW][8];  // d * sc and -(dmin * mn)
    for (int i = 0; i < NW; ++i) kquant_scales(b[i], d1[i], m1[i]);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int p = 0; p < 4; ++p) {  // 32 bytes: sub-block 2p in the low nibbles, 2p + 1 in the high ones
      for (int i = 0; i < NW; ++i) {
        const uint8_t* qs = b[i] + (F == kQ4_K ? 16 : 48) + 32 * p;
        // weights 0..15 and 16..31 of both sub-blocks (vpermps reads only an index's low 4 bits)
        const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
        const __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)));
        const __m512 t0 = _mm512_fmadd_ps(_mm512_set1_ps(d1[i][2 * p]), iota, _mm512_set1_ps(m1[i][2 * p]));
        const __m512 t1 = _mm512_fmadd_ps(_mm512_set1_ps(d1[i][2 * p + 1]), iota, _mm512_set1_ps(m1[i][2 * p + 1]));
        __m512 w[4];
        if constexpr (F == kQ4_K) {
          w[0] = _mm512_permutexvar_ps(v0, t0);
          w[1] = _mm512_permutexvar_ps(v1, t0);
          w[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(v0, 4), t1);
          w[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(v1, 4), t1);
        } else {
          // q = 16..31 take a second register of values; bit 2p (2p + 1) of qh[l] is weight l's fifth
          // bit in sub-block 2p (2p + 1): as bit 4 of the index it picks that register (vpermt2ps)
          const __m512 iota16 = _mm512_add_ps(iota, _mm512_set1_ps(16.f));
          const __m512 u0 = _mm512_fmadd_ps(_mm512_set1_ps(d1[i][2 * p]), iota16, _mm512_set1_ps(m1[i][2 * p]));
          const __m512 u1 = _mm512_fmadd_ps(_mm512_set1_ps(d1[i][2 * p + 1]), iota16, _mm512_set1_ps(m1[i][2 * p + 1]));
          const __m128i qh0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[i] + 16));
          const __m128i qh1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[i] + 32));
          const __m128i s0 = _mm_set1_epi8(static_cast<char>(1 << (2 * p))), s1 = _mm_set1_epi8(static_cast<char>(2 << (2 * p)));
          const __m512i m4 = _mm512_set1_epi32(15), bit4 = _mm512_set1_epi32(16);
          const __m512i l0 = _mm512_and_si512(v0, m4), l1 = _mm512_and_si512(v1, m4);
          const __m512i h0 = _mm512_srli_epi32(v0, 4), h1 = _mm512_srli_epi32(v1, 4);
          w[0] = _mm512_permutex2var_ps(t0, _mm512_mask_or_epi32(l0, _mm_test_epi8_mask(qh0, s0), l0, bit4), u0);
          w[1] = _mm512_permutex2var_ps(t0, _mm512_mask_or_epi32(l1, _mm_test_epi8_mask(qh1, s0), l1, bit4), u0);
          w[2] = _mm512_permutex2var_ps(t1, _mm512_mask_or_epi32(h0, _mm_test_epi8_mask(qh0, s1), h0, bit4), u1);
          w[3] = _mm512_permutex2var_ps(t1, _mm512_mask_or_epi32(h1, _mm_test_epi8_mask(qh1, s1), h1, bit4), u1);
        }
        const int64_t kk = k + 64 * p;
        for (int c = 0; c < 4; ++c)
          for (int r = 0; r < NX; ++r) acc[i][r] = _mm512_fmadd_ps(w[c], _mm512_loadu_ps(xr[r] + kk + 16 * c), acc[i][r]);
      }
    }
  } else {
    alignas(64) float d1[NW][16];  // d * scale per 16 weights (exact: 11 x 8 bits)
    for (int i = 0; i < NW; ++i)
      _mm512_store_ps(d1[i], _mm512_mul_ps(_mm512_set1_ps(half_avx2(b[i] + 208)),
                                           _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[i] + 192))))));
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30), off = _mm512_set1_epi8(32);
    // qh bits to bits 4..5 of each byte: weights 0..31 take bits 0..1 (<< 4), 32..63 bits 2..3 (<< 2),
    // 64..95 bits 4..5, 96..127 bits 6..7 (>> 2); qh's 32 bytes sit in both 256-bit halves
    const __m512i shl_a = _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2), shr_b = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);
    for (int h = 0; h < 2; ++h) {  // weights 128h .. 128h + 127
      for (int i = 0; i < NW; ++i) {
        const __m512i ql = _mm512_loadu_si512(b[i] + 64 * h);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[i] + 128 + 32 * h)));
        alignas(64) int8_t q[128];  // q - 32 of the 128 weights
        _mm512_store_si512(q, _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(ql, m4),
                                                              _mm512_and_si512(_mm512_sllv_epi64(qh, shl_a), m30)), off));
        _mm512_store_si512(q + 64, _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                                                   _mm512_and_si512(_mm512_srlv_epi64(qh, shr_b), m30)), off));
        const int64_t kk = k + 128 * h;
        for (int c = 0; c < 8; ++c) {
          const __m512 w = _mm512_mul_ps(_mm512_set1_ps(d1[i][8 * h + c]),
                                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                             _mm_load_si128(reinterpret_cast<const __m128i*>(q + 16 * c)))));
          for (int r = 0; r < NX; ++r) acc[i][r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xr[r] + kk + 16 * c), acc[i][r]);
        }
      }
    }
  }
}

// Blocks [b0, b1) of NW weight rows x NX input rows, added to acc_io (the running lane sums).
template <int64_t F, int NW, int NX, bool NTA>
TS_AVX512 void span_q512_hint(const uint8_t* const* wr, int64_t row_bytes, const float* const* xr, int64_t K, int64_t b0,
                              int64_t b1, __m512* acc_io) {
  using B = Block512<F>;
  constexpr int64_t kChunk = 64;  // blocks whose scales are widened at a time
  alignas(64) float sd[NW][kChunk + 16], sm[NW][B::kHalves == 2 ? kChunk + 16 : 1];
  __m512 acc[NW][NX];
  for (int i = 0; i < NW; ++i)
    for (int r = 0; r < NX; ++r) acc[i][r] = acc_io[i * NX + r];
  // Prefetch one row block ahead, as the AVX2 kernels, with the CPU's hint (isa.h): on the AVX-512
  // machine of bench/RESULTS.md (Intel Xeon, 2026-11-26), SmolLM2-shaped Q4_1 rows streamed from DRAM
  // by one thread ran at 5.7 GB/s with T0, 5.0 with no prefetch and 3.9 with the non-temporal hint.
  const int64_t ahead = kRowBlock * row_bytes, nb = K / 32;
  constexpr int64_t pf_step = bytes_for<F>(32);
  constexpr bool nta = NTA;
  for (int64_t c = b0; c < b1; c += kChunk) {
    const int64_t n = std::min(kChunk, b1 - c);
    for (int i = 0; i < NW; ++i) B::scales(wr[i], nb, c, n, sd[i], sm[i]);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t k = 32 * (c + j), pf = ahead + (c + j) * pf_step, q = B::rest(c + j, nb);
      for (int i = 0; i < NW; ++i) {
        prefetch_weights(wr[i] + pf, nta);
        __m512 w0, w1;
        B::load(wr[i] + q, sd[i] + j, sm[i] + (B::kHalves == 2 ? j : 0), w0, w1);
        for (int r = 0; r < NX; ++r) acc[i][r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr[r] + k), acc[i][r]);
        for (int r = 0; r < NX; ++r) acc[i][r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr[r] + k + 16), acc[i][r]);
      }
    }
  }
  for (int i = 0; i < NW; ++i)
    for (int r = 0; r < NX; ++r) acc_io[i * NX + r] = acc[i][r];
}

// 1-4 input rows (a decode step, a short verify), four weight rows, all blocks. The same arithmetic
// and order as span_q512_hint<F, 4, NX> (so the same bits), written for the compiler: named
// accumulators (as arrays GCC 12 at -O3 keeps them in memory too, bench/RESULTS.md run 18), x read
// once per block for the four weight rows, and the scales widened per group of 16 blocks. On the
// AVX-512 machine of bench/RESULTS.md a 3072 x 576 Q4_1 matrix (grouped) ran in 161 us at one row
// against 214 us (run 19).
#define TS_ROW4(i)                                                                                     \
  B::load(w[i] + q, sd[i] + j, sm[i] + jm, w0, w1);                                                  \
  a##i##0 = _mm512_fmadd_ps(w1, x10, _mm512_fmadd_ps(w0, x00, a##i##0));                              \
  if constexpr (NX > 1) a##i##1 = _mm512_fmadd_ps(w1, x11, _mm512_fmadd_ps(w0, x01, a##i##1));        \
  if constexpr (NX > 2) a##i##2 = _mm512_fmadd_ps(w1, x12, _mm512_fmadd_ps(w0, x02, a##i##2));        \
  if constexpr (NX > 3) a##i##3 = _mm512_fmadd_ps(w1, x13, _mm512_fmadd_ps(w0, x03, a##i##3));
#define TS_X4(r)                                                                                       \
  __m512 x0##r = x00, x1##r = x10;                                                                     \
  if constexpr (NX > r) x0##r = _mm512_loadu_ps(xp[r] + k), x1##r = _mm512_loadu_ps(xp[r] + k + 16);
#define TS_OUT4(i)                                                                                     \
  acc_out[i * NX] = a##i##0;                                                                           \
  if constexpr (NX > 1) acc_out[i * NX + 1] = a##i##1;                                                 \
  if constexpr (NX > 2) acc_out[i * NX + 2] = a##i##2;                                                 \
  if constexpr (NX > 3) acc_out[i * NX + 3] = a##i##3;

template <int64_t F, int NX, bool NTA>
TS_AVX512 void rows4_q512_hint(const uint8_t* const* wr, int64_t row_bytes, const float* const* xr, int64_t K,
                               __m512* acc_out) {
  static_assert(NX >= 1 && NX <= 4, "rows4_q512_hint: 1..4 input rows");
  using B = Block512<F>;
  const int64_t nb = K / 32, ahead = kRowBlock * row_bytes;
  constexpr int64_t pf_step = bytes_for<F>(32);
  const float* xp[4];  // held in registers, not re-read through xr
  for (int r = 0; r < 4; ++r) xp[r] = xr[r < NX ? r : 0];
  const uint8_t* const w[4] = {wr[0], wr[1], wr[2], wr[3]};
  const __m512 z = _mm512_setzero_ps();
  __m512 a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z;
  __m512 a20 = z, a21 = z, a22 = z, a23 = z, a30 = z, a31 = z, a32 = z, a33 = z;
  for (int64_t g0 = 0; g0 < nb; g0 += kGroupBlocks) {
    const int64_t n = std::min(kGroupBlocks, nb - g0);
    alignas(64) float sd[4][2 * kGroupBlocks], sm[4][B::kHalves == 2 ? 2 * kGroupBlocks : 1];
    for (int i = 0; i < 4; ++i) B::group_scales(w[i], g0, n, sd[i], sm[i]);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t k = 32 * (g0 + j), pf = ahead + (g0 + j) * pf_step, q = B::rest_in_group(g0, n, j);
      const __m512 x00 = _mm512_loadu_ps(xp[0] + k), x10 = _mm512_loadu_ps(xp[0] + k + 16);
      TS_X4(1) TS_X4(2) TS_X4(3)
      for (int i = 0; i < 4; ++i) prefetch_weights(w[i] + pf, NTA);
      const int64_t jm = B::kHalves == 2 ? j : 0;
      __m512 w0, w1;
      TS_ROW4(0) TS_ROW4(1) TS_ROW4(2) TS_ROW4(3)
    }
  }
  TS_OUT4(0) TS_OUT4(1) TS_OUT4(2) TS_OUT4(3)
}
#undef TS_ROW4
#undef TS_X4
#undef TS_OUT4

// Super-blocks [b0, b1) of NW weight rows x NX input rows of Q4_K / Q5_K / Q6_K, added to acc_io.
template <int64_t F, int NW, int NX, bool NTA>
TS_AVX512 void span_k512_hint(const uint8_t* const* wr, int64_t row_bytes, const float* const* xr, int64_t b0,
                              int64_t b1, __m512* acc_io) {
  constexpr int64_t bytes = F == kQ4_K ? 144 : F == kQ5_K ? 176 : 210;
  __m512 acc[NW][NX];
  for (int i = 0; i < NW; ++i)
    for (int r = 0; r < NX; ++r) acc[i][r] = acc_io[i * NX + r];
  const int64_t ahead = kRowBlock * row_bytes;  // one row block ahead, as the other kernels
  for (int64_t s = b0; s < b1; ++s) {
    const uint8_t* b[NW];
    for (int i = 0; i < NW; ++i) {
      b[i] = wr[i] + s * bytes;
      for (int64_t l = 0; l < bytes; l += 64) prefetch_weights(b[i] + ahead + l, NTA);
    }
    super_k512<F, NW, NX>(b, xr, 256 * s, acc);
  }
  for (int i = 0; i < NW; ++i)
    for (int r = 0; r < NX; ++r) acc_io[i * NX + r] = acc[i][r];
}

// The prefetch hint as a template argument: picked once per call, not tested per block.
template <int64_t F, int NW, int NX>
TS_AVX512 void span_q512(const uint8_t* const* wr, int64_t row_bytes, const float* const* xr, int64_t K, int64_t b0,
                         int64_t b1, __m512* acc_io) {
  if constexpr (kSuper512<F>) {  // units of 256 weights
    if (prefetch_nta()) span_k512_hint<F, NW, NX, true>(wr, row_bytes, xr, b0, b1, acc_io);
    else span_k512_hint<F, NW, NX, false>(wr, row_bytes, xr, b0, b1, acc_io);
  } else {
    if (prefetch_nta()) span_q512_hint<F, NW, NX, true>(wr, row_bytes, xr, K, b0, b1, acc_io);
    else span_q512_hint<F, NW, NX, false>(wr, row_bytes, xr, K, b0, b1, acc_io);
  }
}

// nw (1..4) weight rows x NX input rows: as many weight rows at once as 16 accumulators allow. Past
// 4 input rows x may not fit L1, so K runs in chunks whose slice of x (<= 16 KB) is read from L2
// once for all nw weight rows, the lane sums waiting in memory between chunks (the same additions
// in the same order).
template <int64_t F, int NX>
TS_AVX512 void rows_q512_nx(const uint8_t* const* wr, int64_t nw, int64_t row_bytes, const float* const* xr, int64_t K,
                            float (*out)[kMaxRows], int64_t r0) {
  constexpr int NW = NX <= 4 ? 4 : NX <= 8 ? 2 : 1;
  if constexpr (NX <= 4 && kBlock512<F>) {
    if (nw == kRowBlock) {
      __m512 a[4 * NX];
      if (prefetch_nta()) rows4_q512_hint<F, NX, true>(wr, row_bytes, xr + r0, K, a);
      else rows4_q512_hint<F, NX, false>(wr, row_bytes, xr + r0, K, a);
      store_sums<4, NX>(a, 4, out, r0);
      return;
    }
  }
  constexpr int64_t unit = kSuper512<F> ? 256 : 32;  // weights per block
  const int64_t nb = K / unit, chunk = NX <= 4 ? nb : std::max<int64_t>(1, 16 * 1024 / (NX * unit * 4));
  alignas(64) __m512 acc[kRowBlock * NX];
  for (int64_t j = 0; j < nw * NX; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += chunk) {
    const int64_t b1 = std::min(nb, b0 + chunk);
    int64_t i = 0;
    for (; i + NW <= nw; i += NW) span_q512<F, NW, NX>(wr + i, row_bytes, xr + r0, K, b0, b1, acc + i * NX);
    for (; i < nw; ++i) span_q512<F, 1, NX>(wr + i, row_bytes, xr + r0, K, b0, b1, acc + i * NX);
  }
  store_sums<kRowBlock, NX>(acc, nw, out, r0);
}

// R (1..16; more rows take the panel path) input rows in one pass.
template <int64_t F>
TS_AVX512 void rows_q512(const uint8_t* const* wr, int64_t nw, int64_t row_bytes, const float* const* xr, int64_t R,
                         int64_t K, float (*out)[kMaxRows]) {
  static_assert(kBlock512<F> || kSuper512<F>, "rows_q512: the block formats");
  switch (R) {
#define TS_Q512_CASE(n) \
  case n: rows_q512_nx<F, n>(wr, nw, row_bytes, xr, K, out, 0); break;
    TS_Q512_CASE(16) TS_Q512_CASE(15) TS_Q512_CASE(14) TS_Q512_CASE(13) TS_Q512_CASE(12) TS_Q512_CASE(11)
    TS_Q512_CASE(10) TS_Q512_CASE(9) TS_Q512_CASE(8) TS_Q512_CASE(7) TS_Q512_CASE(6) TS_Q512_CASE(5)
    TS_Q512_CASE(4) TS_Q512_CASE(3) TS_Q512_CASE(2) TS_Q512_CASE(1)
#undef TS_Q512_CASE
    default: TORCH_CHECK(false, "linear: rows_q512 takes 1..16 input rows, got ", R);
  }
}
#endif  // TS_X86


// ---------------------------------------------------------------------------------------------
// AVX-512 BF16 (vdpbf16ps), bfloat16 weights x inputs whose values are bfloat16 (a bfloat16 model's
// activations), many rows: the same bits as rows_avx512<BFloat16>, about 4x the multiply-adds per
// instruction. Per lane j, vdpbf16ps computes acc = fma(a[2j+1], b[2j+1], acc), then
// fma(a[2j], b[2j], acc) (isa.cpp's self-test checks this at first use; the products of two bfloat16
// are exact in float32), with denormal inputs read as zero and denormal results flushed. So the
// inputs are packed per 32 weights k0 .. k0+31 as pairs (odd element k0 + j, even k0 + 16 + j): lane j
// then adds k0 + j before k0 + 16 + j, lane order k = j, j + 16, j + 32, ... as the float32 kernels.
// The flushing never acts when every nonzero input and weight lies in [2^-50, 2^50): each product is
// then a multiple of 2^-114 (8-bit significands) at least 2^-100 and below 2^100, every running sum
// stays a multiple of 2^-114 (float32 rounds it to a coarser grid of the same kind), so no nonzero
// value falls below 2^-126 (and none overflows for K < 2^27). Rows of x outside this (or not bfloat16
// values) keep the float32 kernel (dpbf16_pack_x says so); weight rows are checked as packed.
#ifdef TS_X86
#define TS_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")))

// bfloat16 bits v & 0x7FFF of a weight: 0 or an exponent in [77, 177) (|w| in [2^-50, 2^50))
TS_AVX512BF16 inline __mmask32 dp_bad_w(__m512i w) {
  const __m512i a = _mm512_and_si512(w, _mm512_set1_epi16(0x7FFF));
  const __m512i am1 = _mm512_sub_epi16(a, _mm512_set1_epi16(1));  // 0 -> 0xFFFF (allowed)
  return _mm512_cmplt_epu16_mask(am1, _mm512_set1_epi16((77 << 7) - 1)) |
         _mm512_cmpge_epu16_mask(a, _mm512_set1_epi16(177 << 7));
}

// One row of float32 x [K] (K % 32 == 0) -> packed pairs p [K] (uint16); false when a value is not a
// bfloat16 or lies outside {0} U [2^-50, 2^50) (the row then keeps the float32 kernel).
TS_AVX512BF16 bool dpbf16_pack_x(const float* x, int64_t K, uint16_t* p) {
  const __m512i lo16 = _mm512_set1_epi32(0xFFFF), hi16 = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m512i absm = _mm512_set1_epi32(0x7FFFFFFF), one = _mm512_set1_epi32(1);
  const __m512i lim_lo = _mm512_set1_epi32((77 << 23) - 1), lim_hi = _mm512_set1_epi32(177 << 23);
  __mmask16 bad = 0;
  for (int64_t k = 0; k < K; k += 32) {
    const __m512i a = _mm512_loadu_si512(x + k), b = _mm512_loadu_si512(x + k + 16);
    bad |= _mm512_test_epi32_mask(a, lo16) | _mm512_test_epi32_mask(b, lo16);
    const __m512i aa = _mm512_and_si512(a, absm), ab = _mm512_and_si512(b, absm);
    bad |= _mm512_cmplt_epu32_mask(_mm512_sub_epi32(aa, one), lim_lo) | _mm512_cmpge_epu32_mask(aa, lim_hi);
    bad |= _mm512_cmplt_epu32_mask(_mm512_sub_epi32(ab, one), lim_lo) | _mm512_cmpge_epu32_mask(ab, lim_hi);
    // dword j: x[k + j] in the high (odd) half, x[k + 16 + j] in the low (even) half
    _mm512_storeu_si512(p + k, _mm512_or_si512(_mm512_and_si512(a, hi16), _mm512_srli_epi32(b, 16)));
  }
  return bad == 0;
}

// nw weight rows [K] -> packed pairs (K % 32 == 0) in pw [nw][K]; false when a weight lies outside
// {0} U [2^-50, 2^50).
TS_AVX512BF16 bool dpbf16_pack_w(const uint8_t* const* wr, int64_t nw, int64_t K, uint16_t* pw) {
  // word 2j <- k0 + 16 + j, word 2j + 1 <- k0 + j
  alignas(64) static const uint16_t kIdx[32] = {16, 0, 17, 1, 18, 2, 19, 3, 20, 4, 21, 5, 22, 6, 23, 7,
                                                24, 8, 25, 9, 26, 10, 27, 11, 28, 12, 29, 13, 30, 14, 31, 15};
  const __m512i idx = _mm512_load_si512(kIdx);
  __mmask32 bad = 0;
  for (int64_t i = 0; i < nw; ++i) {
    const uint16_t* w = reinterpret_cast<const uint16_t*>(wr[i]);
    uint16_t* dst = pw + i * K;
    const uint16_t* next = w + kRowBlock * K;  // the same row of the next row block (read next)
    const bool nta = prefetch_nta();
    for (int64_t k = 0; k < K; k += 32) {
      prefetch_weights(next + k, nta);
      const __m512i v = _mm512_loadu_si512(w + k);
      bad |= dp_bad_w(v);
      _mm512_storeu_si512(dst + k, _mm512_permutexvar_epi16(idx, v));
    }
  }
  return bad == 0;
}

// NW packed weight rows x NX packed input rows over all of K -> out[i][r0 + r].
template <int NW, int NX>
TS_AVX512BF16 void dp_tile(const uint16_t* pw, const uint16_t* const* px, int64_t K, float (*out)[kMaxRows], int64_t r0) {
  static_assert(NW >= 1 && NW <= 4 && NX >= 1 && NX <= 6, "dp_tile: 1-4 weight rows x 1-6 input rows");
  __m512 acc[NW][NX];
  for (int i = 0; i < NW; ++i)
    for (int r = 0; r < NX; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh x[NX];
    for (int r = 0; r < NX; ++r) x[r] = (__m512bh)_mm512_loadu_si512(px[r] + k);
    for (int i = 0; i < NW; ++i) {
      const __m512bh w = (__m512bh)_mm512_loadu_si512(pw + i * K + k);
      for (int r = 0; r < NX; ++r) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], w, x[r]);
    }
  }
  for (int i = 0; i < NW; ++i)
    for (int r = 0; r < NX; ++r)
      out[i][r0 + r] = combine_lanes_avx2(_mm512_castps512_ps256(acc[i][r]), _mm512_extractf32x8_ps(acc[i][r], 1));
}

template <int NW>
TS_AVX512BF16 void dp_rows(const uint16_t* pw, const uint16_t* const* px, int64_t R, int64_t K, float (*out)[kMaxRows]) {
  int64_t r = 0;
  for (; r + 6 <= R; r += 6) dp_tile<NW, 6>(pw, px + r, K, out, r);
  switch (R - r) {
    case 5: dp_tile<NW, 5>(pw, px + r, K, out, r); break;
    case 4: dp_tile<NW, 4>(pw, px + r, K, out, r); break;
    case 3: dp_tile<NW, 3>(pw, px + r, K, out, r); break;
    case 2: dp_tile<NW, 2>(pw, px + r, K, out, r); break;
    case 1: dp_tile<NW, 1>(pw, px + r, K, out, r); break;
    default: break;
  }
}

// One block of nw bfloat16 weight rows x R packed input rows (xr: the same rows in float32, for a
// weight row block the dot products must not take).
void rows_dpbf16(const uint8_t* const* wr, int64_t nw, const uint16_t* const* px, const float* const* xr, int64_t R,
                 int64_t K, float (*out)[kMaxRows]) {
  thread_local std::vector<uint16_t> pw;
  pw.resize(static_cast<size_t>(kRowBlock * K));
  if (!dpbf16_pack_w(wr, nw, K, pw.data())) {
    rows_avx512<c10::BFloat16>(wr, nw, xr, R, K, out);
    return;
  }
  switch (nw) {
    case 4: dp_rows<4>(pw.data(), px, R, K, out); break;
    case 3: dp_rows<3>(pw.data(), px, R, K, out); break;
    case 2: dp_rows<2>(pw.data(), px, R, K, out); break;
    default: dp_rows<1>(pw.data(), px, R, K, out); break;
  }
}
#endif  // TS_X86

// Dequantize nw rows into a float32 panel [nw, K] (same values on every path).
template <int64_t F>
void dequant_rows(const uint8_t* const* wr, int64_t nw, int64_t K, float* panel, Isa isa) {
  for (int64_t i = 0; i < nw; ++i) {
    float* dst = panel + i * K;
    for (int64_t k = 0; k < K; k += 2 * kLanes) {
      alignas(32) float w[2 * kLanes];
#ifdef TS_X86
      if (isa != Isa::kScalar) {
        dequant_step_store_avx2<F>(wr[i], k, K - k, w);
        if (kStep<F> == kLanes && k + kLanes < K) dequant_step_store_avx2<F>(wr[i], k + kLanes, K - k - kLanes, w + kLanes);
      } else
#endif
      {
        dequant16<F>(wr[i], k, K - k, w);
        if (k + kLanes < K) dequant16<F>(wr[i], k + kLanes, K - k - kLanes, w + kLanes);
      }
      std::memcpy(dst + k, w, sizeof(float) * std::min<int64_t>(2 * kLanes, K - k));
    }
  }
}

// One block of nw weight rows x R input rows at the ISA in force -> out[i][r].
template <int64_t F>
void compute_block(const uint8_t* const* wr, int64_t nw, int64_t row_bytes, const float* const* xr, int64_t R,
                   int64_t K, Isa isa, float (*out)[kMaxRows], std::vector<float>& panel) {
  if constexpr (kGrouped<F>) {
#ifdef TS_X86
    if (isa == Isa::kAvx512 && R <= kFusedRows512) {
      rows_q512<F>(wr, nw, row_bytes, xr, R, K, out);
      return;
    }
#endif
    // every other path: the rows back in GGUF order, then the GGUF format's kernels (same values)
    thread_local std::vector<uint8_t> plain;
    const uint8_t* pr[kRowBlock];
    ungroup_into(wr, nw, row_bytes, kBase<F>, plain, pr);
    compute_block<kBase<F>>(pr, nw, row_bytes, xr, R, K, isa, out, panel);
    return;
  } else {
  constexpr bool direct = F == kF32 || F == kBF16;  // the avx512 kernel reads these as they are
#ifdef TS_X86
  if (isa == Isa::kAvx512 && direct) {
    if constexpr (F == kF32) rows_avx512<float>(wr, nw, xr, R, K, out);
    else rows_avx512<c10::BFloat16>(wr, nw, xr, R, K, out);
    return;
  }
#endif
  if (!direct && R > (isa == Isa::kAvx512 ? kFusedRows512 : kFusedRows<F>)) {
    panel.resize(static_cast<size_t>(kRowBlock * K));
    dequant_rows<F>(wr, nw, K, panel.data(), isa);
    const uint8_t* pr[kRowBlock];
    for (int64_t i = 0; i < nw; ++i) pr[i] = reinterpret_cast<const uint8_t*>(panel.data() + i * K);
    compute_block<kF32>(pr, nw, 4 * K, xr, R, K, isa, out, panel);
    return;
  }
#ifdef TS_X86
  if constexpr (kBlock512<F> || kSuper512<F>) {
    if (isa == Isa::kAvx512 && R <= kFusedRows512) {
      rows_q512<F>(wr, nw, row_bytes, xr, R, K, out);
      return;
    }
  }
  if (isa != Isa::kScalar) {
    rows_avx2<F>(wr, nw, row_bytes, xr, R, K, out);
    return;
  }
#endif
  for (int64_t r = 0; r < R; r += kRowBlock) block_scalar<F>(wr, nw, xr + r, std::min(kRowBlock, R - r), K, out, r);
  }
}

using BlockFn = void (*)(const uint8_t* const*, int64_t, int64_t, const float* const*, int64_t, int64_t, Isa,
                         float (*)[kMaxRows], std::vector<float>&);

BlockFn block_fn(int64_t f) {
  switch (f) {
    case kF32: return &compute_block<kF32>;
    case kF16: return &compute_block<kF16>;
    case kBF16: return &compute_block<kBF16>;
    case kQ4_0: return &compute_block<kQ4_0>;
    case kQ4_1: return &compute_block<kQ4_1>;
    case kQ5_0: return &compute_block<kQ5_0>;
    case kQ8_0: return &compute_block<kQ8_0>;
    case kQ4_K: return &compute_block<kQ4_K>;
    case kQ5_K: return &compute_block<kQ5_K>;
    case kQ6_K: return &compute_block<kQ6_K>;
    case kQ4_0G: return &compute_block<kQ4_0G>;
    case kQ4_1G: return &compute_block<kQ4_1G>;
    case kQ5_0G: return &compute_block<kQ5_0G>;
    case kQ8_0G: return &compute_block<kQ8_0G>;
    default: TORCH_CHECK(false, "linear: unsupported weight format ", f);
  }
  return nullptr;
}

struct Segment {
  const uint8_t* w;
  int64_t rows, row_bytes, col0, block0;  // col0: first output column; block0: first work item
  BlockFn fn;
  int64_t format;
};

// Input rows per pass: up to kMaxRows, fewer when K is long, so that a pass's rows of x (read once
// per row block of weights) stay in L2 (kPassBytes of float32). Qwen2.5-1.5B's down projection
// (K = 8960) at 64 rows ran 1.25-1.45x faster in passes of 16 on the AVX-512 machine of
// bench/RESULTS.md (float32, Q4_K, Q6_K; 2026-11-27). The split into passes never changes a row's result.
constexpr int64_t kPassBytes = 384 * 1024;
inline int64_t rows_per_pass(int64_t K) {
  return std::clamp<int64_t>(kPassBytes / (4 * std::max<int64_t>(K, 1)) / 4 * 4, 16, kMaxRows);
}

// Work items [b0, b1) of segs in order: f(segment, its first row o0, rows nw, their row pointers).
template <typename F>
inline void for_each_block(const std::vector<Segment>& segs, int64_t b0, int64_t b1, F&& f) {
  size_t s = 0;
  for (int64_t b = b0; b < b1; ++b) {
    while (s + 1 < segs.size() && segs[s + 1].block0 <= b) ++s;
    const Segment& sg = segs[s];
    const int64_t o0 = (b - sg.block0) * kRowBlock, nw = std::min(kRowBlock, sg.rows - o0);
    const uint8_t* wr[kRowBlock];
    for (int64_t i = 0; i < nw; ++i) wr[i] = sg.w + (o0 + i) * sg.row_bytes;
    f(sg, o0, nw, wr);
  }
}

template <typename Y>
inline void store_block(const Segment& sg, int64_t o0, int64_t nw, const float (*out)[kMaxRows], const float* bias, Y* y,
                        int64_t N, int64_t c0, int64_t rc) {
  // row by row: the nw outputs of a row are adjacent in y (column by column, every store touched
  // another cache line: 20-40 % of a bfloat16 prefill's time went to this loop)
  const int64_t col = sg.col0 + o0;
  for (int64_t r = 0; r < rc; ++r) {
    Y* yr = y + (c0 + r) * N + col;
    for (int64_t i = 0; i < nw; ++i) yr[i] = static_cast<Y>(bias ? out[i][r] + bias[col + i] : out[i][r]);
  }
}

#ifdef TS_X86
// From this many input rows bfloat16 weights take the dot-product kernel (fewer: a decode step or a
// short verify, bound by reading the weights, where packing them costs more than it saves).
constexpr int64_t kDpbf16Rows = 4;

// run() through rows_dpbf16 when every row of x packs (false: nothing written, run() goes on).
template <typename Y>
bool run_dpbf16(const std::vector<Segment>& segs, int64_t nblocks, int64_t grain, const float* x, const float* bias,
                Y* y, int64_t N, int64_t K, int64_t R) {
  thread_local std::vector<uint16_t> packed;
  packed.resize(static_cast<size_t>(R * K));
  for (int64_t r = 0; r < R; ++r)
    if (!dpbf16_pack_x(x + r * K, K, packed.data() + r * K)) return false;
  const uint16_t* xp = packed.data();
  const int64_t pass = rows_per_pass(K);
  for (int64_t c0 = 0; c0 < R; c0 += pass) {
    const int64_t rc = std::min(pass, R - c0);
    at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
      float out[kRowBlock][kMaxRows];
      const float* xr[kMaxRows];
      const uint16_t* px[kMaxRows];
      for (int64_t r = 0; r < rc; ++r) {
        xr[r] = x + (c0 + r) * K;
        px[r] = xp + (c0 + r) * K;
      }
      for_each_block(segs, b0, b1, [&](const Segment& sg, int64_t o0, int64_t nw, const uint8_t* const* wr) {
        rows_dpbf16(wr, nw, px, xr, rc, K, out);
        store_block(sg, o0, nw, out, bias, y, N, c0, rc);
      });
    });
  }
  return true;
}
#endif

template <typename Y>
void run(const std::vector<Segment>& segs, int64_t nblocks, const float* x, const float* bias, Y* y, int64_t N,
         int64_t K, int64_t R) {
  const Isa isa = cpu_isa();
  // Enough blocks per task that the fork/join is amortised; the split never changes the result.
  const int64_t grain = std::max<int64_t>(1, nblocks / (4 * std::max(1, at::get_num_threads())));
  const int64_t pass = rows_per_pass(K);
#ifdef TS_X86
  if (R >= kDpbf16Rows && K % 32 == 0 && bf16_dot() &&
      std::all_of(segs.begin(), segs.end(), [](const Segment& sg) { return sg.format == kBF16; }) &&
      run_dpbf16(segs, nblocks, grain, x, bias, y, N, K, R))
    return;
#endif
  for (int64_t c0 = 0; c0 < R; c0 += pass) {
    const int64_t rc = std::min(pass, R - c0);
    at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
      thread_local std::vector<float> panel;
      float out[kRowBlock][kMaxRows];
      const float* xr[kMaxRows];
      for (int64_t r = 0; r < rc; ++r) xr[r] = x + (c0 + r) * K;
      for_each_block(segs, b0, b1, [&](const Segment& sg, int64_t o0, int64_t nw, const uint8_t* const* wr) {
        sg.fn(wr, nw, sg.row_bytes, xr, rc, K, isa, out, panel);
        store_block(sg, o0, nw, out, bias, y, N, c0, rc);
      });
    });
  }
}

}  // namespace

int64_t format_row_bytes(int64_t format, int64_t K) {
  const FormatInfo fi = checked_info(format);
  TORCH_CHECK(K % fi.block == 0, "linear: a ", fi.name, " row holds a multiple of ", fi.block, " weights, got K = ", K);
  return K / fi.block * fi.bytes;
}

int64_t dense_format(const at::Tensor& w) {
  switch (w.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    default: return -1;
  }
}

namespace {

// The weight segments of one linear (checked against K), as work items of kRowBlock rows; `keep`
// holds the tensors the segments point into.
std::vector<Segment> segments(at::TensorList weights, at::IntArrayRef formats, int64_t K, std::vector<at::Tensor>& keep,
                              int64_t* N_out, int64_t* nblocks_out) {
  TORCH_CHECK(!weights.empty() && weights.size() == formats.size(), "linear: weights and formats must be non-empty "
              "lists of the same length, got ", weights.size(), " and ", formats.size());
  TORCH_CHECK(K > 0, "linear: x must have K > 0 features");
  std::vector<Segment> segs;
  int64_t N = 0, nblocks = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    const int64_t f = formats[i];
    const FormatInfo fi = checked_info(f);
    TORCH_CHECK(interleaved_base(f) < 0, "linear: weights[", i, "] has the interleaved format ", fi.name, " (", f,
                "), which only activations=8 reads; de-interleave it (reference.deinterleave_blocks) for exact "
                "activations");
    TORCH_CHECK(w.dim() == 2 && w.is_cpu() && !w.is_mkldnn(), "linear: weights[", i,
                "] must be a dense 2-D CPU tensor, got ", w.sizes());
    int64_t row_bytes;
    if (fi.block == 1) {
      TORCH_CHECK(dense_format(w) == f, "linear: weights[", i, "] has dtype ", w.scalar_type(), " but format ", f,
                  " (", fi.name, ")");
      TORCH_CHECK(w.size(1) == K, "linear: x has ", K, " features, weights[", i, "] expects ", w.size(1));
      row_bytes = K * fi.bytes;
    } else {
      row_bytes = format_row_bytes(f, K);
      TORCH_CHECK(w.scalar_type() == at::kByte && w.size(1) == row_bytes, "linear: weights[", i, "] (", fi.name,
                  ", K = ", K, ") must be uint8 [N, ", row_bytes, "], got ", w.scalar_type(), " ", w.sizes());
    }
    keep.push_back(w.contiguous());
    segs.push_back({static_cast<const uint8_t*>(keep.back().data_ptr()), w.size(0), row_bytes, N, nblocks,
                    block_fn(f), f});
    N += w.size(0);
    nblocks += (w.size(0) + kRowBlock - 1) / kRowBlock;
  }
  *N_out = N;
  *nblocks_out = nblocks;
  return segs;
}

bool int8_path(int64_t K, at::TensorList weights, at::IntArrayRef formats, int64_t activations) {
  return activations == 8 && !weights.empty() && weights.size() == formats.size() && K % 32 == 0 &&
         std::all_of(formats.begin(), formats.end(), int8_format);
}

}  // namespace

void linear_f32(const float* x, int64_t R, int64_t K, at::TensorList weights, at::IntArrayRef formats,
                const float* bias, float* y, int64_t activations) {
  if (int8_path(K, weights, formats, activations)) {
    linear_int8_f32(x, R, K, weights, formats, bias, y);
    return;
  }
  std::vector<at::Tensor> keep;
  int64_t N, nblocks;
  const std::vector<Segment> segs = segments(weights, formats, K, keep, &N, &nblocks);
  if (R > 0 && N > 0) run(segs, nblocks, x, bias, y, N, K, R);
}

at::Tensor linear(const at::Tensor& x, at::TensorList weights, at::IntArrayRef formats,
                  const std::optional<at::Tensor>& bias, int64_t activations) {
  TORCH_CHECK(x.dim() >= 1 && x.is_cpu(), "linear: x must be a CPU tensor [..., K], got ", x.sizes());
  TORCH_CHECK(activations == 0 || activations == 8, "linear: activations must be 0 (exact) or 8 (int8), got ",
              activations);
  if (int8_path(x.size(-1), weights, formats, activations)) return linear_int8(x, weights, formats, bias);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "linear: x dtype must be float32, bfloat16 or float16, got ", x.scalar_type());
  const int64_t K = x.size(-1);
  std::vector<at::Tensor> keep;
  int64_t N, nblocks;
  const std::vector<Segment> segs = segments(weights, formats, K, keep, &N, &nblocks);
  const int64_t R = x.numel() / K;
  at::Tensor xf = x.reshape({R, K}).to(at::kFloat).contiguous();
  std::optional<at::Tensor> bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "linear: bias has ", bias->numel(), " elements, expected ", N);
    bf = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bf ? bf->data_ptr<float>() : nullptr;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(N);
  at::Tensor y = at::empty(shape, x.options());
  if (R == 0 || N == 0) return y;
  switch (x.scalar_type()) {
    case at::kBFloat16: run(segs, nblocks, xf.data_ptr<float>(), bp, y.data_ptr<c10::BFloat16>(), N, K, R); break;
    case at::kHalf: run(segs, nblocks, xf.data_ptr<float>(), bp, y.data_ptr<c10::Half>(), N, K, R); break;
    default: run(segs, nblocks, xf.data_ptr<float>(), bp, y.data_ptr<float>(), N, K, R); break;
  }
  return y;
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_cpu() && !weight.is_mkldnn(),
              "small_linear: weight must be a dense 2-D CPU tensor, got ", weight.sizes());
  const int64_t f = dense_format(weight);
  TORCH_CHECK(f >= 0, "small_linear: weight dtype must be float32, float16 or bfloat16, got ", weight.scalar_type());
  return linear(x, {weight}, {f}, bias);
}

at::Tensor dequantize(const at::Tensor& raw, int64_t format, int64_t K) {
  const FormatInfo fi = checked_info(format);
  TORCH_CHECK(fi.block > 1, "dequantize: format ", fi.name, " is not a block format (use .float())");
  const int64_t row_bytes = format_row_bytes(format, K);
  TORCH_CHECK(raw.dim() == 2 && raw.is_cpu() && raw.scalar_type() == at::kByte && raw.size(1) == row_bytes,
              "dequantize: raw must be uint8 [N, ", row_bytes, "] on CPU for ", fi.name, " with K = ", K, ", got ",
              raw.scalar_type(), " ", raw.sizes());
  at::Tensor r = raw.contiguous();
  const int64_t base = grouped_base(format);
  if (base >= 0) {  // back to GGUF order, then as the GGUF format (the same values)
    at::Tensor plain = at::empty_like(r);
    regroup_rows(r.data_ptr<uint8_t>(), plain.data_ptr<uint8_t>(), r.size(0), K / 32, fi.bytes, header_halves(base),
                 false);
    return dequantize(plain, base, K);
  }
  const int64_t ibase = interleaved_base(format);
  if (ibase >= 0) {
    TORCH_CHECK(r.size(0) % kInterleaveRows == 0, "dequantize: ", fi.name, " holds rows in groups of ",
                kInterleaveRows, ", got ", r.size(0), " rows");
    at::Tensor plain = at::empty_like(r);
    deinterleave_rows(r.data_ptr<uint8_t>(), plain.data_ptr<uint8_t>(), r.size(0), K / 32, ibase);
    return dequantize(plain, ibase, K);
  }
  at::Tensor out = at::empty({raw.size(0), K}, raw.options().dtype(at::kFloat));
  const uint8_t* src = r.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  const Isa isa = cpu_isa();
  at::parallel_for(0, raw.size(0), 16, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const uint8_t* row = src + i * row_bytes;
      switch (format) {
        case kQ4_0: dequant_rows<kQ4_0>(&row, 1, K, dst + i * K, isa); break;
        case kQ4_1: dequant_rows<kQ4_1>(&row, 1, K, dst + i * K, isa); break;
        case kQ5_0: dequant_rows<kQ5_0>(&row, 1, K, dst + i * K, isa); break;
        case kQ8_0: dequant_rows<kQ8_0>(&row, 1, K, dst + i * K, isa); break;
        case kQ4_K: dequant_rows<kQ4_K>(&row, 1, K, dst + i * K, isa); break;
        case kQ5_K: dequant_rows<kQ5_K>(&row, 1, K, dst + i * K, isa); break;
        default: dequant_rows<kQ6_K>(&row, 1, K, dst + i * K, isa); break;
      }
    }
  });
  return out;
}

TORCH_LIBRARY_IMPL(turbospec, CPU, m) {
  m.impl("linear", &linear);
  m.impl("small_linear", &small_linear);
  m.impl("dequantize", &dequantize);
}

}  // namespace turbospec

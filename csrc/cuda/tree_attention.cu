// tree_attention, CUDA: the attention of the target's verify pass over one layer's static KV cache
// (spec: reference.tree_attention; CPU twin: csrc/cpu/tree_attention.cpp).
//
// Variant: split-K ("flash-decoding"). Grid (B * Hkv * row groups, splits). A block (4 warps) owns
// up to 64 rows of one kv head -- rows are the (query i, head of the GQA group) pairs reading that
// head, row = i * G + head, warp w takes rows [16w, 16w + 16) -- and one chunk of its keys. The
// block stages tiles of KT keys (K and V, all of D) in shared memory with 16-byte cp.async copies
// (double-buffered: the next tile loads while the current one is used), zero-filling whatever lies
// outside the chunk; each warp then runs one flash-attention step on its 16 rows, in float32 and
// base 2 (scores times scale * log2(e)):
//   S = Q K^T   bfloat16 / float16: tensor cores (mma.sync m16n8k16, float32 accumulate, sm_80+);
//               float32: CUDA cores, computing the same accumulator layout;
//   mask (tree bits for keys >= cache_len, chunk end) -> running max and sum (quad shuffles);
//   O += P V    tensor cores (P rounded to q's dtype, as flash attention does) or CUDA cores.
// Chunks are derived ON THE DEVICE from cache_len: the keys [start, cache_len + n) (start = 0, or
// cache_len without the prefix) are cut into `splits` chunks of equal length, a multiple of 32 and
// at least min_chunk; blocks past the last chunk exit at once. `splits` is chosen on the host from S
// (the static cache length), the SM count and the number of (batch row, kv head, row group) units,
// never from cache_len: the op reads no device value on the host and can be captured in a CUDA graph
// whose replays see other cache lengths.
// With one split a block writes out and lse itself. Otherwise it writes its chunk's partial result
// (o / l and lse, float32) to a workspace allocated per call from the caching allocator (capture-
// safe: a graph keeps its own pool) and a second kernel merges the active splits by log-sum-exp, one
// warp per output row. A batch row with cache_len < 0 or cache_len + n > S is not read at all: it
// attends no key (out = 0, lse = -inf). Tree-mask bits >= n are ignored.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "../checks.h"
#include "common.cuh"
#include "launch.cuh"

namespace turbospec {
namespace gpu {

#ifdef TURBOSPEC_EMULATE
// Test hooks (tests/ops/cuda_emu): the SM count the split heuristic sees, and forced splits / chunk size.
inline int attn_emu_sms = 4, attn_emu_splits = 0, attn_emu_min_chunk = 0;
#endif

namespace {

constexpr int kAttnWarps = 4;
constexpr int kAttnThreads = kAttnWarps * kWarpSize;
constexpr int kAttnRowsPerBlock = kAttnWarps * 16;
constexpr int kAttnChunkAlign = 32;  // chunk lengths are multiples of every key tile
constexpr int kAttnMaxSplits = 64;
constexpr float kAttnLog2e = 1.4426950408889634f;
constexpr float kAttnLn2 = 0.6931471805599453f;

template <int kType>
struct AttnElem {
  using type = uint16_t;  // bfloat16 / float16 bits
};
template <>
struct AttnElem<kF32> {
  using type = float;
};

// Keys per tile: two K and two V tiles (double buffering) must fit the 48 KB of static shared memory.
template <int kType, int DP>
constexpr int attn_key_tile() {
  return kType == kF32 ? (DP <= 64 ? 32 : DP == 128 ? 16 : 8) : (DP <= 128 ? 32 : 16);
}

struct AttnParams {
  const void* q;  // [B, n, Hq, D]: rows 16-byte aligned, last dim contiguous
  int64_t qs0, qs1, qs2;
  const void* k;  // [B, Hkv, S, D], last dim contiguous
  const void* v;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;
  const int64_t* cache_len;  // [B]
  const int64_t* mask;       // [B, n]
  void* out;                 // [B, n, Hq, D] contiguous
  float* lse;                // [B, Hq, n] contiguous, or nullptr
  float* part_o;             // [splits, B, n, Hq, D] (splits > 1)
  float* part_lse;           // [splits, B, n, Hq]
  int B, n, Hq, Hkv, G, D, R, row_groups, splits, min_chunk;
  int64_t S;
  float scale_log2;
  float softcap_log2;  // 0, or the logit soft-cap in log2 units (cap * log2(e)): s -> cap tanh(s / cap)
  int64_t window;      // 0, or the sliding window: a query at cache_len + depth attends positions > its own - window
  bool include_prefix, vec_kv;
};

__device__ __forceinline__ float attn_neg_inf() { return __uint_as_float(0xff800000u); }

__device__ __forceinline__ float2 attn_float2(float x, float y) {
  float2 r;
  r.x = x;
  r.y = y;
  return r;
}

// Shared memory of the main kernel: two buffers of the K and V tiles [KT, LD] and, for float32,
// P [warps, 16, PLD].
template <typename E, int KT, int LD, int PN>
struct alignas(16) AttnSmem {
  E k[2][KT * LD];
  E v[2][KT * LD];
  float p[PN];
};

// 16 bytes global -> shared without passing through registers (cp.async, sm_80+), zeros when !valid;
// elsewhere (emulator, older GPUs: float32 only) a plain copy. Visible after attn_cp_wait + a barrier.
__device__ __forceinline__ void attn_cp_async16(void* smem, const void* gmem, bool valid) {
#if defined(TURBOSPEC_EMULATE)
  if (valid) memcpy(smem, gmem, 16);
  else memset(smem, 0, 16);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
#else
  uint4 r;
  r.x = r.y = r.z = r.w = 0u;
  if (valid) r = *static_cast<const uint4*>(gmem);
  *static_cast<uint4*>(smem) = r;
#endif
}

__device__ __forceinline__ void attn_cp_commit() {
#if !defined(TURBOSPEC_EMULATE) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most `pending` of this thread's committed copy groups are still in flight.
template <int pending>
__device__ __forceinline__ void attn_cp_wait() {
#if !defined(TURBOSPEC_EMULATE) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending));
#endif
}

// The keys of batch row b and how they are cut: chunk s covers [start + s * chunk, ...) up to end.
struct AttnChunks {
  int64_t start, end, chunk;
  int active;  // chunks holding at least one key (0: the row attends nothing)
};

__device__ __forceinline__ AttnChunks attn_chunks(const AttnParams& P, int b) {
  const int64_t len = P.cache_len[b];
  AttnChunks c{0, 0, kAttnChunkAlign, 0};
  if (len < 0 || len > P.S - P.n) return c;  // out-of-range row: read nothing
  c.start = P.include_prefix ? 0 : len;
  if (P.window > 0 && P.include_prefix) {  // no query attends a key before the root's window
    const int64_t lo = len + 1 - P.window;
    c.start = lo > 0 ? lo : 0;
  }
  c.end = len + P.n;
  const int64_t total = c.end - c.start;
  int64_t chunk = (total + P.splits - 1) / P.splits;
  chunk = (chunk + kAttnChunkAlign - 1) / kAttnChunkAlign * kAttnChunkAlign;
  c.chunk = chunk > P.min_chunk ? chunk : P.min_chunk;
  c.active = static_cast<int>((total + c.chunk - 1) / c.chunk);
  return c;
}

// ---------------------------------------------------------------------------------------------
// 16-bit conversions (round to nearest even; NaN stays NaN) and the tensor-core product.
template <int kType>
__device__ __forceinline__ float attn_to_float(uint16_t h) {
  return kType == kBF16 ? __uint_as_float(static_cast<uint32_t>(h) << 16) : half_bits_to_float(h);
}

template <int kType>
__device__ __forceinline__ uint32_t attn_from_float(float f) {
  if (kType == kBF16) {
    const uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  }
#ifdef TURBOSPEC_EMULATE
  return c10::Half(f).x;
#else
  return __half_as_ushort(__float2half_rn(f));
#endif
}

template <int kType>
__device__ __forceinline__ uint32_t attn_pack(float lo, float hi) {
  return attn_from_float<kType>(lo) | (attn_from_float<kType>(hi) << 16);
}

__device__ __forceinline__ uint32_t attn_ld32(const uint16_t* p) { return *reinterpret_cast<const uint32_t*>(p); }

// c[16 x 8] += a[16 x 16] b[16 x 8] over one warp, in the fragment layout of mma.sync m16n8k16
// (lane = 4 g + t): a = {(g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)} as [row, k];
// b = {(k = 2t..2t+1, n = g), (k = 2t+8.., n = g)}; c = {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)}.
template <int kType>
__device__ __forceinline__ void attn_mma(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(TURBOSPEC_EMULATE)
  // The warp's fragments meet in shared slots; each lane then computes its own 4 outputs.
  static uint32_t fa[kAttnThreads][4], fb[kAttnThreads][2];
  const int tid = threadIdx.x, lane = tid % kWarpSize, base = tid - lane, g = lane >> 2, t = lane & 3;
  for (int i = 0; i < 4; ++i) fa[tid][i] = a[i];
  for (int i = 0; i < 2; ++i) fb[tid][i] = b[i];
  __syncwarp();
  auto elem = [](uint32_t w, int k) { return attn_to_float<kType>(static_cast<uint16_t>(k % 2 ? w >> 16 : w)); };
  float r[4];
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
    float acc = c[e];
    for (int k = 0; k < 16; ++k) {
      const float x = elem(fa[base + (row % 8) * 4 + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)], k);
      const float y = elem(fb[base + col * 4 + (k % 8) / 2][k >= 8], k);
      acc = std::fma(x, y, acc);
    }
    r[e] = acc;
  }
  __syncwarp();
  for (int e = 0; e < 4; ++e) c[e] = r[e];
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kType == kBF16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#else
  __trap();  // the host entry refuses 16-bit inputs below compute capability 8.0
#endif
}

// ---------------------------------------------------------------------------------------------
// Main kernel: one (batch row, kv head, row group, split) per block. Register budget: 3 blocks per
// SM up to D = 64 (<= 170 registers), 2 for D = 128 (the O accumulator alone is 64 registers), 1 above.
constexpr int attn_min_blocks(int DP) { return DP <= 64 ? 3 : DP <= 128 ? 2 : 1; }

template <int kType, int DP>
__global__ void __launch_bounds__(kAttnThreads, attn_min_blocks(DP)) tree_attention_kernel(const AttnParams P) {
  using E = typename AttnElem<kType>::type;
  constexpr int KT = attn_key_tile<kType, DP>();
  constexpr int EPC = 16 / static_cast<int>(sizeof(E));  // elements per 128-bit chunk
  constexpr int LD = DP + EPC;                             // smem row stride: +16 bytes against bank conflicts
  constexpr int NT = KT / 8, DT = DP / 8;                  // 8-wide key / feature tiles of a warp
  constexpr int CPR = DP / EPC;                            // chunks per key row
  constexpr int PER = 2 * KT * CPR / kAttnThreads;         // chunks per thread and tile (K and V)
  static_assert(2 * KT * CPR % kAttnThreads == 0, "tile chunks must divide among the threads");
  constexpr int PLD = KT + 4;                              // float32 path: P row stride
  __shared__ AttnSmem<E, KT, LD, kType == kF32 ? kAttnWarps * 16 * PLD : 4> sm;
  float* const p_s = sm.p;

  const int rg = blockIdx.x % P.row_groups, bh = blockIdx.x / P.row_groups;
  const int hk = bh % P.Hkv, b = bh / P.Hkv, split = blockIdx.y;
  const bool direct = P.splits == 1;
  const AttnChunks ch = attn_chunks(P, b);
  if (split >= ch.active && !direct) return;  // block-uniform; the merge reads active chunks only
  int64_t c0 = ch.start + split * ch.chunk;
  int64_t c1 = c0 + ch.chunk < ch.end ? c0 + ch.chunk : ch.end;
  if (split >= ch.active) c0 = c1 = 0;  // direct and nothing to attend: write zeros / -inf below
  const int64_t len = P.cache_len[b];

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize, g = lane >> 2, t = lane & 3;
  const int r0 = rg * kAttnRowsPerBlock + warp * 16;
  const bool warp_active = r0 < P.R;  // warp-uniform
  const int D = P.D, G = P.G;
  // This lane's two rows: g and g + 8 of the warp (clamped for loads; rows >= R are never written).
  int qi[2], head[2];
  bool row_ok[2];
  const E* qrow[2];
  uint64_t bits[2];
  for (int rr = 0; rr < 2; ++rr) {
    const int row = r0 + g + 8 * rr;
    row_ok[rr] = row < P.R;
    const int rc = row_ok[rr] ? row : P.R - 1;
    qi[rr] = rc / G;
    head[rr] = hk * G + rc % G;
    qrow[rr] = static_cast<const E*>(P.q) + b * P.qs0 + qi[rr] * P.qs1 + head[rr] * P.qs2;
    bits[rr] = static_cast<uint64_t>(P.mask[static_cast<int64_t>(b) * P.n + qi[rr]]);
  }
  // Sliding window: a new token's position is len + its depth (its mask bits, itself included, less one);
  // row rr attends keys at positions >= lo[rr].
  // (int32: positions stay below S)
  const uint64_t keep = P.n >= 64 ? ~0ull : (1ull << P.n) - 1;
  int lo[2] = {0, 0};
  if (P.window > 0)
    for (int rr = 0; rr < 2; ++rr) lo[rr] = static_cast<int>(len - P.window) + __popcll(bits[rr] & keep);

  // Q fragments (16-bit path): held in registers for D <= 128, reloaded per tile for D = 256 (L1 hits).
  constexpr bool kHoldQ = DP <= 128;
  constexpr int KS = DP / 16;
  uint32_t qa[kType != kF32 && kHoldQ ? KS : 1][4];
  auto load_qa = [&](int ks, uint32_t (&a)[4]) {
    const int c = ks * 16 + 2 * t;
    const uint16_t* q0 = reinterpret_cast<const uint16_t*>(qrow[0]);
    const uint16_t* q1 = reinterpret_cast<const uint16_t*>(qrow[1]);
    a[0] = c < D ? attn_ld32(q0 + c) : 0u;
    a[1] = c < D ? attn_ld32(q1 + c) : 0u;
    a[2] = c + 8 < D ? attn_ld32(q0 + c + 8) : 0u;
    a[3] = c + 8 < D ? attn_ld32(q1 + c + 8) : 0u;
  };
  if constexpr (kType != kF32 && kHoldQ) {
    if (warp_active) {
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) load_qa(ks, qa[ks]);
    }
  }

  float o[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m[2] = {attn_neg_inf(), attn_neg_inf()}, l[2] = {0.f, 0.f};

  const E* const kbase = static_cast<const E*>(P.k) + b * P.ks0 + hk * P.ks1;
  const E* const vbase = static_cast<const E*>(P.v) + b * P.vs0 + hk * P.vs1;
  // Stage the tile at p0 into buffer buf: its 2 KT CPR 16-byte chunks (K, then V), PER per thread;
  // rows past the chunk end and columns past D are zeros.
  auto stage = [&](int64_t p0, int buf) {
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int x = threadIdx.x + u * kAttnThreads, is_v = x >= KT * CPR, c = x - is_v * KT * CPR;
      const int row = c / CPR, col = c % CPR * EPC;
      const int64_t pos = p0 + row;
      const bool ok = pos < c1 && col < D;
      E* dst = (is_v ? sm.v[buf] : sm.k[buf]) + row * LD + col;
      const E* src = !ok ? kbase : is_v ? vbase + pos * P.vs2 + col : kbase + pos * P.ks2 + col;
      if (P.vec_kv) {
        attn_cp_async16(dst, src, ok);
      } else {
        for (int e = 0; e < EPC; ++e) dst[e] = ok ? src[e] : E(0);
      }
    }
    attn_cp_commit();
  };
  const int ntiles = c1 > c0 ? static_cast<int>((c1 - c0 + KT - 1) / KT) : 0;
  if (ntiles > 0) stage(c0, 0);
  for (int it = 0; it < ntiles; ++it) {
    const int buf = it & 1;
    const int64_t p0 = c0 + static_cast<int64_t>(it) * KT;
    if (it + 1 < ntiles) {  // prefetch the next tile into the other buffer, then wait for this one
      stage(p0 + KT, buf ^ 1);
      attn_cp_wait<1>();
    } else {
      attn_cp_wait<0>();
    }
    const E* const k_s = sm.k[buf];
    const E* const v_s = sm.v[buf];
    // Key 8 j + 2 t + c of the tile is allowed iff it is before the chunk end (lim) and in the prefix
    // (before tree0) or a tree key whose bit is set; int32 offsets (p0 < c1 <= len + n).
    const int lim = static_cast<int>(c1 - p0 < KT ? c1 - p0 : KT);
    const int tree0 = static_cast<int>(len - p0 < KT ? len - p0 : KT);
    __syncthreads();
    if (warp_active) {
      // S = Q K^T for the warp's 16 rows x KT keys.
      float s[NT][4];
#pragma unroll
      for (int j = 0; j < NT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
      if constexpr (kType == kF32) {
        for (int d = 0; d < D; d += 4) {
          const float4 x0 = *reinterpret_cast<const float4*>(qrow[0] + d);
          const float4 x1 = *reinterpret_cast<const float4*>(qrow[1] + d);
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            const float* kr = k_s + (8 * j + 2 * t) * LD + d;
            const float4 y0 = *reinterpret_cast<const float4*>(kr);
            const float4 y1 = *reinterpret_cast<const float4*>(kr + LD);
            s[j][0] += x0.x * y0.x + x0.y * y0.y + x0.z * y0.z + x0.w * y0.w;
            s[j][1] += x0.x * y1.x + x0.y * y1.y + x0.z * y1.z + x0.w * y1.w;
            s[j][2] += x1.x * y0.x + x1.y * y0.y + x1.z * y0.z + x1.w * y0.w;
            s[j][3] += x1.x * y1.x + x1.y * y1.y + x1.z * y1.z + x1.w * y1.w;
          }
        }
      } else {
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          if (ks * 16 >= D) break;
          uint32_t a[4];
          if constexpr (kHoldQ) {
#pragma unroll
            for (int x = 0; x < 4; ++x) a[x] = qa[ks][x];
          } else {
            load_qa(ks, a);
          }
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            const uint16_t* kr = k_s + (8 * j + g) * LD + ks * 16 + 2 * t;
            const uint32_t bf[2] = {attn_ld32(kr), attn_ld32(kr + 8)};
            attn_mma<kType>(s[j], a, bf);
          }
        }
      }
      // Scale, mask, online softmax (row rr of the lane is g + 8 rr; e = 2 rr + column).
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        float tile_max = attn_neg_inf();
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int key = 8 * j + 2 * t + c;
            bool ok = key < lim && (key < tree0 || ((bits[rr] >> (key - tree0)) & 1u));
            if (ok && P.window > 0) {  // position: the key's slot, or len + its depth for a tree key
              const int slot = static_cast<int>(p0) + key;
              const int pos = key < tree0 ? slot
                  : static_cast<int>(len) - 1 + __popcll(static_cast<uint64_t>(P.mask[b * P.n + (slot - len)]) & keep);
              ok = pos >= lo[rr];
            }
            float x = s[j][2 * rr + c] * P.scale_log2;
            if (P.softcap_log2 > 0.f) x = P.softcap_log2 * tanhf(x / P.softcap_log2);
            x = ok ? x : attn_neg_inf();
            s[j][2 * rr + c] = x;
            tile_max = fmaxf(tile_max, x);
          }
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 1));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 2));
        const float m_new = fmaxf(m[rr], tile_max);
        const bool none = m_new == attn_neg_inf();  // nothing attended yet: P = 0, nothing to rescale
        const float alpha = none ? 1.f : exp2f(m[rr] - m_new);
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float p = none ? 0.f : exp2f(s[j][2 * rr + c] - m_new);
            s[j][2 * rr + c] = p;
            sum += p;
          }
        }
        l[rr] = l[rr] * alpha + sum;
        m[rr] = m_new;
#pragma unroll
        for (int i = 0; i < DT; ++i) {
          o[i][2 * rr] *= alpha;
          o[i][2 * rr + 1] *= alpha;
        }
      }
      // O += P V
      if constexpr (kType == kF32) {
        float* pw = p_s + warp * 16 * PLD;
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) pw[(g + 8 * (e >> 1)) * PLD + 8 * j + 2 * t + (e & 1)] = s[j][e];
        __syncwarp();
#pragma unroll 4
        for (int k = 0; k < KT; ++k) {
          const float pa = pw[g * PLD + k], pb = pw[(g + 8) * PLD + k];
          const float* vr = v_s + k * LD + 2 * t;
#pragma unroll
          for (int i = 0; i < DT; ++i) {
            if (8 * i >= D) break;
            const float2 vv = *reinterpret_cast<const float2*>(vr + 8 * i);
            o[i][0] += pa * vv.x;
            o[i][1] += pa * vv.y;
            o[i][2] += pb * vv.x;
            o[i][3] += pb * vv.y;
          }
        }
        __syncwarp();
      } else {
#pragma unroll
        for (int kk = 0; kk < KT / 16; ++kk) {
          const uint32_t a[4] = {attn_pack<kType>(s[2 * kk][0], s[2 * kk][1]),
                                 attn_pack<kType>(s[2 * kk][2], s[2 * kk][3]),
                                 attn_pack<kType>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                 attn_pack<kType>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
          const uint16_t* vr = v_s + (16 * kk + 2 * t) * LD + g;
#pragma unroll
          for (int i = 0; i < DT; ++i) {
            if (8 * i >= D) break;
            const uint16_t* v0 = vr + 8 * i;
            const uint32_t bf[2] = {static_cast<uint32_t>(v0[0]) | (static_cast<uint32_t>(v0[LD]) << 16),
                                    static_cast<uint32_t>(v0[8 * LD]) | (static_cast<uint32_t>(v0[9 * LD]) << 16)};
            attn_mma<kType>(o[i], a, bf);
          }
        }
      }
    }
    __syncthreads();
  }

  if (!warp_active) return;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    l[rr] += __shfl_xor_sync(kFullMask, l[rr], 1);
    l[rr] += __shfl_xor_sync(kFullMask, l[rr], 2);
  }
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    if (!row_ok[rr]) continue;
    const float inv = l[rr] > 0.f ? 1.f / l[rr] : 0.f;
    const float lse = l[rr] > 0.f ? (m[rr] + log2f(l[rr])) * kAttnLn2 : attn_neg_inf();
    const int64_t idx = (static_cast<int64_t>(b) * P.n + qi[rr]) * P.Hq + head[rr];  // output row
    if (direct) {
      E* dst = static_cast<E*>(P.out) + idx * D + 2 * t;
#pragma unroll
      for (int i = 0; i < DT; ++i) {
        if (8 * i >= D) break;
        const float x = o[i][2 * rr] * inv, y = o[i][2 * rr + 1] * inv;
        if constexpr (kType == kF32) {
          *reinterpret_cast<float2*>(dst + 8 * i) = attn_float2(x, y);
        } else {
          *reinterpret_cast<uint32_t*>(dst + 8 * i) = attn_pack<kType>(x, y);
        }
      }
      if (t == 0 && P.lse != nullptr) P.lse[(static_cast<int64_t>(b) * P.Hq + head[rr]) * P.n + qi[rr]] = lse;
    } else {
      const int64_t prow = static_cast<int64_t>(split) * P.B * P.n * P.Hq + idx;
      float* dst = P.part_o + prow * D + 2 * t;
#pragma unroll
      for (int i = 0; i < DT; ++i) {
        if (8 * i >= D) break;
        *reinterpret_cast<float2*>(dst + 8 * i) = attn_float2(o[i][2 * rr] * inv, o[i][2 * rr + 1] * inv);
      }
      if (t == 0) P.part_lse[prow] = lse;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Merge of the splits: one warp per output row (b, i, h), lanes over D (4 features each, twice for
// D > 128). out = sum_s w_s o_s / sum_s w_s with w_s = exp(lse_s - max lse), lse = max + log(sum w).
template <int kType>
__global__ void __launch_bounds__(kAttnThreads) tree_attention_merge_kernel(const AttnParams P) {
  using E = typename AttnElem<kType>::type;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t rows = static_cast<int64_t>(P.B) * P.n * P.Hq;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kAttnWarps + threadIdx.x / kWarpSize; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kAttnWarps) {
    const int h = static_cast<int>(row % P.Hq), i = static_cast<int>(row / P.Hq % P.n);
    const int b = static_cast<int>(row / (static_cast<int64_t>(P.Hq) * P.n));
    const int active = attn_chunks(P, b).active;
    float mx = attn_neg_inf();
    for (int s = 0; s < active; ++s) mx = fmaxf(mx, P.part_lse[s * rows + row]);
    float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}}, wsum = 0.f;
    if (mx != attn_neg_inf()) {
      for (int s = 0; s < active; ++s) {
        const float w = exp2f((P.part_lse[s * rows + row] - mx) * kAttnLog2e);
        wsum += w;
        const float* src = P.part_o + (s * rows + row) * P.D;
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          const int d = 4 * lane + 128 * x;
          if (d >= P.D) break;
          const float4 v = *reinterpret_cast<const float4*>(src + d);
          acc[x][0] += w * v.x;
          acc[x][1] += w * v.y;
          acc[x][2] += w * v.z;
          acc[x][3] += w * v.w;
        }
      }
    }
    const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
    E* dst = static_cast<E*>(P.out) + row * P.D;
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const int d = 4 * lane + 128 * x;
      if (d >= P.D) break;
      if constexpr (kType == kF32) {
        float4 v;
        v.x = acc[x][0] * inv;
        v.y = acc[x][1] * inv;
        v.z = acc[x][2] * inv;
        v.w = acc[x][3] * inv;
        *reinterpret_cast<float4*>(dst + d) = v;
      } else {
        uint2 v;
        v.x = attn_pack<kType>(acc[x][0] * inv, acc[x][1] * inv);
        v.y = attn_pack<kType>(acc[x][2] * inv, acc[x][3] * inv);
        *reinterpret_cast<uint2*>(dst + d) = v;
      }
    }
    if (lane == 0 && P.lse != nullptr)
      P.lse[(static_cast<int64_t>(b) * P.Hq + h) * P.n + i] = wsum > 0.f ? mx + logf(wsum) : attn_neg_inf();
  }
}

// ---------------------------------------------------------------------------------------------
// Host side
struct AttnDevice {
  int sms, major;
};

// SM count and compute capability, queried once per device (a captured call makes no runtime API call).
AttnDevice attn_device(const at::Tensor& t) {
#ifdef TURBOSPEC_EMULATE
  (void)t;
  return {attn_emu_sms, 8};
#else
  constexpr int kMaxDevices = 64;
  static std::atomic<int> sms_cache[kMaxDevices], major_cache[kMaxDevices];
  const int dev = t.get_device();
  if (dev >= 0 && dev < kMaxDevices && sms_cache[dev].load() > 0)
    return {sms_cache[dev].load(), major_cache[dev].load()};
  int sms = 0, major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  if (dev >= 0 && dev < kMaxDevices) {
    major_cache[dev].store(major);
    sms_cache[dev].store(sms);
  }
  return {sms, major};
#endif
}

bool attn_aligned(const at::Tensor& t, int64_t elems) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int64_t i = 0; i + 1 < t.dim(); ++i)
    if (t.stride(i) % elems != 0) return false;
  return true;
}

template <int kType, int DP>
void attn_launch_dp(const AttnParams& P, dim3 grid, int merge_blocks) {
  void (*kernel)(const AttnParams) = tree_attention_kernel<kType, DP>;
  TS_LAUNCH(kernel, grid, dim3(kAttnThreads), P);
  if (P.splits > 1) {
    void (*merge)(const AttnParams) = tree_attention_merge_kernel<kType>;
    TS_LAUNCH(merge, dim3(static_cast<unsigned>(merge_blocks)), dim3(kAttnThreads), P);
  }
}

template <int kType>
void attn_launch(const AttnParams& P, dim3 grid, int merge_blocks) {
  if (P.D <= 32) attn_launch_dp<kType, 32>(P, grid, merge_blocks);
  else if (P.D <= 64) attn_launch_dp<kType, 64>(P, grid, merge_blocks);
  else if (P.D <= 128) attn_launch_dp<kType, 128>(P, grid, merge_blocks);
  else attn_launch_dp<kType, 256>(P, grid, merge_blocks);
}

void tree_attention_cuda(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& cache_len_in, const at::Tensor& tree_mask_in, double scale,
                         bool include_prefix, const at::Tensor& out, const std::optional<at::Tensor>& lse,
                         int64_t window, double softcap, bool bf16_products) {
  const AttnDims d = check_tree_attention_args(q_in, k_cache, v_cache, cache_len_in, tree_mask_in, scale, out, lse,
                                               TS_KERNEL_DEVICE);
  TORCH_CHECK(!bf16_products, "tree_attention: bf16_products=True runs on CPU only (the int8-activation mode); "
              "the CUDA kernel computes in float32");
  TORCH_CHECK(window >= 0, "tree_attention: window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(softcap >= 0, "tree_attention: softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK(d.D % 8 == 0, "tree_attention: the CUDA kernel needs a head dim D that is a multiple of 8 "
              "(128-bit loads), got D = ", d.D);
  if (d.B == 0) return;
  TS_DEVICE_GUARD(q_in);
  const AttnDevice dev = attn_device(q_in);
  const bool half = q_in.scalar_type() != c10::kFloat;
  TORCH_CHECK(!half || dev.major >= 8, "tree_attention: ", dtype_name(q_in.scalar_type()),
              " on CUDA needs compute capability >= 8.0 (tensor-core mma.m16n8k16), got ", dev.major,
              ".x; use float32");
  const int64_t epc = half ? 8 : 4;
  // q is read in 32-bit (16-bit types) or 128-bit (float32) words: realign an odd view (a copy).
  const at::Tensor q = attn_aligned(q_in, epc) ? q_in : at::empty(q_in.sizes(), q_in.options()).copy_(q_in);
  const at::Tensor cache_len = cache_len_in.contiguous();
  const at::Tensor tree_mask = tree_mask_in.contiguous();

  AttnParams P{};
  P.q = q.data_ptr();
  P.qs0 = q.stride(0);
  P.qs1 = q.stride(1);
  P.qs2 = q.stride(2);
  P.k = k_cache.data_ptr();
  P.v = v_cache.data_ptr();
  P.ks0 = k_cache.stride(0);
  P.ks1 = k_cache.stride(1);
  P.ks2 = k_cache.stride(2);
  P.vs0 = v_cache.stride(0);
  P.vs1 = v_cache.stride(1);
  P.vs2 = v_cache.stride(2);
  P.vec_kv = attn_aligned(k_cache, epc) && attn_aligned(v_cache, epc);
  P.cache_len = cache_len.data_ptr<int64_t>();
  P.mask = tree_mask.data_ptr<int64_t>();
  P.out = out.data_ptr();
  P.lse = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  P.B = static_cast<int>(d.B);
  P.n = static_cast<int>(d.n);
  P.Hq = static_cast<int>(d.Hq);
  P.Hkv = static_cast<int>(d.Hkv);
  P.G = P.Hq / P.Hkv;
  P.D = static_cast<int>(d.D);
  P.R = P.n * P.G;
  P.row_groups = (P.R + kAttnRowsPerBlock - 1) / kAttnRowsPerBlock;
  P.S = d.S;
  P.scale_log2 = static_cast<float>(scale) * kAttnLog2e;
  P.include_prefix = include_prefix;
  P.window = window;
  P.softcap_log2 = static_cast<float>(softcap) * kAttnLog2e;

  // Splits: about two blocks per SM over all units, no chunk shorter than min_chunk keys (twice a
  // row group's rows, so that a chunk's partial results stay smaller than its K/V), at most what
  // the longest possible key range (S, or n without the prefix) needs, at most kAttnMaxSplits.
  const int64_t units = static_cast<int64_t>(P.B) * P.Hkv * P.row_groups;
  const int group_rows = std::min(P.R, kAttnRowsPerBlock);
  P.min_chunk = std::max(64, (2 * group_rows + kAttnChunkAlign - 1) / kAttnChunkAlign * kAttnChunkAlign);
  const int64_t max_keys = include_prefix ? d.S : d.n;
  int64_t splits = (2 * static_cast<int64_t>(dev.sms) + units - 1) / units;
  splits = std::min<int64_t>({splits, (max_keys + P.min_chunk - 1) / P.min_chunk, kAttnMaxSplits});
  splits = std::max<int64_t>(splits, 1);
#ifdef TURBOSPEC_EMULATE
  if (attn_emu_splits > 0) splits = attn_emu_splits;
  if (attn_emu_min_chunk > 0) P.min_chunk = attn_emu_min_chunk;
#endif
  P.splits = static_cast<int>(splits);
  at::Tensor workspace;
  if (P.splits > 1) {
    const int64_t rows = static_cast<int64_t>(P.B) * P.n * P.Hq;
    workspace = at::empty({P.splits * rows * (P.D + 1)}, q.options().dtype(at::kFloat));
    P.part_o = workspace.data_ptr<float>();
    P.part_lse = P.part_o + P.splits * rows * P.D;
  }
  const dim3 grid(static_cast<unsigned>(units), static_cast<unsigned>(P.splits));
  const int64_t out_rows = static_cast<int64_t>(P.B) * P.n * P.Hq;
  const int merge_blocks = static_cast<int>(std::min<int64_t>((out_rows + kAttnWarps - 1) / kAttnWarps, 16 * dev.sms));
  switch (q.scalar_type()) {
    case c10::kFloat: attn_launch<kF32>(P, grid, merge_blocks); break;
    case c10::kBFloat16: attn_launch<kBF16>(P, grid, merge_blocks); break;
    default: attn_launch<kF16>(P, grid, merge_blocks); break;
  }
}

}  // namespace
}  // namespace gpu
}  // namespace turbospec

#ifndef TURBOSPEC_EMULATE
TORCH_LIBRARY_IMPL(turbospec, CUDA, m) { m.impl("tree_attention", &turbospec::gpu::tree_attention_cuda); }
#endif

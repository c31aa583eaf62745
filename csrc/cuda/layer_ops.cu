// The fused decoder-layer ops on CUDA: add_rms_norm, silu_mul, rope_cache (specs: reference.add_rms_norm,
// reference.silu_mul, reference.rope_cache; CPU twins: csrc/cpu/layer_ops.cpp).
//
// Why: a SmolLM2-135M decode step ran 979 kernels (H100, graphs off, bench/profile_step.py), ~33 per
// layer, most of them 1.5-2.5 µs elementwise kernels of the composite RMS norm, RoPE, SiLU and the
// K/V index copies; in a CUDA graph they still cost their launch latency and a full pass each.
// These three ops do the same arithmetic with torch's roundings (float32 math, each stored value
// rounded to the dtype; multiplies and adds are written as __fmul_rn / __fadd_rn so that nvcc
// does not contract them into an FMA that torch does not do), one kernel each:
// - add_rms_norm: one warp per row up to 1024 values, else one block per row (the row in registers
//   up to 8 values per thread); the residual add and the norm (the sum of squares in a fixed lane /
//   tree order, so a row's result never depends on the other rows or the row count);
// - silu_mul: elementwise over [rows, I];
// - rope_cache: one thread per (b, j, head, d) of qkv: q heads rotated into q_out, k heads rotated
//   and v heads copied into the caches at slot cache_len[b] + j (read on the device: graph-safe).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "../checks.h"
#include "common.cuh"
#include "launch.cuh"

namespace turbospec {
namespace gpu {
namespace {

constexpr int kElemThreads = 256;

#ifdef TURBOSPEC_EMULATE
inline bool norm_emu_loop = false;  // test hook (tests/ops/cuda_emu): long rows always by the loop kernel
#endif

struct NormParams {
  const void* x;
  const void* delta;  // nullptr: no residual add
  const void* weight;
  void* out;
  void* sum;  // x + delta (when delta)
  int64_t rows, K;
  float eps;
  int type;
};

// One row held in registers: this thread's values first + i * stride (i < kItems, in order).
// Every load (x, delta, weight) is issued before the first store: a store to `sum` might alias x
// for all the compiler knows, so a loop that loads, adds and stores value by value waits for each
// load in turn. `reduce` sums the row's squares over the threads that share it.
template <int kItems, typename Reduce>
__device__ __forceinline__ void norm_row(const NormParams& p, int64_t base, int64_t first, int64_t stride,
                                         Reduce reduce) {
  float v[kItems], d[kItems], w[kItems];
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int64_t k = first + i * stride;
    v[i] = d[i] = w[i] = 0.f;
    if (k < p.K) {
      v[i] = load_float(p.x, base + k, p.type);
      if (p.delta != nullptr) d[i] = load_float(p.delta, base + k, p.type);
      w[i] = load_float(p.weight, k, p.type);
    }
  }
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int64_t k = first + i * stride;
    if (k < p.K) {
      if (p.delta != nullptr) {
        v[i] = round_to(add_rn(v[i], d[i]), p.type);
        store_float(p.sum, base + k, p.type, v[i]);
      }
      ss = add_rn(ss, mul_rn(v[i], v[i]));
    }
  }
  ss = reduce(ss);
  const float inv = 1.f / sqrtf(add_rn(ss / static_cast<float>(p.K), p.eps));
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int64_t k = first + i * stride;
    if (k < p.K) store_float(p.out, base + k, p.type, mul_rn(w[i], round_to(mul_rn(v[i], inv), p.type)));
  }
}

// Longer rows: one block per row; thread t takes the values t, t + blockDim.x, ..., in registers up
// to kBlockRowItems values per thread.
constexpr int kBlockRowItems = 8;

__global__ void __launch_bounds__(1024) add_rms_norm_block_kernel(const NormParams p) {
  __shared__ float scratch[kMaxWarps];
  norm_row<kBlockRowItems>(p, static_cast<int64_t>(blockIdx.x) * p.K, threadIdx.x, blockDim.x,
                           [&](float ss) { return block_reduce(ss, Sum(), scratch); });
}

// Rows of more than kBlockRowItems values per thread: the same order and arithmetic in a loop.
__global__ void __launch_bounds__(1024) add_rms_norm_kernel(const NormParams p) {
  __shared__ float scratch[kMaxWarps];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * p.K;
  float ss = 0.f;
  for (int64_t k = threadIdx.x; k < p.K; k += blockDim.x) {
    float s = load_float(p.x, base + k, p.type);
    if (p.delta != nullptr) {
      s = round_to(add_rn(s, load_float(p.delta, base + k, p.type)), p.type);
      store_float(p.sum, base + k, p.type, s);
    }
    ss = add_rn(ss, mul_rn(s, s));
  }
  ss = block_reduce(ss, Sum(), scratch);
  const float inv = 1.f / sqrtf(add_rn(ss / static_cast<float>(p.K), p.eps));
  const void* src = p.delta != nullptr ? p.sum : p.x;  // this thread wrote the sums it reads back
  for (int64_t k = threadIdx.x; k < p.K; k += blockDim.x) {
    const float h = round_to(mul_rn(load_float(src, base + k, p.type), inv), p.type);
    store_float(p.out, base + k, p.type, mul_rn(load_float(p.weight, k, p.type), h));
  }
}

// Rows of K <= kWarpRowMax * 32 (SmolLM2's 576, Qwen2.5-0.5B's 896): one warp per row, the row in
// registers, a shuffle reduction and no block barrier. The loop kernel above took 4.9 µs per
// 576-wide row on the H100 (bench/RESULTS.md, GPU run 2026-11-26), mostly its two barriers.
constexpr int kWarpRowMax = 32;
constexpr int kWarpRowThreads = 128;

__global__ void __launch_bounds__(kWarpRowThreads) add_rms_norm_warp_kernel(const NormParams p) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  if (row >= p.rows) return;  // the whole warp: row is the same for its 32 lanes
  norm_row<kWarpRowMax>(p, row * p.K, lane, kWarpSize, [](float ss) { return warp_sum(ss); });
}

struct SiluParams {
  const void* gate_up;
  void* out;
  int64_t rows, I;
  int type;
};

__global__ void __launch_bounds__(kElemThreads) silu_mul_kernel(const SiluParams p) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= p.rows * p.I) return;
  const int64_t r = t / p.I, i = t % p.I;
  const float g = load_float(p.gate_up, r * 2 * p.I + i, p.type);
  const float u = load_float(p.gate_up, r * 2 * p.I + p.I + i, p.type);
  const float silu = round_to(g / add_rn(1.f, expf(-g)), p.type);
  store_float(p.out, t, p.type, mul_rn(silu, u));
}

struct RopeParams {
  const void* qkv;
  const void* cos;
  const void* sin;
  const int64_t* cache_len;
  void* q;
  void* k;
  void* v;
  int64_t B, n, H, Hkv, S, D;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;  // cache strides (elements)
  int type;
};

__global__ void __launch_bounds__(kElemThreads) rope_cache_kernel(const RopeParams p) {
  const int64_t heads = p.H + 2 * p.Hkv;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= p.B * p.n * heads * p.D) return;
  const int64_t e = t % p.D, h = (t / p.D) % heads, bj = t / (p.D * heads);
  const int64_t b = bj / p.n, j = bj % p.n;
  const float x = load_float(p.qkv, t, p.type);
  if (h >= p.H + p.Hkv) {  // a v head: copied
    const int64_t len = p.cache_len[b], slot = len + j;
    if (len < 0 || slot >= p.S) return;
    store_float(p.v, b * p.vs0 + (h - p.H - p.Hkv) * p.vs1 + slot * p.vs2 + e, p.type, x);
    return;
  }
  const int64_t half = p.D / 2, partner = e < half ? e + half : e - half;
  const float xr = load_float(p.qkv, t - e + partner, p.type);
  const float c = load_float(p.cos, bj * p.D + e, p.type), s = load_float(p.sin, bj * p.D + e, p.type);
  const float r = add_rn(round_to(mul_rn(x, c), p.type), round_to(mul_rn(xr, s), p.type));
  if (h < p.H) {
    store_float(p.q, (bj * p.H + h) * p.D + e, p.type, r);
    return;
  }
  const int64_t len = p.cache_len[b], slot = len + j;
  if (len < 0 || slot >= p.S) return;
  store_float(p.k, b * p.ks0 + (h - p.H) * p.ks1 + slot * p.ks2 + e, p.type, r);
}

int float_type_of(const at::Tensor& t) {
  return t.scalar_type() == c10::kFloat ? kF32 : t.scalar_type() == c10::kHalf ? kF16 : kBF16;
}

unsigned blocks_for(int64_t total) {
  return static_cast<unsigned>(std::max<int64_t>(1, (total + kElemThreads - 1) / kElemThreads));
}

void add_rms_norm_cuda(const at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& weight,
                       double eps, const at::Tensor& out, const std::optional<at::Tensor>& sum_out) {
  const RowDims d = check_add_rms_norm_args(x, delta, weight, eps, out, sum_out, TS_KERNEL_DEVICE);
  if (d.rows == 0) return;
  TORCH_CHECK(d.rows <= 2147483647LL, "add_rms_norm: at most 2^31 - 1 rows on CUDA, got ", d.rows);
  TS_DEVICE_GUARD(x);
  NormParams p{};
  p.x = x.data_ptr();
  p.delta = delta ? delta->data_ptr() : nullptr;
  p.weight = weight.data_ptr();
  p.out = out.data_ptr();
  p.sum = sum_out ? sum_out->data_ptr() : nullptr;
  p.rows = d.rows;
  p.K = d.K;
  p.eps = static_cast<float>(eps);
  p.type = float_type_of(x);
  if (d.K <= kWarpRowMax * kWarpSize) {
    constexpr int64_t rows_per_block = kWarpRowThreads / kWarpSize;
    TS_LAUNCH(add_rms_norm_warp_kernel, dim3(static_cast<unsigned>((d.rows + rows_per_block - 1) / rows_per_block)),
              dim3(kWarpRowThreads), p);
    return;
  }
  // Longer rows: one block per row, a thread per 4-8 values (a row of 576-8192 values: 128-1024 threads).
  int threads = static_cast<int>(std::min<int64_t>(1024, std::max<int64_t>(64, (d.K / 4 + 31) / 32 * 32)));
  bool in_registers = true;
#ifdef TURBOSPEC_EMULATE
  if (::emu::block_threads_override > 0) threads = ::emu::block_threads_override;
  in_registers = !norm_emu_loop;
#endif
  if (in_registers && d.K <= static_cast<int64_t>(threads) * kBlockRowItems) {
    TS_LAUNCH(add_rms_norm_block_kernel, dim3(static_cast<unsigned>(d.rows)), dim3(threads), p);
  } else {
    TS_LAUNCH(add_rms_norm_kernel, dim3(static_cast<unsigned>(d.rows)), dim3(threads), p);
  }
}

void silu_mul_cuda(const at::Tensor& gate_up, const at::Tensor& out) {
  const RowDims d = check_silu_mul_args(gate_up, out, TS_KERNEL_DEVICE);
  if (d.rows == 0) return;
  TS_DEVICE_GUARD(gate_up);
  const SiluParams p{gate_up.data_ptr(), out.data_ptr(), d.rows, d.K, float_type_of(gate_up)};
  TS_LAUNCH(silu_mul_kernel, dim3(blocks_for(d.rows * d.K)), dim3(kElemThreads), p);
}

void rope_cache_cuda(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin_signed,
                     const at::Tensor& cache_len, int64_t num_heads, const at::Tensor& q_out, const at::Tensor& k_cache,
                     const at::Tensor& v_cache) {
  const RopeDims d = check_rope_cache_args(qkv, cos, sin_signed, cache_len, num_heads, q_out, k_cache, v_cache,
                                           TS_KERNEL_DEVICE);
  const int64_t total = d.B * d.n * (d.H + 2 * d.Hkv) * d.D;
  if (total == 0) return;
  TS_DEVICE_GUARD(qkv);
  RopeParams p{};
  p.qkv = qkv.data_ptr();
  p.cos = cos.data_ptr();
  p.sin = sin_signed.data_ptr();
  p.cache_len = cache_len.data_ptr<int64_t>();
  p.q = q_out.data_ptr();
  p.k = k_cache.data_ptr();
  p.v = v_cache.data_ptr();
  p.B = d.B;
  p.n = d.n;
  p.H = d.H;
  p.Hkv = d.Hkv;
  p.S = d.S;
  p.D = d.D;
  p.ks0 = k_cache.stride(0);
  p.ks1 = k_cache.stride(1);
  p.ks2 = k_cache.stride(2);
  p.vs0 = v_cache.stride(0);
  p.vs1 = v_cache.stride(1);
  p.vs2 = v_cache.stride(2);
  p.type = float_type_of(qkv);
  TS_LAUNCH(rope_cache_kernel, dim3(blocks_for(total)), dim3(kElemThreads), p);
}

}  // namespace
}  // namespace gpu
}  // namespace turbospec

#ifndef TURBOSPEC_EMULATE
TORCH_LIBRARY_IMPL(turbospec, CUDA, m) {
  m.impl("add_rms_norm", &turbospec::gpu::add_rms_norm_cuda);
  m.impl("silu_mul", &turbospec::gpu::silu_mul_cuda);
  m.impl("rope_cache", &turbospec::gpu::rope_cache_cuda);
}
#endif

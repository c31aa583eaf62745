// Device helpers shared by turbospec's CUDA kernels: dtype-erased loads, deterministic warp/block
// reductions and scans, and order-preserving float keys for radix selection.
//
// Every block-wide helper must be called by all threads of the block (blockDim.x a multiple of 32,
// at most 1024) with block-uniform control flow; results are identical in every thread and do not
// depend on timing (fixed reduction trees, no floating-point atomics).
//
// The kernels only use the CUDA features below, so that tests/ops/cuda_emu can also run them on the CPU
// (TURBOSPEC_EMULATE: one fiber per CUDA thread) to check their logic without a GPU.
#pragma once

#include <cstdint>

#ifndef TURBOSPEC_EMULATE
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif

namespace turbospec {
namespace gpu {

constexpr int kWarpSize = 32;
constexpr int kMaxWarps = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// Element types of the float tensors the kernels read, passed at run time (one kernel, no
// per-dtype instantiation: the switch is block-uniform and costs nothing next to the memory).
enum FloatType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

__device__ __forceinline__ float half_bits_to_float(uint16_t bits) {
#ifdef TURBOSPEC_EMULATE
  return emu::half_bits_to_float(bits);
#else
  return __half2float(__ushort_as_half(bits));
#endif
}

__device__ __forceinline__ float load_float(const void* base, int64_t i, int type) {
  if (type == kF32) return static_cast<const float*>(base)[i];
  const uint16_t bits = static_cast<const uint16_t*>(base)[i];
  return type == kBF16 ? __uint_as_float(static_cast<uint32_t>(bits) << 16) : half_bits_to_float(bits);
}

// float -> the 16 bits of a bfloat16 / float16, rounded to nearest even (as torch rounds).
__device__ __forceinline__ uint16_t float_to_16bits(float f, int type) {
  if (type == kBF16) {
    const uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN stays NaN
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
#ifdef TURBOSPEC_EMULATE
  return c10::Half(f).x;
#else
  return __half_as_ushort(__float2half_rn(f));
#endif
}

// f rounded to the float type `type` (the value a store then a load gives).
__device__ __forceinline__ float round_to(float f, int type) {
  if (type == kF32) return f;
  const uint16_t bits = float_to_16bits(f, type);
  return type == kBF16 ? __uint_as_float(static_cast<uint32_t>(bits) << 16) : half_bits_to_float(bits);
}

__device__ __forceinline__ void store_float(void* base, int64_t i, int type, float f) {
  if (type == kF32) {
    static_cast<float*>(base)[i] = f;
  } else {
    static_cast<uint16_t*>(base)[i] = float_to_16bits(f, type);
  }
}

// One rounding per operation, as torch's elementwise kernels do: never contracted into an FMA.
#ifdef TURBOSPEC_EMULATE
inline float mul_rn(float a, float b) { return a * b; }
inline float add_rn(float a, float b) { return a + b; }
#else
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
#endif

// Float -> uint32 key with the same order (for non-NaN values; -0 sorts just below +0).
__device__ __forceinline__ uint32_t ordered_key(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_to_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// ---------------------------------------------------------------------------------------------
// Reductions
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) v += __shfl_xor_sync(kFullMask, v, off);
  return v;
}

struct Sum {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct Max {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a > b ? a : b; }
};
struct Min {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a < b ? a : b; }
};
struct Or {
  __device__ __forceinline__ int operator()(int a, int b) const { return a | b; }
};

template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) v = op(v, __shfl_xor_sync(kFullMask, v, off));
  return v;
}

// Block-wide reduction; `scratch` is __shared__ [kMaxWarps]. Every thread combines the per-warp
// results in the same order, so all threads return the same value.
template <typename T, typename Op>
__device__ T block_reduce(T v, Op op, T* scratch) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  v = warp_reduce(v, op);
  __syncthreads();  // scratch may still be read by the previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T r = scratch[0];
  for (int w = 1; w < num_warps; ++w) r = op(r, scratch[w]);
  return r;
}

// (value, index) with the larger value, the smaller index on ties: the first maximal index.
struct ArgMax {
  float value;
  int64_t index;
};

__device__ __forceinline__ ArgMax argmax_op(ArgMax a, ArgMax b) {
  return (a.value > b.value || (a.value == b.value && a.index < b.index)) ? a : b;
}

__device__ __forceinline__ ArgMax block_argmax(ArgMax v, ArgMax* scratch) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off >>= 1) {
    ArgMax o;
    o.value = __shfl_xor_sync(kFullMask, v.value, off);
    o.index = __shfl_xor_sync(kFullMask, v.index, off);
    v = argmax_op(v, o);
  }
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  ArgMax r = scratch[0];
  for (int w = 1; w < num_warps; ++w) r = argmax_op(r, scratch[w]);
  return r;
}

// 16-bin histograms held in registers by every thread, summed over the block into `total`
// (__shared__ [16]); `scratch` is __shared__ [kMaxWarps * 16].
template <typename T>
__device__ void block_sum_bins(T (&bins)[16], T* scratch, T* total) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
#pragma unroll
  for (int j = 0; j < 16; ++j) bins[j] = warp_sum(bins[j]);
  __syncthreads();
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < 16; ++j) scratch[warp * 16 + j] = bins[j];
  }
  __syncthreads();
  if (threadIdx.x < 16) {
    T s = scratch[threadIdx.x];
    for (int w = 1; w < num_warps; ++w) s += scratch[w * 16 + threadIdx.x];
    total[threadIdx.x] = s;
  }
  __syncthreads();
}

// Exclusive prefix sum over the block in thread order; `scratch` is __shared__ [kMaxWarps].
// *block_total receives the sum of all values.
template <typename T>
__device__ T block_exclusive_scan(T v, T* scratch, T* block_total) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  T inclusive = v;
#pragma unroll
  for (int off = 1; off < kWarpSize; off <<= 1) {
    const T o = __shfl_up_sync(kFullMask, inclusive, off);
    if (lane >= off) inclusive += o;
  }
  __syncthreads();
  if (lane == kWarpSize - 1) scratch[warp] = inclusive;
  __syncthreads();
  T exclusive = __shfl_up_sync(kFullMask, inclusive, 1);
  if (lane == 0) exclusive = 0;
  T offset = 0, total = 0;
  for (int w = 0; w < num_warps; ++w) {
    if (w < warp) offset += scratch[w];
    total += scratch[w];
  }
  *block_total = total;
  return offset + exclusive;
}

}  // namespace gpu
}  // namespace turbospec

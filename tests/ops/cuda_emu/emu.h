// A tiny CUDA emulator for checking the logic of csrc/cuda/*.cu on a machine without a GPU.
//
// Each CUDA thread of a block is a std::thread; __syncthreads is a std::barrier over the block and
// a warp shuffle is an exchange through a per-warp slot array between two per-warp barriers, so a
// shuffle or a sync reached by only part of a warp or block deadlocks here instead of silently
// working. __shared__ variables become function statics, shared by the threads of the block that
// runs; blocks run one after another. Only the features turbospec's kernels use are provided.
// It proves nothing about performance, occupancy or the memory model of a real GPU.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};

namespace emu {

inline int block_threads_override = 0;  // block size for the row kernels (0: the real choice)

struct alignas(16) Slot {
  unsigned char bytes[16];
};

struct BlockState {
  std::unique_ptr<std::barrier<>> block;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<Slot> slots;
  std::atomic<int> vote{0};
};

inline BlockState* g_state = nullptr;
inline dim3 g_block_dim, g_grid_dim;
inline thread_local dim3 t_thread, t_block;

inline float half_bits_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

inline void syncthreads() { g_state->block->arrive_and_wait(); }

inline int syncthreads_or(int pred) {
  if (pred) g_state->vote.store(1);
  syncthreads();
  const int r = g_state->vote.load();
  syncthreads();
  if (t_thread.x == 0) g_state->vote.store(0);
  syncthreads();
  return r;
}

// All 32 lanes exchange `v`; lane l receives the value of lane src(l) (its own if out of range).
template <typename T, typename Src>
T exchange(T v, Src src) {
  static_assert(sizeof(T) <= sizeof(Slot));
  const unsigned lane = t_thread.x % 32, warp = t_thread.x / 32;
  std::memcpy(g_state->slots[t_thread.x].bytes, &v, sizeof(T));
  g_state->warps[warp]->arrive_and_wait();
  const int s = src(static_cast<int>(lane));
  T r = v;
  if (s >= 0 && s < 32) std::memcpy(&r, g_state->slots[warp * 32 + s].bytes, sizeof(T));
  g_state->warps[warp]->arrive_and_wait();
  return r;
}

template <typename Kernel, typename... Args>
void launch(Kernel kernel, dim3 grid, dim3 block, const Args&... args) {
  const unsigned n = block.x;
  if (n == 0 || n % 32 != 0 || block.y != 1 || block.z != 1) throw std::runtime_error("emu: block must be 32k x 1 x 1");
  g_block_dim = block;
  g_grid_dim = grid;
  for (unsigned by = 0; by < grid.y; ++by) {
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      BlockState st;
      st.block = std::make_unique<std::barrier<>>(n);
      for (unsigned w = 0; w < n / 32; ++w) st.warps.push_back(std::make_unique<std::barrier<>>(32));
      st.slots.resize(n);
      g_state = &st;
      std::vector<std::thread> threads;
      threads.reserve(n);
      for (unsigned t = 0; t < n; ++t) {
        threads.emplace_back([&, t] {
          t_thread = dim3(t);
          t_block = dim3(bx, by);
          kernel(args...);
          // An exited thread no longer holds back the barriers of the others.
          st.warps[t / 32]->arrive_and_drop();
          st.block->arrive_and_drop();
        });
      }
      for (auto& th : threads) th.join();
      g_state = nullptr;
    }
  }
}

}  // namespace emu

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define threadIdx (::emu::t_thread)
#define blockIdx (::emu::t_block)
#define blockDim (::emu::g_block_dim)
#define gridDim (::emu::g_grid_dim)

inline void __syncthreads() { emu::syncthreads(); }
// A barrier over the calling thread's warp (all 32 lanes must reach it).
inline void __syncwarp(unsigned = 0xffffffffu) { emu::g_state->warps[emu::t_thread.x / 32]->arrive_and_wait(); }
inline int __syncthreads_or(int pred) { return emu::syncthreads_or(pred); }
template <typename T>
T __shfl_xor_sync(unsigned, T v, int mask) {
  return emu::exchange(v, [mask](int lane) { return lane ^ mask; });
}
template <typename T>
T __shfl_up_sync(unsigned, T v, unsigned delta) {
  return emu::exchange(v, [delta](int lane) { return lane - static_cast<int>(delta); });
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
using std::isnan;

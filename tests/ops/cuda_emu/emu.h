// A tiny CUDA emulator for checking the logic of csrc/cuda/*.cu on a machine without a GPU.
//
// Each CUDA thread of a block is a fiber (ucontext) on the launching OS thread, run in turn by a
// scheduler until it reaches a barrier or returns: __syncthreads is a barrier over the block and a
// warp shuffle an exchange through a per-warp slot array between two per-warp barriers, so a shuffle
// or a sync reached by only part of a warp or block can never complete. When no fiber can move on,
// the launch stops with "emu: deadlock" (the process aborts: a test fails instead of hanging).
// __shared__ variables become function statics, shared by the threads of the block that runs; blocks
// run one after another. Only the features turbospec's kernels use are provided. It proves nothing
// about performance, occupancy or the memory model of a real GPU. (Fibers, not OS threads: a barrier
// is a few context switches in user space, where 32-96 OS threads per block on a 2-core machine made
// the emulated tests a quarter of the suite's time.)
#pragma once

#include <c10/util/Half.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
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

// A barrier over `expected` fibers; an exited fiber drops out of it (arrive_and_drop).
struct Barrier {
  int expected = 0, arrived = 0;
  uint64_t generation = 0;
};

struct Fiber {
  ucontext_t ctx;
  bool done = false;
};

struct BlockState {
  Barrier block;
  std::vector<Barrier> warps;
  std::vector<Slot> slots;
  int vote = 0;
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  unsigned current = 0;
  uint64_t progress = 0;  // barriers completed and fibers finished: what the deadlock check watches
};

inline BlockState* g_state = nullptr;
inline dim3 g_block_dim, g_grid_dim;
inline dim3 t_thread, t_block;  // the running fiber's (set by the scheduler at each switch)

inline float half_bits_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

inline void yield() { swapcontext(&g_state->fibers[g_state->current].ctx, &g_state->scheduler); }

inline void release(Barrier& b) {
  b.arrived = 0;
  ++b.generation;
  ++g_state->progress;
}

inline void arrive_and_wait(Barrier& b) {
  const uint64_t gen = b.generation;
  if (++b.arrived == b.expected) {
    release(b);
    return;
  }
  while (b.generation == gen) yield();
}

inline void arrive_and_drop(Barrier& b) {
  --b.expected;
  if (b.arrived > 0 && b.arrived == b.expected) release(b);
}

inline void syncthreads() { arrive_and_wait(g_state->block); }

inline int syncthreads_or(int pred) {
  if (pred) g_state->vote = 1;
  syncthreads();
  const int r = g_state->vote;
  syncthreads();
  if (t_thread.x == 0) g_state->vote = 0;
  syncthreads();
  return r;
}

// All 32 lanes exchange `v`; lane l receives the value of lane src(l) (its own if out of range).
template <typename T, typename Src>
T exchange(T v, Src src) {
  static_assert(sizeof(T) <= sizeof(Slot));
  const unsigned lane = t_thread.x % 32, warp = t_thread.x / 32;
  std::memcpy(g_state->slots[t_thread.x].bytes, &v, sizeof(T));
  arrive_and_wait(g_state->warps[warp]);
  const int s = src(static_cast<int>(lane));
  T r = v;
  if (s >= 0 && s < 32) std::memcpy(&r, g_state->slots[warp * 32 + s].bytes, sizeof(T));
  arrive_and_wait(g_state->warps[warp]);
  return r;
}

// Fiber stacks (1 MiB each, a guard page below), allocated once per block size and reused.
constexpr size_t kStackSize = 1 << 20, kStackGuard = 4096;

// Fiber t's usable stack: above its guard page.
inline char* fiber_stack(unsigned t) {
  static std::vector<char*> stacks;
  while (stacks.size() <= t) {
    void* m = mmap(nullptr, kStackSize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) throw std::runtime_error("emu: cannot map a fiber stack");
    mprotect(m, kStackGuard, PROT_NONE);
    stacks.push_back(static_cast<char*>(m));
  }
  return stacks[t] + kStackGuard;
}

inline std::function<void()>* g_body = nullptr;  // the kernel call of the block that runs

inline void fiber_main() {
  (*g_body)();
  // An exited thread no longer holds back the barriers of the others.
  BlockState& st = *g_state;
  arrive_and_drop(st.warps[t_thread.x / 32]);
  arrive_and_drop(st.block);
  st.fibers[st.current].done = true;
  ++st.progress;
  // returning switches to uc_link: the scheduler
}

template <typename Kernel, typename... Args>
void launch(Kernel kernel, dim3 grid, dim3 block, const Args&... args) {
  const unsigned n = block.x;
  if (n == 0 || n % 32 != 0 || block.y != 1 || block.z != 1) throw std::runtime_error("emu: block must be 32k x 1 x 1");
  g_block_dim = block;
  g_grid_dim = grid;
  std::function<void()> body = [&] { kernel(args...); };
  for (unsigned by = 0; by < grid.y; ++by) {
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      BlockState st;
      st.block.expected = static_cast<int>(n);
      st.warps.resize(n / 32);
      for (Barrier& w : st.warps) w.expected = 32;
      st.slots.resize(n);
      st.fibers.resize(n);
      g_state = &st;
      g_body = &body;
      t_block = dim3(bx, by);
      for (unsigned t = 0; t < n; ++t) {
        Fiber& f = st.fibers[t];
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = fiber_stack(t);
        f.ctx.uc_stack.ss_size = kStackSize - kStackGuard;
        f.ctx.uc_link = &st.scheduler;
        makecontext(&f.ctx, fiber_main, 0);
      }
      // Round robin until every fiber has returned; a whole round in which nothing completed while
      // fibers remain is a deadlock.
      unsigned left = n;
      while (left > 0) {
        const uint64_t before = st.progress;
        for (unsigned t = 0; t < n; ++t) {
          if (st.fibers[t].done) continue;
          st.current = t;
          t_thread = dim3(t);
          swapcontext(&st.scheduler, &st.fibers[t].ctx);
          if (st.fibers[t].done) --left;
        }
        if (left > 0 && st.progress == before) {
          std::fprintf(stderr, "emu: deadlock: %u of %u threads of block (%u, %u) wait at a barrier that cannot complete\n",
                       left, n, bx, by);
          std::abort();
        }
      }
      g_state = nullptr;
      g_body = nullptr;
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
inline void __syncwarp(unsigned = 0xffffffffu) { emu::arrive_and_wait(emu::g_state->warps[emu::t_thread.x / 32]); }
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

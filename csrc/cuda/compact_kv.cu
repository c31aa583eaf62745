// compact_kv, CUDA: move the KV entries of accepted tree nodes to contiguous positions, in place,
// for every layer in one launch (spec: reference.compact_kv; CPU twin: csrc/cpu/compact_kv.cpp).
//
// Variant: the cache base pointers travel by value in the kernel's parameter block (up to
// kMaxLayersPerLaunch tensors, e.g. 64 layers x K and V; more are split into further launches), so
// there is no pointer array to copy to the device. blockIdx.y is the tensor, and each thread owns
// one vector word (16, 8, 4, 2 or 1 bytes, the widest the layout allows) of one (row, head)
// position and moves it for every j of the accepted path. Sources and destinations overlap, so a
// thread reads the words of up to kChunk path steps into registers before writing them; that
// equals the reference's sequential order because an accepted path increases with
// accept_index[j] >= j (no destination is a later source). A path that does not increase is
// moved one step at a time, exactly as the reference does. Rows with accept_len < 0 or with an
// index outside the cache are left untouched (no host sync, no out-of-bounds access).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>

#include "../checks.h"
#include "common.cuh"
#include "launch.cuh"

namespace turbospec {
namespace gpu {
namespace {

constexpr int kMaxLayersPerLaunch = 128;
constexpr int kChunk = 8;
constexpr int kCompactThreads = 256;

struct CompactParams {
  char* caches[kMaxLayersPerLaunch];
  const int64_t* prefix_len;    // [B]
  const int64_t* accept_index;  // [B, N]
  const int64_t* accept_len;    // [B]
  int64_t B, H, S, N;
  int64_t stride_b, stride_h, stride_s;  // bytes
  int64_t words;                         // words per (row, head, position)
};

template <typename Word>
__global__ void __launch_bounds__(kCompactThreads) compact_kv_kernel(const CompactParams p) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= p.B * p.H * p.words) return;
  const int64_t w = t % p.words, h = (t / p.words) % p.H, b = t / (p.words * p.H);
  const int64_t a = p.accept_len[b], base = p.prefix_len[b];
  if (a < 0 || a >= p.N || base < 0 || base + a >= p.S) return;
  const int64_t* path = p.accept_index + b * p.N;
  bool increasing = true;
  int64_t first_moved = a + 1;
  for (int64_t j = 0; j <= a; ++j) {
    const int64_t src = path[j];
    if (src < 0 || base + src >= p.S) return;
    increasing = increasing && src >= j && (j == 0 || src > path[j - 1]);
    if (src != j && first_moved > a) first_moved = j;
  }
  char* row = p.caches[blockIdx.y] + b * p.stride_b + h * p.stride_h + w * static_cast<int64_t>(sizeof(Word));
  auto at = [&](int64_t pos) { return reinterpret_cast<Word*>(row + (base + pos) * p.stride_s); };
  if (increasing) {
    for (int64_t j0 = first_moved; j0 <= a; j0 += kChunk) {
      Word v[kChunk];
#pragma unroll
      for (int k = 0; k < kChunk; ++k)
        if (j0 + k <= a) v[k] = *at(path[j0 + k]);
#pragma unroll
      for (int k = 0; k < kChunk; ++k)
        if (j0 + k <= a) *at(j0 + k) = v[k];
    }
  } else {
    for (int64_t j = first_moved; j <= a; ++j)
      if (path[j] != j) *at(j) = *at(path[j]);
  }
}

template <typename Word>
void launch_compact(CompactParams& p, int num_layers) {
  const int64_t total = p.B * p.H * p.words;
  const dim3 grid(static_cast<unsigned>((total + kCompactThreads - 1) / kCompactThreads),
                  static_cast<unsigned>(num_layers));
  TS_LAUNCH(compact_kv_kernel<Word>, grid, dim3(kCompactThreads), p);
}

void compact_kv_cuda(at::TensorList caches, const at::Tensor& prefix_len_in, const at::Tensor& accept_index_in,
                     const at::Tensor& accept_len_in) {
  const CacheDims d = check_compact_kv_args(caches, prefix_len_in, accept_index_in, accept_len_in, TS_KERNEL_DEVICE);
  if (d.L == 0 || d.B == 0 || d.H == 0 || d.D == 0 || d.N == 0) return;
  TS_DEVICE_GUARD(accept_len_in);
  const at::Tensor prefix_len = prefix_len_in.contiguous();
  const at::Tensor accept_index = accept_index_in.contiguous();
  const at::Tensor accept_len = accept_len_in.contiguous();
  const int64_t elsize = caches[0].element_size();
  // One launch moves tensors that share strides; the word is the widest that every address allows.
  for (int64_t first = 0; first < d.L;) {
    const at::Tensor& c0 = caches[first];
    int64_t last = first + 1;
    while (last < d.L && last - first < kMaxLayersPerLaunch && caches[last].strides() == c0.strides()) ++last;
    CompactParams p{};
    p.prefix_len = prefix_len.data_ptr<int64_t>();
    p.accept_index = accept_index.data_ptr<int64_t>();
    p.accept_len = accept_len.data_ptr<int64_t>();
    p.B = d.B;
    p.H = d.H;
    p.S = d.S;
    p.N = d.N;
    p.stride_b = c0.stride(0) * elsize;
    p.stride_h = c0.stride(1) * elsize;
    p.stride_s = c0.stride(2) * elsize;
    int64_t align = d.D * elsize | p.stride_b | p.stride_h | p.stride_s;
    for (int64_t l = first; l < last; ++l) {
      p.caches[l - first] = static_cast<char*>(caches[l].data_ptr());
      align |= static_cast<int64_t>(reinterpret_cast<uintptr_t>(p.caches[l - first]));
    }
    const int64_t word = (align & 15) == 0 ? 16 : (align & 7) == 0 ? 8 : (align & 3) == 0 ? 4 : (align & 1) == 0 ? 2 : 1;
    p.words = d.D * elsize / word;
    const int n = static_cast<int>(last - first);
    switch (word) {
      case 16: launch_compact<uint4>(p, n); break;
      case 8: launch_compact<uint2>(p, n); break;
      case 4: launch_compact<uint32_t>(p, n); break;
      case 2: launch_compact<uint16_t>(p, n); break;
      default: launch_compact<uint8_t>(p, n); break;
    }
    first = last;
  }
}

}  // namespace
}  // namespace gpu
}  // namespace turbospec

#ifndef TURBOSPEC_EMULATE
TORCH_LIBRARY_IMPL(turbospec, CUDA, m) { m.impl("compact_kv", &turbospec::gpu::compact_kv_cuda); }
#endif

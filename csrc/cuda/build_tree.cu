// build_tree, CUDA: tree attention metadata from parent indices
// (spec: reference.build_tree; CPU twin: csrc/cpu/build_tree.cpp).
//
// Variant: one block of 64 threads per batch row (N <= 64), thread i owns node i. The row's
// parents are staged in shared memory and validated with one __syncthreads_or; thread i then
// walks from node i up to the root (at most 63 steps), which gives its ancestor bitmask, depth and
// root-to-node path without any further synchronisation; the bool mask is written by the whole
// block in row-major order (coalesced). A row with an invalid parent is not walked: it is marked
// with depth -1, an empty mask and no paths (no host sync, no out-of-bounds read).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "../checks.h"
#include "common.cuh"
#include "launch.cuh"

namespace turbospec {
namespace gpu {
namespace {

__global__ void __launch_bounds__(kMaxTreeNodes) build_tree_kernel(const int64_t* __restrict__ parents,
                                                                   bool* __restrict__ tree_mask,
                                                                   int64_t* __restrict__ tree_mask_packed,
                                                                   int64_t* __restrict__ depth,
                                                                   int64_t* __restrict__ retrieve_index, int N) {
  __shared__ int64_t par[kMaxTreeNodes];
  __shared__ uint64_t ancestors[kMaxTreeNodes];
  const int i = threadIdx.x;
  const int64_t b = blockIdx.x;
  if (i < N) par[i] = parents[b * N + i];
  __syncthreads();
  const bool bad = i < N && (i == 0 ? par[0] != -1 : (par[i] < 0 || par[i] >= i));
  const bool row_bad = __syncthreads_or(bad);
  if (i < N) {
    uint64_t bits = 0;
    int64_t d = -1;
    int64_t* path = retrieve_index + (b * N + i) * N;
    if (!row_bad) {
      d = 0;
      for (int j = i; j != 0; j = static_cast<int>(par[j])) ++d;
      for (int j = i;; j = static_cast<int>(par[j])) {  // the ancestor at depth k is path[k]
        bits |= uint64_t{1} << j;
        path[d - __popcll(bits) + 1] = j;
        if (j == 0) break;
      }
    }
    for (int64_t k = d + 1; k < N; ++k) path[k] = -1;
    ancestors[i] = bits;
    tree_mask_packed[b * N + i] = static_cast<int64_t>(bits);  // bit 63 is the sign bit
    depth[b * N + i] = d;
  }
  __syncthreads();
  bool* mask = tree_mask + b * N * N;
  for (int e = i; e < N * N; e += blockDim.x) mask[e] = (ancestors[e / N] >> (e % N)) & 1;
}

void build_tree_cuda(const at::Tensor& parents_in, const at::Tensor& tree_mask, const at::Tensor& tree_mask_packed,
                     const at::Tensor& depth, const at::Tensor& retrieve_index) {
  const TreeDims d = check_build_tree_args(parents_in, tree_mask, tree_mask_packed, depth, retrieve_index,
                                           TS_KERNEL_DEVICE);
  if (d.B == 0) return;
  TS_DEVICE_GUARD(parents_in);
  const at::Tensor parents = parents_in.contiguous();
  TS_LAUNCH(build_tree_kernel, dim3(static_cast<unsigned>(d.B)), dim3(kMaxTreeNodes), parents.data_ptr<int64_t>(),
            tree_mask.data_ptr<bool>(), tree_mask_packed.data_ptr<int64_t>(), depth.data_ptr<int64_t>(),
            retrieve_index.data_ptr<int64_t>(), static_cast<int>(d.N));
}

}  // namespace
}  // namespace gpu
}  // namespace turbospec

#ifndef TURBOSPEC_EMULATE
TORCH_LIBRARY_IMPL(turbospec, CUDA, m) { m.impl("build_tree", &turbospec::gpu::build_tree_cuda); }
#endif

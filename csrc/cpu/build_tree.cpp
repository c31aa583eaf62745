// build_tree, CPU: tree attention metadata from parent indices (spec: reference.build_tree).
//
// One pass over the nodes of a row in topological order: a node's ancestor set is its parent's
// set plus itself, kept as one 64-bit word per node (N <= 64), from which the bool mask, the
// packed mask, the depth and the root-to-node paths are written. Rows run in parallel.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../checks.h"

namespace turbospec {
namespace {

void build_tree_cpu(const at::Tensor& parents_in, const at::Tensor& tree_mask, const at::Tensor& tree_mask_packed,
                    const at::Tensor& depth, const at::Tensor& retrieve_index) {
  const TreeDims d = check_build_tree_args(parents_in, tree_mask, tree_mask_packed, depth, retrieve_index,
                                           c10::DeviceType::CPU);
  const int64_t B = d.B, N = d.N;
  const at::Tensor parents = parents_in.contiguous();
  const int64_t* par = parents.data_ptr<int64_t>();
  // Validate everything before writing anything, raising on the first bad entry in row-major order.
  check_parents_host("build_tree", par, B, N);
  bool* mask = tree_mask.data_ptr<bool>();
  int64_t* packed = tree_mask_packed.data_ptr<int64_t>();
  int64_t* dep = depth.data_ptr<int64_t>();
  int64_t* ret = retrieve_index.data_ptr<int64_t>();
  at::parallel_for(0, B, 16, [&](int64_t begin, int64_t end) {
    uint64_t anc[kMaxTreeNodes];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t* pr = par + b * N;
      for (int64_t i = 0; i < N; ++i) {
        const uint64_t self = uint64_t{1} << i;
        anc[i] = i == 0 ? self : (anc[pr[i]] | self);
        dep[b * N + i] = i == 0 ? 0 : dep[b * N + pr[i]] + 1;
        packed[b * N + i] = static_cast<int64_t>(anc[i]);  // bit 63 is the sign bit
        bool* mrow = mask + (b * N + i) * N;
        for (int64_t j = 0; j < N; ++j) mrow[j] = (anc[i] >> j) & 1;
        int64_t* rrow = ret + (b * N + i) * N;
        for (int64_t j = 0; j < N; ++j) rrow[j] = -1;
        for (int64_t j = i;; j = pr[j]) {  // walk up: the ancestor at depth dep[j] is j
          rrow[dep[b * N + j]] = j;
          if (j == 0) break;
        }
      }
    }
  });
}

}  // namespace
}  // namespace turbospec

TORCH_LIBRARY_IMPL(turbospec, CPU, m) { m.impl("build_tree", &turbospec::build_tree_cpu); }

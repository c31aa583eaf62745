// turbospec's CUDA entry points (csrc/cuda/*.cu), compiled for the CPU emulator in emu.h and
// exposed as a Python module for tests/ops/test_cuda_emulated.py. The sources are included as they are;
// TURBOSPEC_EMULATE switches their launch glue (csrc/cuda/launch.cuh) to emu::launch.
#define TURBOSPEC_EMULATE 1
#include "emu.h"

#include <torch/extension.h>

#include "../../../csrc/cuda/build_tree.cu"
#include "../../../csrc/cuda/compact_kv.cu"
#include "../../../csrc/cuda/layer_ops.cu"
#include "../../../csrc/cuda/tree_attention.cu"
#include "../../../csrc/cuda/verify.cu"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_block_threads", [](int n) { emu::block_threads_override = n; },
        "Threads per block for the row kernels (0: the real choice).");
  m.def("build_tree", &turbospec::gpu::build_tree_cuda);
  m.def("verify", &turbospec::gpu::verify_cuda);
  m.def("set_verify_chunk", [](int64_t chunk) { turbospec::gpu::verify_emu_chunk = chunk; },
        "verify: -1 the real choice; 0 no chunk pass; > 0 the chunk pass with chunks of that many logits.");
  m.def("compact_kv", [](std::vector<at::Tensor> caches, const at::Tensor& prefix_len, const at::Tensor& accept_index,
                         const at::Tensor& accept_len) {
    turbospec::gpu::compact_kv_cuda(caches, prefix_len, accept_index, accept_len);
  });
  m.def("tree_attention", &turbospec::gpu::tree_attention_cuda);
  m.def("add_rms_norm", &turbospec::gpu::add_rms_norm_cuda);
  m.def("set_norm_loop", [](bool on) { turbospec::gpu::norm_emu_loop = on; },
        "add_rms_norm: long rows always by the loop kernel (the register kernel's twin).");
  m.def("silu_mul", &turbospec::gpu::silu_mul_cuda);
  m.def("rope_cache", &turbospec::gpu::rope_cache_cuda);
  m.def("set_tree_attention_splits", [](int sms, int splits, int min_chunk) {
    turbospec::gpu::attn_emu_sms = sms;
    turbospec::gpu::attn_emu_splits = splits;
    turbospec::gpu::attn_emu_min_chunk = min_chunk;
  }, "tree_attention: the SM count the split heuristic sees; forced splits and minimum chunk (0: the real choice).");
}

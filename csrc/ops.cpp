// The one place turbospec's op schemas are declared. Kernels register per device:
// csrc/cpu/*.cpp with TORCH_LIBRARY_IMPL(turbospec, CPU, m), csrc/cuda/*.cu with
// TORCH_LIBRARY_IMPL(turbospec, CUDA, m). Importing turbospec._C runs these static registrations;
// the Python wrappers (turbospec/ops.py) call torch.ops.turbospec.<op>.default.
//
// Every op writes into caller-provided buffers (the Tensor(x!) arguments) and returns nothing, and
// takes its randomness as a tensor (uniform), so a decode step built from them is CUDA-graph safe.
#include <Python.h>

#include <torch/library.h>

#include "cpu/gemv.h"

// An empty Python module: loading it is what matters (the registrations below are static).
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C",
                                   "turbospec kernels, registered as torch.ops.turbospec.*", -1, nullptr};
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY(turbospec, m) {
  // parents: int64 [B, N] (N <= 64) -> tree_mask: bool [B, N, N], tree_mask_packed: int64 [B, N],
  // depth: int64 [B, N], retrieve_index: int64 [B, N, N].
  m.def("build_tree(Tensor parents, Tensor(a!) tree_mask, Tensor(b!) tree_mask_packed, Tensor(c!) depth, "
        "Tensor(d!) retrieve_index) -> ()");
  // target_logits: float [B, N, V], parents / draft_token_ids: int64 [B, N], draft_probs: float [B, N, V]
  // or None, uniform: float32 [B, N] -> accept_len: int64 [B], accept_index / output_token_ids: int64 [B, N].
  m.def("verify(Tensor target_logits, Tensor parents, Tensor draft_token_ids, Tensor? draft_probs, "
        "Tensor uniform, float temperature, int top_k, float top_p, Tensor(a!) accept_len, "
        "Tensor(b!) accept_index, Tensor(c!) output_token_ids) -> ()");
  // caches: L tensors [B, H, S, D] (every layer's K and V), prefix_len / accept_len: int64 [B],
  // accept_index: int64 [B, N]; moves accepted entries in place.
  m.def("compact_kv(Tensor(a!)[] caches, Tensor prefix_len, Tensor accept_index, Tensor accept_len) -> ()");
  // The attention of the target's verify pass over one layer's static cache (reference.tree_attention).
  // q: [B, n, Hq, D] (n <= 64, D <= 256), k_cache / v_cache: [B, Hkv, S, D] (Hq % Hkv == 0),
  // cache_len: int64 [B] on q's device (keys [0, cache_len) are the prefix; the n new tokens' K/V sit
  // at cache_len + j), tree_mask_packed: int64 [B, n] (from build_tree) -> out: [B, n, Hq, D] (q's
  // dtype), lse: float32 [B, Hq, n] or None. include_prefix = false attends the tree keys only (to be
  // merged with a separately computed prefix part by log-sum-exp).
  m.def("tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_len, Tensor tree_mask_packed, "
        "float scale, bool include_prefix, Tensor(a!) out, Tensor(b!)? lse) -> ()");
  // The decoder-layer loop of turbospec.model.Transformer (CPU; see csrc/cpu/llama_layers.cpp).
  // x: [B, n, hidden], cos / sin_signed: [B, n, 1, D], mask: bool [B or 1, 1, n, cache_len + n] or None,
  // weights: per layer (attn_norm, qkv x2 packed, o x2, mlp_norm, gate_up x2, down x2[, qkv_bias]),
  // k_cache / v_cache: one [B, H_kv, S, D] per layer (written at [cache_len, cache_len + n)),
  // capture: layer indices whose outputs (the residual stream after that layer) are also returned
  // -> [x after the last layer [B, n, hidden], one [B, n, hidden] per capture entry].
  m.def("llama_layers(Tensor x, Tensor cos, Tensor sin_signed, Tensor? mask, Tensor[] weights, "
        "Tensor(a!)[] k_cache, Tensor(b!)[] v_cache, int cache_len, int num_heads, int num_kv_heads, "
        "float eps, float scale, bool has_bias, int[] capture) -> Tensor[]");
  // y = x @ weight^T (+ bias) for 1..64 rows of x [..., K], weight [N, K] float32/bfloat16 (CPU): a
  // reduction order that does not depend on the number of rows (see csrc/cpu/gemv.cpp).
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  // Which instruction-set path small_linear uses (tests): 0 scalar, 1 AVX2, 2 AVX-512, -1 detect.
  m.def("small_linear_isa(int isa) -> int", &turbospec::small_linear_set_isa);
}

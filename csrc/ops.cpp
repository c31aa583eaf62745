// The one place turbospec's op schemas are declared. Kernels register per device:
// csrc/cpu/*.cpp with TORCH_LIBRARY_IMPL(turbospec, CPU, m), csrc/cuda/*.cu with
// TORCH_LIBRARY_IMPL(turbospec, CUDA, m). Importing turbospec._C runs these static registrations;
// the Python wrappers (turbospec/ops/wrappers.py) call torch.ops.turbospec.<op>.default.
//
// Every op writes into caller-provided buffers (the Tensor(x!) arguments) and returns nothing, and
// takes its randomness as a tensor (uniform), so a decode step built from them is CUDA-graph safe.
#include <Python.h>

#include <torch/library.h>

#include "cpu/isa.h"

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
  // target_logits: float [B, N, V], parents / draft_token_ids: int64 [B, N] (draft id -1: a padding node,
  // after the row's real nodes), draft_probs: float [B, N, V] or None, uniform: float32 [B, N], per-row
  // temperature / top_p: float32 or float64 [B], top_k: int64 [B] (tensors: a CUDA graph replays with new
  // values) -> accept_len: int64 [B], accept_index / output_token_ids: int64 [B, N].
  // Optional logit processing (reference.verify; all None: today's behaviour), node i of a row with
  // its own path's tokens: output_counts int32 [B, V], prompt_mask bool [B, V], per-row
  // presence_penalty / frequency_penalty / repetition_penalty / min_p float32 or float64 [B],
  // logit_bias float32 [B, V], token_bitmask int32 [B, N, ceil(V / 32)] (per node; bit set = allowed).
  m.def("verify(Tensor target_logits, Tensor parents, Tensor draft_token_ids, Tensor? draft_probs, "
        "Tensor uniform, Tensor temperature, Tensor top_k, Tensor top_p, Tensor(a!) accept_len, "
        "Tensor(b!) accept_index, Tensor(c!) output_token_ids, Tensor? output_counts=None, "
        "Tensor? prompt_mask=None, Tensor? presence_penalty=None, Tensor? frequency_penalty=None, "
        "Tensor? repetition_penalty=None, Tensor? logit_bias=None, Tensor? min_p=None, "
        "Tensor? token_bitmask=None) -> ()");
  // caches: L tensors [B, H, S, D] (every layer's K and V), prefix_len / accept_len: int64 [B],
  // accept_index: int64 [B, N]; moves accepted entries in place.
  m.def("compact_kv(Tensor(a!)[] caches, Tensor prefix_len, Tensor accept_index, Tensor accept_len) -> ()");
  // The attention of the target's verify pass over one layer's static cache (reference.tree_attention).
  // q: [B, n, Hq, D] (n <= 64, D <= 256), k_cache / v_cache: [B, Hkv, S, D] (Hq % Hkv == 0),
  // cache_len: int64 [B] on q's device (keys [0, cache_len) are the prefix; the n new tokens' K/V sit
  // at cache_len + j), tree_mask_packed: int64 [B, n] (from build_tree) -> out: [B, n, Hq, D] (q's
  // dtype), lse: float32 [B, Hq, n] or None. include_prefix = false attends the tree keys only (to be
  // merged with a separately computed prefix part by log-sum-exp). window > 0: sliding-window
  // attention, each query attends only keys at positions > its own - window (a token's position:
  // cache_len + its depth in the tree; CPU only, the CUDA kernel refuses it). softcap > 0 (Gemma 2):
  // every score s = scale * q.k becomes softcap * tanh(s / softcap) before the mask and softmax (CPU only).
  // bf16_products (CPU only; bfloat16 caches, float32 or bfloat16 q): q and the probabilities P are rounded
  // to bfloat16 before their products (int8-activation mode: vdpbf16ps where the CPU has it).
  m.def("tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_len, Tensor tree_mask_packed, "
        "float scale, bool include_prefix, Tensor(a!) out, Tensor(b!)? lse, int window=0, float softcap=0.0, "
        "bool bf16_products=False) -> ()");
  // The decoder-layer loop of turbospec.model.Transformer (CPU; see csrc/cpu/llama_layers.cpp).
  // x: [B, n, hidden], cos / sin_signed: [B, n, 1, D], tree_mask_packed: int64 [B or 1, n] (bit j of
  // row i: new token i attends new token j; every token attends the whole prefix [0, cache_len)),
  // norms: per layer (attn_norm, mlp_norm); weights / formats: the weight segments of every linear
  // (as for linear), counts: per layer the number of segments of qkv, o, gate_up, down; biases: one
  // qkv bias per layer or none; k_cache / v_cache: one [B, H_kv, S, D] per layer (written at
  // [cache_len, cache_len + n)); capture: layer indices whose outputs (the residual stream after that
  // layer) are also returned -> [x after the last layer [B, n, hidden], one [B, n, hidden] per capture];
  // activations: as for linear. cache_lens: int64 [B], per-row prefix lengths (a batch of requests
  // at different positions: row b writes at [cache_lens[b], cache_lens[b] + n) and attends
  // [0, cache_lens[b])); when given, cache_len is ignored. qk_norms: empty, or per layer (q_norm,
  // k_norm) RMS-normalising q and k before the rotary embedding: each [D] (over every head: Qwen3) or
  // [H * D] and [H_kv * D] (over all of a token's q / k: OLMo 2). norm_layout: 0 pre-norm layers
  // x + attn(norm(x)), x + mlp(norm(x)), norms per layer (attn, mlp); 1 post-norm (OLMo 2)
  // x + norm(attn(x)), ..., norms (attn out, mlp out); 2 sandwich (Gemma) x + norm(attn(norm(x))), ...,
  // norms (attn in, attn out, mlp in, mlp out). windows: empty, or per layer its sliding window (0:
  // full attention; see tree_attention); cos / sin_signed may be two tables stacked [2, B, n, 1, D],
  // the second for the layers with a window (Gemma 3). activation: 0 SiLU, 1 GeLU (tanh) of the gate.
  // attn_softcap: tree_attention's softcap in every layer (Gemma 2). experts: empty, or per layer its
  // number of experts E (0: a dense MLP): an expert layer's linears in weights / counts are qkv, o,
  // the router [E, hidden], then each expert's gate_up and down (3 + 2 E instead of 4); each token's
  // MLP is the sum, in expert order, of its experts_per_token top experts (router softmax in float32,
  // renormalised over the top k when moe_norm_topk), each weighted (model.py: Transformer._moe).
  // nodes: int64 [B] or None, a ragged pass (the batched step's rows of unequal drafts): row b's new
  // tokens are its first nodes[b] (0..n), the rest padding, which may be skipped: their K/V may or may
  // not be written (at slots no real token attends), their outputs are 0. The real tokens' outputs are
  // the same bits as without (every row's arithmetic is its own).
  m.def("llama_layers(Tensor x, Tensor cos, Tensor sin_signed, Tensor tree_mask_packed, Tensor[] norms, "
        "Tensor[] weights, int[] formats, int[] counts, Tensor[] biases, Tensor(a!)[] k_cache, "
        "Tensor(b!)[] v_cache, int cache_len, int num_heads, int num_kv_heads, float eps, float scale, "
        "int[] capture, Tensor[] qk_norms, int activations=0, Tensor? cache_lens=None, int norm_layout=0, "
        "int[] windows=[], int activation=0, float attn_softcap=0.0, int[] experts=[], int experts_per_token=0, "
        "bool moe_norm_topk=False, Tensor? nodes=None) -> Tensor[]");
  // The row-wise parts of an EAGLE head's decoder layer (CPU; csrc/cpu/eagle_rows.cpp; specification:
  // heads.eagle.EagleHead._input / _output). weights / formats / counts / activations: the linears'
  // segments as for llama_layers, per linear its activations (0 exact, 8 int8). eagle_input: rows float32
  // [N, F + H] (features, next token's embedding), linears [fc, qkv], norms [input_layernorm,
  // hidden_norm] (EAGLE-3), mode 0 EAGLE-1/2 / 1 EAGLE-3 / 2 EAGLE-3 over the head's outputs (no fc)
  // -> [N, H + q + k + v]. eagle_output: rows [N, A + H] (attention output, g), linears [o, gate_up,
  // down], norm post_attention_layernorm [H] -> [N, H].
  m.def("eagle_input(Tensor rows, Tensor[] weights, int[] formats, int[] counts, int[] activations, Tensor? fc_bias, "
        "Tensor[] norms, int hidden_size, float eps, int mode) -> Tensor");
  m.def("eagle_output(Tensor rows, Tensor[] weights, int[] formats, int[] counts, int[] activations, Tensor norm, "
        "float eps) -> Tensor");
  // y [..., sum N_i] = x [..., K] @ concat_i(W_i)^T (+ bias [sum N_i]) on CPU (csrc/cpu/linear.cpp),
  // x float32 / bfloat16 / float16; weights[i]: [N_i, K] float32 / float16 / bfloat16 (formats[i] =
  // 0 / 1 / 30) or uint8 [N_i, row bytes] GGUF blocks (formats[i] = GGML type id: 2 Q4_0, 3 Q4_1,
  // 6 Q5_0, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K). One reduction order for any number of rows, thread
  // split, instruction set and weight storage (reference.linear).
  // activations=8: x quantized to int8 per 32 values, integer dot products (GGUF block weights only;
  // csrc/cpu/linear_int8.cpp, reference.linear_int8): faster, not exact; still batch-invariant.
  m.def("linear(Tensor x, Tensor[] weights, int[] formats, Tensor? bias, int activations=0) -> Tensor");
  // RMS norm of float32 / bfloat16 / float16 rows on CPU, the sum of squares in float32 in one fixed
  // order (csrc/cpu/rms_norm.cpp, reference.rms_norm): x [..., K], weight [K] of x's dtype -> out
  // [..., K] of x's dtype (contiguous; may be x).
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
  // Fused pieces of a decoder layer for the static (CUDA-graph) path: each replaces several ATen
  // kernels with one and keeps torch's roundings (specs: reference.add_rms_norm / silu_mul /
  // rope_cache). add_rms_norm: s = x + delta (rounded to x's dtype; s = x without delta) written to
  // sum_out (given iff delta is), out = weight * dtype(s * 1 / sqrt(mean(s^2) + eps)), math in float32;
  // x, delta, out, sum_out [..., K] of one float dtype, weight [K] of that dtype.
  m.def("add_rms_norm(Tensor x, Tensor? delta, Tensor weight, float eps, Tensor(a!) out, Tensor(b!)? sum_out) -> ()");
  // gate_up [..., 2I] -> out [..., I] = dtype(dtype(silu(gate)) * up), gate / up its two halves.
  m.def("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  // qkv [B, n, H + 2 Hkv, D] (q, k, v heads), cos / sin_signed [B, n, 1, D] (RopeTable rows): q_out
  // [B, n, H, D] = the rotated q heads; the rotated k heads and the v heads are written to
  // k_cache / v_cache [B, Hkv, S, D] at slot cache_len[b] + j (int64 [B]; a slot outside [0, S) is
  // not written: no host read). rotate(x)[d] = dtype(dtype(x[d] cos[d]) + dtype(x[d +- D/2] sin[d])).
  m.def("rope_cache(Tensor qkv, Tensor cos, Tensor sin_signed, Tensor cache_len, int num_heads, Tensor(a!) q_out, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache) -> ()");
  // linear with one dense weight [N, K] float32 / float16 / bfloat16 (reference.small_linear).
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  // raw: uint8 [N, row bytes] of GGUF blocks of `format` -> float32 [N, K] (reference.dequantize).
  m.def("dequantize(Tensor raw, int format, int K) -> Tensor");
  // The instruction-set path of every CPU kernel: 0 scalar, 1 AVX2, 2 AVX-512, -1 default (detected,
  // capped by $TURBOSPEC_ISA), -2 read only; capped at what the CPU has; returns the path in force
  // (csrc/cpu/isa.h).
  m.def("cpu_isa(int isa) -> int", &turbospec::set_cpu_isa);
  // The weight-stream prefetch hint of the CPU kernels: 0 T0, 1 non-temporal, -1 default, -2 read.
  m.def("cpu_prefetch(int hint) -> int", &turbospec::set_cpu_prefetch);
  // AVX-512 BF16 dot products for bfloat16 weights x bfloat16-valued inputs (csrc/cpu/isa.h): 0 off,
  // 1 on (where the CPU has them and their self-test passed), -1 default, -2 read; returns 1 when on.
  m.def("cpu_bf16_dot(int on) -> int", &turbospec::set_cpu_bf16_dot);
  // AMX int8 tiles for the int8-activation linears over interleaved blocks (csrc/cpu/isa.h): 0 off,
  // 1 on (where the CPU and OS have them and their self-test passed), -1 default, -2 read.
  m.def("cpu_amx(int on) -> int", &turbospec::set_cpu_amx);
}

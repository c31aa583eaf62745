// linear (csrc/cpu/linear.cpp): y = x @ W^T (+ b) on CPU for weights kept in their storage format
// (float32 / float16 / bfloat16, or a GGUF block quantization), one fixed reduction order for every
// row count, thread split and instruction set. Used by llama_layers; exposed as turbospec::linear,
// turbospec::small_linear and turbospec::dequantize.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace turbospec {

// Weight formats, numbered as GGML's types (the numbers a GGUF file stores).
enum WeightFormat : int64_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8,
  kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kBF16 = 30,
  // turbospec's own: Q4_0 / Q4_1 / Q5_0 / Q8_0 blocks with each row's fp16 scales grouped
  // (gguf_blocks.h, reference.group_blocks); the same values, the kernels' fast layout on AVX-512
  kQ4_0G = 1002, kQ4_1G = 1003, kQ5_0G = 1006, kQ8_0G = 1008,
  // turbospec's own: Q4_0 / Q4_1 / Q5_0 / Q8_0 blocks of 16 rows interleaved (gguf_blocks.h,
  // reference.interleave_blocks), read with int8 activations only (linear_int8.cpp)
  kQ4_0X = 2002, kQ4_1X = 2003, kQ5_0X = 2006, kQ8_0X = 2008, kQ4_KX = 2012,
};

// y [..., sum N_i] = x [..., K] @ concat_i(W_i)^T (+ bias [sum N_i]); W_i is [N_i, K] float32 /
// float16 / bfloat16 (format = its dtype's) or uint8 [N_i, row_bytes(format, K)] GGUF blocks.
// activations: 0 (x as given, exact) or 8 (int8 activations for GGUF block weights: linear_int8.cpp;
// a call with any dense weight keeps exact activations).
at::Tensor linear(const at::Tensor& x, at::TensorList weights, at::IntArrayRef formats,
                  const std::optional<at::Tensor>& bias, int64_t activations = 0);
// linear on raw float32 rows: x [R, K] -> y [R, N] (N = sum N_i; bias float32 [N] or null), no
// tensors allocated (the C++ layer loop's linears). Same results as linear for float32 x.
void linear_f32(const float* x, int64_t R, int64_t K, at::TensorList weights, at::IntArrayRef formats,
                const float* bias, float* y, int64_t activations);
void linear_int8_f32(const float* x, int64_t R, int64_t K, at::TensorList weights, at::IntArrayRef formats,
                     const float* bias, float* y);
// linear with int8 activations, block formats only (csrc/cpu/linear_int8.cpp; reference.linear_int8).
at::Tensor linear_int8(const at::Tensor& x, at::TensorList weights, at::IntArrayRef formats,
                       const std::optional<at::Tensor>& bias);
bool int8_format(int64_t format);  // whether linear_int8 takes this format
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
// float32 [N, K] from uint8 [N, row_bytes] (exactly GGUF's dequantization).
at::Tensor dequantize(const at::Tensor& raw, int64_t format, int64_t K);
int64_t format_row_bytes(int64_t format, int64_t K);  // bytes of one row of K weights
int64_t dense_format(const at::Tensor& weight);        // the format of a dense weight tensor (-1: none)

}  // namespace turbospec

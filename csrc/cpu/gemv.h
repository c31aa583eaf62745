// small_linear (csrc/cpu/gemv.cpp): y = x @ W^T (+ b) for 1..64 rows of x with a fixed,
// row-count-independent reduction order. Used by llama_layers and exposed as turbospec::small_linear.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace turbospec {

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
// Whether small_linear takes this x / weight (dense fp32/bf16 CPU weight, 1..64 rows).
bool small_linear_supports(const at::Tensor& x, const at::Tensor& weight);
// Force an instruction-set path (0 scalar, 1 AVX2, 2 AVX-512; capped at what the CPU has; -1 =
// detect). Returns the path in force. For tests: all paths give the same bits.
int64_t small_linear_set_isa(int64_t isa);

}  // namespace turbospec

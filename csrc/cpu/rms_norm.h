// rms_norm (csrc/cpu/rms_norm.cpp): y = weight * (x * (1 / sqrt(mean(x^2) + eps))) per row of K
// values, mean(x^2) summed in float32 in one fixed order (reference.rms_norm) on every instruction set.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace turbospec {

// R rows: x [R, K] (row stride ldx) -> y [R, K] (row stride ldy); y may be x.
void rms_norm_rows(const float* x, int64_t ldx, const float* weight, int64_t R, int64_t K, float eps, float* y,
                   int64_t ldy);
// A 16-bit model's rows: x holds values of the weight's dtype T (as float32), y gets
// T(weight * T(x * inv)) as float32 (exactly representable in T).
void rms_norm_rows(const float* x, int64_t ldx, const c10::BFloat16* weight, int64_t R, int64_t K, float eps,
                   float* y, int64_t ldy);
void rms_norm_rows(const float* x, int64_t ldx, const c10::Half* weight, int64_t R, int64_t K, float eps, float* y,
                   int64_t ldy);
// The norm of x [..., K] (float32 / bfloat16 / float16, weight of x's dtype) as a float32 tensor
// holding values of x's dtype.
at::Tensor rms_norm_float(const at::Tensor& x, const at::Tensor& weight, double eps);

}  // namespace turbospec

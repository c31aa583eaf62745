// rms_norm (csrc/cpu/rms_norm.cpp): y = weight * (x * (1 / sqrt(mean(x^2) + eps))) per row of K
// float32 values, mean(x^2) summed in one fixed order (reference.rms_norm) on every instruction set.
#pragma once

#include <cstdint>

namespace turbospec {

// R rows: x [R, K] (row stride ldx) -> y [R, K] (row stride ldy); y may be x.
void rms_norm_rows(const float* x, int64_t ldx, const float* weight, int64_t R, int64_t K, float eps, float* y,
                   int64_t ldy);

}  // namespace turbospec

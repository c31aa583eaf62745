// tree_attention's CPU kernel (csrc/cpu/tree_attention.cpp), callable from other CPU kernels.
// ``nodes`` (int64 [B] or nullptr, the C++ layer loop's ragged passes): batch row b's new tokens are
// its first nodes[b]; the rest are padding: their rows are not computed (out keeps what it held) and
// no row attends their keys (its mask must not name them). The real rows' results are the same bits.
// ``kv_flushed`` (bf16_products only): every cache value below 2^-50 in magnitude is +0 already (the
// caller's writer flushed it: bf16_flush_rows), so the reads skip that flush; the same bits.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace turbospec {

// bf16_products read a cache value below 2^-50 in magnitude as +0: 77 is the biased float32 (and
// bfloat16) exponent of 2^-50. The C++ layer loop's cache writer flushes with it too (kv_flushed).
constexpr uint32_t kBf16MinExp = 77;

void tree_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& cache_len, const at::Tensor& tree_mask_packed, double scale,
                        bool include_prefix, const at::Tensor& out, const std::optional<at::Tensor>& lse,
                        int64_t window = 0, double softcap = 0.0, bool bf16_products = false,
                        const int64_t* nodes = nullptr, bool kv_flushed = false);

}  // namespace turbospec

// compact_kv, CPU: move the KV entries of accepted tree nodes to contiguous positions, in place
// (spec: reference.compact_kv).
//
// Every (layer, row) pair is independent and runs in parallel; inside one, j runs in increasing
// order exactly as in the reference, so overlapping source and destination positions behave the
// same. All indices are validated before anything is moved.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "../checks.h"

namespace turbospec {
namespace {

void compact_kv_cpu(at::TensorList caches, const at::Tensor& prefix_len_in, const at::Tensor& accept_index_in,
                    const at::Tensor& accept_len_in) {
  const CacheDims d = check_compact_kv_args(caches, prefix_len_in, accept_index_in, accept_len_in,
                                            c10::DeviceType::CPU);
  if (d.L == 0 || d.B == 0) return;
  const at::Tensor prefix_len = prefix_len_in.contiguous();
  const at::Tensor accept_index = accept_index_in.contiguous();
  const at::Tensor accept_len = accept_len_in.contiguous();
  const int64_t* base = prefix_len.data_ptr<int64_t>();
  const int64_t* idx = accept_index.data_ptr<int64_t>();
  const int64_t* alen = accept_len.data_ptr<int64_t>();
  for (int64_t b = 0; b < d.B; ++b) {
    const int64_t a = alen[b];
    if (a < 0) continue;  // invalid row (non-finite logits): left untouched
    TORCH_CHECK(a < d.N, "compact_kv: accept_len[", b, "] = ", a, " must be < N = ", d.N,
                " (accept_index has N entries per row)");
    TORCH_CHECK(base[b] >= 0, "compact_kv: prefix_len[", b, "] = ", base[b], " must be >= 0");
    for (int64_t j = 0; j <= a; ++j) {
      const int64_t src = idx[b * d.N + j];
      TORCH_CHECK(src >= 0 && base[b] + src < d.S && base[b] + j < d.S, "compact_kv: accept_index[", b, ", ", j,
                  "] = ", src, " with prefix_len[", b, "] = ", base[b], " addresses a position outside the cache: "
                  "positions prefix_len + accept_index and prefix_len + j must be in [0, S = ", d.S, ")");
    }
  }
  const int64_t elsize = caches[0].element_size();
  const int64_t row_bytes = d.D * elsize;
  at::parallel_for(0, d.L * d.B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t lb = begin; lb < end; ++lb) {
      const int64_t l = lb / d.B, b = lb % d.B;
      const int64_t a = alen[b];
      if (a < 0) continue;
      const at::Tensor& c = caches[l];
      char* row = static_cast<char*>(c.data_ptr()) + b * c.stride(0) * elsize;
      const int64_t sh = c.stride(1) * elsize, ss = c.stride(2) * elsize;
      for (int64_t j = 0; j <= a; ++j) {
        const int64_t src = idx[b * d.N + j];
        if (src == j) continue;
        for (int64_t h = 0; h < d.H; ++h)
          std::memmove(row + h * sh + (base[b] + j) * ss, row + h * sh + (base[b] + src) * ss, row_bytes);
      }
    }
  });
}

}  // namespace
}  // namespace turbospec

TORCH_LIBRARY_IMPL(turbospec, CPU, m) { m.impl("compact_kv", &turbospec::compact_kv_cpu); }

// See isa.h.
#include "isa.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

namespace turbospec {

Isa detect_isa() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return Isa::kAvx512;
  if (avx2) return Isa::kAvx2;
#endif
  return Isa::kScalar;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

namespace {

Isa default_isa() {
  const Isa best = detect_isa();
  const char* env = std::getenv("TURBOSPEC_ISA");
  if (env == nullptr || *env == '\0') return best;
  Isa want;
  if (std::strcmp(env, "scalar") == 0) want = Isa::kScalar;
  else if (std::strcmp(env, "avx2") == 0) want = Isa::kAvx2;
  else if (std::strcmp(env, "avx512") == 0) want = Isa::kAvx512;
  else TORCH_CHECK(false, "TURBOSPEC_ISA must be one of scalar, avx2, avx512 (or unset), got '", env, "'");
  return static_cast<Isa>(std::min(static_cast<int>(want), static_cast<int>(best)));
}

std::atomic<int>& setting() {
  static std::atomic<int> isa{static_cast<int>(default_isa())};
  return isa;
}

}  // namespace

Isa cpu_isa() { return static_cast<Isa>(setting().load(std::memory_order_relaxed)); }

int64_t set_cpu_isa(int64_t isa) {
  TORCH_CHECK(isa >= -2 && isa <= 2, "cpu_isa: isa must be -2 (read), -1 (default), 0 (scalar), 1 (avx2) or ",
              "2 (avx512), got ", isa);
  if (isa == -2) return static_cast<int64_t>(cpu_isa());
  const int v = isa < 0 ? static_cast<int>(default_isa())
                        : std::min(static_cast<int>(isa), static_cast<int>(detect_isa()));
  setting().store(v);
  return v;
}

}  // namespace turbospec

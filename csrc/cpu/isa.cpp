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

std::atomic<int> g_prefetch{static_cast<int>(Prefetch::kT0)};

Prefetch default_prefetch() {
  const char* env = std::getenv("TURBOSPEC_PREFETCH");
  if (env != nullptr && *env != '\0') {
    if (std::strcmp(env, "t0") == 0) return Prefetch::kT0;
    if (std::strcmp(env, "nta") == 0) return Prefetch::kNta;
    TORCH_CHECK(false, "TURBOSPEC_PREFETCH must be t0 or nta (or unset), got '", env, "'");
  }
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (__builtin_cpu_is("amd")) return Prefetch::kNta;
#endif
  return Prefetch::kT0;
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

// The first use (every kernel reads the path at entry) also settles the prefetch hint, so that a bad
// $TURBOSPEC_PREFETCH, like a bad $TURBOSPEC_ISA, is an error raised by the first op, not a crash at load.
int initial_setting() {
  g_prefetch.store(static_cast<int>(default_prefetch()));
  return static_cast<int>(default_isa());
}

std::atomic<int>& setting() {
  static std::atomic<int> isa{initial_setting()};
  return isa;
}

}  // namespace

Isa cpu_isa() { return static_cast<Isa>(setting().load(std::memory_order_relaxed)); }

int64_t set_cpu_prefetch(int64_t hint) {
  cpu_isa();  // the default settled first
  TORCH_CHECK(hint >= -2 && hint <= 1, "cpu_prefetch: hint must be -2 (read), -1 (default), 0 (t0) or 1 (nta), got ",
              hint);
  if (hint == -2) return g_prefetch.load();
  const int v = hint < 0 ? static_cast<int>(default_prefetch()) : static_cast<int>(hint);
  g_prefetch.store(v);
  return v;
}

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

// See isa.h.
#include "isa.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <cmath>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

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
  // Non-temporal on AMD CPUs with AVX-512 (Zen 4, where it was measured faster); T0 elsewhere: on
  // a Zen 3 (AVX2 only) NTA cost exact fp32 decode ~13 % (75-78 vs 85-88 tok/s, int8 unchanged,
  // 2026-11-29), on the Intel Xeon it cost int8 decode ~10 %.
  __builtin_cpu_init();
  if (__builtin_cpu_is("amd") && __builtin_cpu_supports("avx512f")) return Prefetch::kNta;
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

namespace {

#if defined(__x86_64__) || defined(_M_X64)
float bf16_value(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// vdpbf16ps against its specification as the kernels use it: per lane, acc = fma(a[2j+1], b[2j+1], acc),
// then fma(a[2j], b[2j], acc) (products of bfloat16 are exact in float32). Inputs from a fixed
// generator, normal values of mixed signs and magnitudes (many sums round: a fused three-way sum or the
// other order differs in about one lane in ten); every lane must match bit for bit.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) bool dpbf16_self_test() {
  uint32_t s = 12345u;
  auto next = [&s]() { s = s * 1664525u + 1013904223u; return s; };
  for (int it = 0; it < 256; ++it) {
    alignas(64) float acc[16], out[16];
    alignas(64) uint16_t a[32], b[32];
    for (int j = 0; j < 16; ++j) {
      const uint32_t r = next();
      acc[j] = std::ldexp(static_cast<float>(static_cast<int32_t>(r >> 8) - (1 << 23)) / (1 << 23), static_cast<int>(r & 15) - 8);
    }
    for (int j = 0; j < 32; ++j) {
      const uint32_t ra = next(), rb = next();
      // sign, exponent 119..134 (|v| in [2^-8, 2^8)), 7 random mantissa bits
      a[j] = static_cast<uint16_t>(((ra >> 31) << 15) | ((119 + ((ra >> 7) & 15)) << 7) | (ra & 127));
      b[j] = static_cast<uint16_t>(((rb >> 31) << 15) | ((119 + ((rb >> 7) & 15)) << 7) | (rb & 127));
    }
    const __m512 r = _mm512_dpbf16_ps(_mm512_load_ps(acc), (__m512bh)_mm512_load_si512(a), (__m512bh)_mm512_load_si512(b));
    _mm512_store_ps(out, r);
    for (int j = 0; j < 16; ++j) {
      float e = std::fma(bf16_value(a[2 * j + 1]), bf16_value(b[2 * j + 1]), acc[j]);
      e = std::fma(bf16_value(a[2 * j]), bf16_value(b[2 * j]), e);
      if (std::memcmp(&e, &out[j], 4) != 0) return false;
    }
  }
  return true;
}
#endif

// A feature's environment switch: "0" turns it off, "1" or unset leaves it to the CPU; anything else
// is an error naming the variable (on every CPU, not only where the feature exists).
bool env_allows(const char* name) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return true;
  TORCH_CHECK(std::strcmp(env, "0") == 0 || std::strcmp(env, "1") == 0, name, " must be 0 or 1 (or unset), got '",
              env, "'");
  return env[0] != '0';
}

// The body of a feature's set_cpu_* op: -2 reads the setting, -1 restores the default (the CPU and
// the environment), 0 turns the feature off, 1 on where the CPU has it; returns whether it is on.
int64_t apply_switch(const char* op, int64_t on, std::atomic<int>& setting, bool (*default_on)(),
                     bool (*available)(), bool (*now)()) {
  TORCH_CHECK(on >= -2 && on <= 1, op, ": on must be -2 (read), -1 (default), 0 (off) or 1 (on), got ", on);
  if (on != -2) setting.store((on < 0 ? default_on() : (on == 1 && available())) ? 1 : 0);
  return now() ? 1 : 0;
}

bool bf16_dot_available() {
#if defined(__x86_64__) || defined(_M_X64)
  static const bool ok = [] {
    __builtin_cpu_init();
    return detect_isa() == Isa::kAvx512 && __builtin_cpu_supports("avx512bf16") && dpbf16_self_test();
  }();
  return ok;
#else
  return false;
#endif
}

bool default_bf16_dot() { return env_allows("TURBOSPEC_BF16_DOT") && bf16_dot_available(); }

std::atomic<int>& bf16_dot_setting() {
  static std::atomic<int> on{default_bf16_dot() ? 1 : 0};
  return on;
}

}  // namespace

bool bf16_dot() {
  // the setting first: it validates $TURBOSPEC_BF16_DOT on every CPU (a bad value is an error on an
  // AVX2-only machine too, not silently ignored there)
  const bool on = bf16_dot_setting().load(std::memory_order_relaxed) != 0;
  return cpu_isa() == Isa::kAvx512 && on;
}

int64_t set_cpu_bf16_dot(int64_t on) {
  return apply_switch("cpu_bf16_dot", on, bf16_dot_setting(), default_bf16_dot, bf16_dot_available, bf16_dot);
}

namespace {

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__linux__)
// The 64-byte tile configuration (palette 1): bytes per row and rows of each of the 8 tiles.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tdpbsud against its specification: C[m][n] += sum over k of (signed) A[m][k] * (unsigned)
// B[k / 4][4 n + k % 4], exact in int32, for random bytes over the whole range (the kernels' 16 x 32
// A tiles against 8 x 64 B tiles, the extremes included).
__attribute__((target("amx-tile,amx-int8"))) bool amx_self_test() {
  TileConfig cfg{};
  cfg.palette = 1;
  cfg.rows[0] = 16, cfg.colsb[0] = 32;  // A: 16 rows of 32 signed bytes
  cfg.rows[1] = 8, cfg.colsb[1] = 64;   // B: 8 rows of 16 x 4 unsigned bytes
  cfg.rows[2] = 16, cfg.colsb[2] = 64;  // C: 16 x 16 int32
  _tile_loadconfig(&cfg);
  uint32_t s = 777u;
  auto next = [&s]() { s = s * 1664525u + 1013904223u; return s >> 8; };
  bool ok = true;
  for (int it = 0; it < 8 && ok; ++it) {
    alignas(64) int8_t a[16 * 32];
    alignas(64) uint8_t b[8 * 64];
    alignas(64) int32_t c[16 * 16];
    for (int i = 0; i < 16 * 32; ++i) a[i] = static_cast<int8_t>(it == 0 ? -128 + 255 * (i & 1) : next());
    for (int i = 0; i < 8 * 64; ++i) b[i] = static_cast<uint8_t>(it == 0 ? 255 : next());
    _tile_zero(2);
    _tile_loadd(0, a, 32);
    _tile_loadd(1, b, 64);
    _tile_dpbsud(2, 0, 1);
    _tile_stored(2, c, 64);
    for (int m = 0; m < 16 && ok; ++m)
      for (int n = 0; n < 16 && ok; ++n) {
        int32_t want = 0;
        for (int k = 0; k < 32; ++k) want += static_cast<int32_t>(a[m * 32 + k]) * b[(k / 4) * 64 + 4 * n + k % 4];
        ok = want == c[m * 16 + n];
      }
  }
  _tile_release();
  return ok;
}
#endif

bool amx_available() {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__linux__)
  static const bool ok = [] {
    if (detect_isa() != Isa::kAvx512) return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1, int8 = (d >> 25) & 1;
    if (!tile || !int8) return false;
    // The kernel hands a process the tile state only when asked (Linux 5.16+): ARCH_REQ_XCOMP_PERM
    // for XFEATURE_XTILEDATA; without it the first tile instruction faults.
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
    return amx_self_test();
  }();
  return ok;
#else
  return false;
#endif
}

bool default_amx() { return env_allows("TURBOSPEC_AMX") && amx_available(); }

std::atomic<int>& amx_setting() {
  static std::atomic<int> on{default_amx() ? 1 : 0};
  return on;
}

}  // namespace

bool amx_int8() {
  const bool on = amx_setting().load(std::memory_order_relaxed) != 0;  // (validates $TURBOSPEC_AMX everywhere)
  return cpu_isa() == Isa::kAvx512 && on;
}

int64_t set_cpu_amx(int64_t on) {
  return apply_switch("cpu_amx", on, amx_setting(), default_amx, amx_available, amx_int8);
}

}  // namespace turbospec

// The CPU instruction-set path of every turbospec CPU kernel, decided once and shared.
//
// kAvx2 needs AVX2 + FMA + F16C, kAvx512 needs AVX-512 F/BW/VL/DQ on top. The path in force is the
// best the CPU has, capped by the environment variable TURBOSPEC_ISA (scalar | avx2 | avx512) at
// first use, or by turbospec::cpu_isa(n) at run time (tests force the narrow paths this way). Every
// path of every kernel gives the same bits, so the choice changes speed only.
#pragma once

#include <atomic>
#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

namespace turbospec {

enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

Isa detect_isa();  // the best path this CPU runs
Isa cpu_isa();     // the path in force
// Force a path (0 scalar, 1 AVX2, 2 AVX-512; capped at what the CPU has; -1: back to the default,
// i.e. detection capped by TURBOSPEC_ISA; -2: only read). Returns the path in force.
int64_t set_cpu_isa(int64_t isa);
const char* isa_name(Isa isa);

// AVX-512 BF16 dot products (vdpbf16ps) inside the AVX-512 path: bfloat16 weights times inputs that
// are bfloat16 values (a bfloat16 model's activations) with many rows, where the instruction's two
// products per lane are the same two fused multiply-adds in the same order as the float32 kernels
// (linear.cpp, rows_dpbf16 states when). Used only where the CPU has it, a self-test at first use
// finds the instruction computing exactly that (two roundings, the odd element first), the AVX-512
// path is in force, and neither $TURBOSPEC_BF16_DOT=0 nor set_cpu_bf16_dot(0) turned it off.
bool bf16_dot();
// 0 off, 1 on (where the CPU and the self-test allow), -1 default, -2 read; returns whether it is on.
int64_t set_cpu_bf16_dot(int64_t on);

// AMX int8 tiles (tdpbsud) inside the AVX-512 path: the int8-activation linears over interleaved
// blocks with 16 or more input rows (linear_int8.cpp, rows_x_amx) compute each block's exact integer
// sums on the tile unit, then the same float32 steps as the vector kernels: the same bits. Used
// only where the CPU has AMX-TILE and AMX-INT8, the kernel grants this process the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM), a self-test at first use finds tdpbsud computing those
// integers, the AVX-512 path is in force, and neither $TURBOSPEC_AMX=0 nor set_cpu_amx(0) turned
// it off.
bool amx_int8();
// 0 off, 1 on (where the CPU, the OS and the self-test allow), -1 default, -2 read; returns whether it is on.
int64_t set_cpu_amx(int64_t on);

// The cache hint of the kernels' weight-stream prefetches (each kernel prefetches the rows one work
// item ahead: the hardware prefetcher alone does not keep several row streams fed from DRAM).
// Measured on the two machine types of bench/RESULTS.md: on AMD EPYC (Zen 3) the non-temporal hint
// decodes SmolLM2 17 % (Q4_1), 11 % (bfloat16) and 3 % (float32) faster than T0 (2026-11-25); on an
// Intel Xeon (Cascade Lake) it is slower: int8-activation decode ~12 % and a float32 / bfloat16
// weight stream 30-50 % (2026-11-26). Default: non-temporal on AMD, T0 elsewhere; the environment
// variable TURBOSPEC_PREFETCH (t0 | nta) at first use, or set_cpu_prefetch at run time, overrides.
// A hint changes speed only, never a result.
enum class Prefetch : int { kT0 = 0, kNta = 1 };

Prefetch default_prefetch();
// 0 T0, 1 non-temporal, -1 back to the default, -2 only read; returns the hint in force.
int64_t set_cpu_prefetch(int64_t hint);
extern std::atomic<int> g_prefetch;  // the hint in force (prefetch_nta)

inline bool prefetch_nta() { return g_prefetch.load(std::memory_order_relaxed) == static_cast<int>(Prefetch::kNta); }

#if defined(__x86_64__) || defined(_M_X64)
// nta: read once per kernel call. The AVX-512 kernels take it as a template argument (the test per
// prefetch cost ~5 % of Q4_1 decode there); the AVX2 and int8 kernels test it (one instantiation each:
// a second set doubled the build time of linear.cpp).
__attribute__((always_inline)) inline void prefetch_weights(const void* p, bool nta) {
  if (nta)
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_NTA);
  else
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
}
#endif

}  // namespace turbospec

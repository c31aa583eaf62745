// The CPU instruction-set path of every turbospec CPU kernel, decided once and shared.
//
// kAvx2 needs AVX2 + FMA + F16C, kAvx512 needs AVX-512 F/BW/VL/DQ on top. The path in force is the
// best the CPU has, capped by the environment variable TURBOSPEC_ISA (scalar | avx2 | avx512) at
// first use, or by turbospec::cpu_isa(n) at run time (tests force the narrow paths this way). Every
// path of every kernel gives the same bits, so the choice changes speed only.
#pragma once

#include <cstdint>

namespace turbospec {

enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

Isa detect_isa();  // the best path this CPU runs
Isa cpu_isa();     // the path in force
// Force a path (0 scalar, 1 AVX2, 2 AVX-512; capped at what the CPU has; -1: back to the default,
// i.e. detection capped by TURBOSPEC_ISA; -2: only read). Returns the path in force.
int64_t set_cpu_isa(int64_t isa);
const char* isa_name(Isa isa);

}  // namespace turbospec

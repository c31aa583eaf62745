// Small helpers for reading GGUF blocks, shared by linear.cpp (exact) and linear_int8.cpp.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace turbospec {

// The float32 value of the IEEE half stored (little endian) at p.
inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// K-quant 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes (GGUF's get_scale_min).
inline void scale_min_k4(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

}  // namespace turbospec

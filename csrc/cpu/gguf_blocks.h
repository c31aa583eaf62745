// Small helpers for reading GGUF blocks, shared by linear.cpp (exact) and linear_int8.cpp.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace turbospec {

// Unaligned little-endian loads (GGUF is little endian, as is every CPU these kernels build for).
inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

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

// All 8 scales and 8 mins of a Q4_K / Q5_K super-block (the 12 packed bytes at s), byte j of sc / mn
// for sub-block j: the values scale_min_k4 gives, with word operations.
inline void scale_min_k4_all(const uint8_t* s, uint64_t* sc, uint64_t* mn) {
  uint64_t a;
  uint32_t b;
  std::memcpy(&a, s, 8);
  std::memcpy(&b, s + 8, 4);
  const uint32_t lo = static_cast<uint32_t>(a), hi = static_cast<uint32_t>(a >> 32);
  // sub-blocks 0..3: the low 6 bits of bytes 0..3 (scales) and 4..7 (mins); 4..7: a nibble of bytes
  // 8..11 and, as bits 4..5, the top 2 bits of bytes 0..3 (scales) and 4..7 (mins)
  const uint32_t sc_hi = (b & 0x0F0F0F0Fu) | ((lo >> 2) & 0x30303030u);
  const uint32_t mn_hi = ((b >> 4) & 0x0F0F0F0Fu) | ((hi >> 2) & 0x30303030u);
  *sc = (lo & 0x3F3F3F3Fu) | (static_cast<uint64_t>(sc_hi) << 32);
  *mn = (hi & 0x3F3F3F3Fu) | (static_cast<uint64_t>(mn_hi) << 32);
}

}  // namespace turbospec

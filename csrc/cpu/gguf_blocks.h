// Small helpers for reading GGUF blocks, shared by linear.cpp (exact) and linear_int8.cpp.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

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

// Grouped layouts (turbospec's own format ids, 1000 + the GGUF id; linear.h): the blocks of one row
// of Q4_0 / Q4_1 / Q5_0 / Q8_0 regrouped so that their fp16 header fields sit together. A row's
// blocks go in groups of kGroupBlocks (the last group may be shorter, n blocks); a group holds field
// 0 (d) of its n blocks as n halves, then (Q4_1) field 1 (m) of its n blocks, then the n blocks'
// remaining bytes, block after block. Same bytes, same row size, only their places move; the
// kernels read 16 scales with one load and one conversion instead of one per block.
constexpr int64_t kGroupBlocks = 16;
constexpr int64_t kGroupedBase = 1000;

// The GGUF format of a grouped one, or -1.
constexpr int64_t grouped_base(int64_t f) {
  return (f == kGroupedBase + 2 || f == kGroupedBase + 3 || f == kGroupedBase + 6 || f == kGroupedBase + 8)
             ? f - kGroupedBase : -1;
}

// fp16 header fields at the start of a GGUF block: Q4_1 has d and m, Q4_0 / Q5_0 / Q8_0 only d.
constexpr int header_halves(int64_t base) { return base == 3 ? 2 : 1; }

// Where block j's bytes sit in a grouped row of nb blocks of `bytes` bytes with nh header halves:
// field h at grouped_field(...) + 0..1, the rest of the block at grouped_rest(...).
inline int64_t grouped_field(int64_t j, int64_t nb, int64_t bytes, int h) {
  const int64_t g0 = j - j % kGroupBlocks, n = std::min(kGroupBlocks, nb - g0);
  return g0 * bytes + 2 * (h * n + (j - g0));
}
// ... the rest of block jj of the group of n blocks that starts at block g0
constexpr int64_t grouped_rest_in(int64_t g0, int64_t n, int64_t jj, int64_t bytes, int nh) {
  return g0 * bytes + 2 * nh * n + (bytes - 2 * nh) * jj;
}
inline int64_t grouped_rest(int64_t j, int64_t nb, int64_t bytes, int nh) {
  const int64_t g0 = j - j % kGroupBlocks;
  return grouped_rest_in(g0, std::min(kGroupBlocks, nb - g0), j - g0, bytes, nh);
}

// rows rows of nb GGUF blocks (src) <-> the grouped layout (dst); src and dst do not overlap.
inline void regroup_rows(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t nb, int64_t bytes, int nh,
                         bool to_grouped) {
  const int64_t row_bytes = nb * bytes, rest = bytes - 2 * nh;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* s = src + r * row_bytes;
    uint8_t* d = dst + r * row_bytes;
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t plain = j * bytes;
      for (int h = 0; h < nh; ++h) {
        const int64_t g = grouped_field(j, nb, bytes, h);
        std::memcpy(to_grouped ? d + g : d + plain + 2 * h, to_grouped ? s + plain + 2 * h : s + g, 2);
      }
      const int64_t g = grouped_rest(j, nb, bytes, nh);
      std::memcpy(to_grouped ? d + g : d + plain + 2 * nh, to_grouped ? s + plain + 2 * nh : s + g,
                  static_cast<size_t>(rest));
    }
  }
}

// Pointers to nw grouped rows (base format `base`, row_bytes each) put back in GGUF order in buf:
// the fallback of every kernel path without a grouped reader.
inline void ungroup_into(const uint8_t* const* wr, int64_t nw, int64_t row_bytes, int64_t base,
                         std::vector<uint8_t>& buf, const uint8_t** out) {
  const int64_t bytes = base == 2 ? 18 : base == 3 ? 20 : base == 6 ? 22 : 34;
  buf.resize(static_cast<size_t>(nw * row_bytes));
  for (int64_t i = 0; i < nw; ++i) {
    out[i] = buf.data() + i * row_bytes;
    regroup_rows(wr[i], buf.data() + i * row_bytes, 1, row_bytes / bytes, bytes, header_halves(base), false);
  }
}

// Interleaved layouts (turbospec's own format ids, 2000 + the GGUF id of Q4_0 / Q4_1 / Q5_0 / Q8_0; the
// int8-activation kernels' 16-row tiles, linear_int8.cpp): rows 16 g .. 16 g + 15 (N % 16 == 0) fill
// the same 16 * row_bytes bytes, block after block; block j of the group (16 * bytes bytes) holds
// the 16 rows' fp16 d, then (Q4_1) their fp16 m, then the values in chunks of 64 bytes, 4 per row
// (byte 4 i + e of a chunk: row i). Q4_0 / Q4_1 / Q5_0: chunk c (0..3) = GGUF's quant bytes
// 4 c .. 4 c + 3 of each row's block (low nibbles: values 4 c + e, high: 16 + 4 c + e); Q8_0: chunk c
// (0..7) = values 4 c + e + 128 as unsigned bytes. Q5_0 then: 4 x 16 bytes of fifth bits, byte i of
// part c = bits 4 c .. 4 c + 3 of row i's qh | bits 16 + 4 c .. 16 + 4 c + 3 << 4.
// (reference.interleave_blocks is the specification.)
constexpr int64_t kInterleavedBase = 2000;
constexpr int64_t kInterleaveRows = 16;

// The GGUF format of an interleaved one, or -1.
constexpr int64_t interleaved_base(int64_t f) {
  return (f == kInterleavedBase + 2 || f == kInterleavedBase + 3 || f == kInterleavedBase + 6 ||
          f == kInterleavedBase + 8 || f == kInterleavedBase + 12) ? f - kInterleavedBase : -1;
}

// Q4_KX (2012): per super-block of a group (16 x 144 bytes) the rows' fp16 d (32 bytes), fp16 dmin
// (32), their 12 packed scale bytes as three parts of 64 (part t: bytes 4 t .. 4 t + 3 of each row,
// row i at 4 i), then 32 chunks of 64 bytes (chunk 8 j + c: quant bytes 32 j + 4 c .. + 3 of each row).
inline void deinterleave_q4k(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t ns) {
  const int64_t row_bytes = ns * 144;
  for (int64_t g = 0; g < rows / kInterleaveRows; ++g)
    for (int64_t s = 0; s < ns; ++s) {
      const uint8_t* blk = src + g * kInterleaveRows * row_bytes + s * kInterleaveRows * 144;
      for (int64_t i = 0; i < kInterleaveRows; ++i) {
        uint8_t* out = dst + (g * kInterleaveRows + i) * row_bytes + s * 144;
        std::memcpy(out, blk + 2 * i, 2);
        std::memcpy(out + 2, blk + 32 + 2 * i, 2);
        for (int t = 0; t < 3; ++t) std::memcpy(out + 4 + 4 * t, blk + 64 + 64 * t + 4 * i, 4);
        for (int c = 0; c < 32; ++c) std::memcpy(out + 16 + 4 * c, blk + 256 + 64 * c + 4 * i, 4);
      }
    }
}

// rows (a multiple of 16) interleaved rows of nb blocks of base format `base` (src) -> GGUF blocks (dst).
inline void deinterleave_rows(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t nb, int64_t base) {
  if (base == 12) {
    deinterleave_q4k(src, dst, rows, nb / 8);
    return;
  }
  const int64_t bytes = base == 2 ? 18 : base == 3 ? 20 : base == 6 ? 22 : 34, row_bytes = nb * bytes;
  const int nh = header_halves(base);
  const int64_t chunks = base == 8 ? 8 : 4;
  const uint8_t flip = base == 8 ? 0x80 : 0x00;
  const int qs0 = 2 * nh + (base == 6 ? 4 : 0);  // the quant bytes' offset in a GGUF block
  for (int64_t g = 0; g < rows / kInterleaveRows; ++g) {
    const uint8_t* s = src + g * kInterleaveRows * row_bytes;
    uint8_t* d = dst + g * kInterleaveRows * row_bytes;
    for (int64_t j = 0; j < nb; ++j) {
      const uint8_t* blk = s + j * kInterleaveRows * bytes;
      for (int64_t i = 0; i < kInterleaveRows; ++i) {
        uint8_t* out = d + i * row_bytes + j * bytes;
        for (int h = 0; h < nh; ++h) std::memcpy(out + 2 * h, blk + 32 * h + 2 * i, 2);
        for (int64_t c = 0; c < chunks; ++c)
          for (int e = 0; e < 4; ++e) out[qs0 + 4 * c + e] = blk[32 * nh + 64 * c + 4 * i + e] ^ flip;
        if (base == 6) {
          uint32_t qh = 0;
          for (int c = 0; c < 4; ++c) {
            const uint32_t hb = blk[32 + 256 + 16 * c + i];
            qh |= (hb & 15u) << (4 * c) | (hb >> 4) << (16 + 4 * c);
          }
          std::memcpy(out + 2, &qh, 4);
        }
      }
    }
  }
}

}  // namespace turbospec

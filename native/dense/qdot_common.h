// Scalar helpers shared by the qdot kernel files (qdot.h): fp16 and e8m0 decoding, K-quant scale
// unpacking, block sizes.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace ftdense {

inline float fp16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    const float f = std::ldexp(static_cast<float>(man), -24);
    return sign ? -f : f;
  }
  const uint32_t bits = exp == 31 ? (sign | 0x7F800000u | (man << 13))
                                  : (sign | ((exp + 112) << 23) | (man << 13));
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float load_fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return fp16_to_f32(h);
}

// Q4_K: the 6-bit scales and mins of the 8 sub-blocks from the 12 packed bytes.
inline void q4k_scales(const uint8_t* s, int sc[8], int m[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    m[j] = s[j + 4] & 63;
  }
  for (int j = 4; j < 8; ++j) {
    sc[j] = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// MXFP4: the half scale 2^(e - 128) of an e8m0 exponent byte, exact (subnormal for e < 2).
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// e8m0_half of every byte (qdot_scalar.cpp): SIMD kernels broadcast a block's scale from here
// with a plain load.
extern const std::array<float, 256> kE8m0Half;

// MXFP4: the e2m1 codes' values doubled (integers; the half scale above undoes the doubling).
alignas(16) constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12,
                                                 0, -1, -2, -3, -4, -6, -8, -12};

constexpr int kQ80Bytes = 34;    // per 32 inputs
constexpr int kQ40Bytes = 18;    // per 32 inputs
constexpr int kQ50Bytes = 22;    // per 32 inputs
constexpr int kMxfp4Bytes = 17;  // per 32 inputs
constexpr int kQ4KBytes = 144;   // per 256 inputs
constexpr int kQ5KBytes = 176;   // per 256 inputs
constexpr int kQ6KBytes = 210;   // per 256 inputs

}  // namespace ftdense

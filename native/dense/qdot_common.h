// Scalar helpers shared by the qdot kernel files (qdot.h): fp16 decoding and Q4_K scale unpacking.
#pragma once

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

constexpr int kQ80Bytes = 34;   // per 32 inputs
constexpr int kQ4KBytes = 144;  // per 256 inputs

}  // namespace ftdense

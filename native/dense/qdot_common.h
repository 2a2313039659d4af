// Scalar helpers shared by the qdot kernel files (qdot.h): fp16 and e8m0 decoding, K-quant scale
// unpacking, block sizes.
#pragma once

#include <array>
#include <atomic>
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

// x rounded to the nearest fp16 value (ties to even), as a float; a magnitude fp16 cannot hold
// (65520 and above, which would round to infinity) comes back unchanged.
inline float round_to_fp16(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  const uint32_t sign = b & 0x80000000u, mag = b & 0x7FFFFFFFu;
  if (mag >= 0x477FF000u) return x;
  float r;
  if (mag < 0x38800000u) {  // below 2^-14: an fp16 subnormal, a multiple of 2^-24
    float a;
    std::memcpy(&a, &mag, sizeof a);
    r = std::nearbyint(a * 16777216.f) / 16777216.f;
  } else {  // 10 mantissa bits kept, half an ulp added, ties to even
    const uint32_t kept = (mag + 0x0FFFu + ((mag >> 13) & 1u)) & ~0x1FFFu;
    std::memcpy(&r, &kept, sizeof r);
  }
  uint32_t rb;
  std::memcpy(&rb, &r, sizeof rb);
  rb |= sign;
  std::memcpy(&r, &rb, sizeof r);
  return r;
}

// qdot.h's llama.cpp rounding switch (qdot_scalar.cpp): 32-input groups' scales rounded to fp16.
extern std::atomic<bool> g_fp16_act_scales;

// The scale of a 32-input activation group of largest magnitude amax.
inline float act_scale32(float amax) {
  const float d = amax / 127.f;
  return g_fp16_act_scales.load(std::memory_order_relaxed) ? round_to_fp16(d) : d;
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

// bf16 dot-product kernels: bf16 weights times activations rounded to bf16, fp32 accumulation.
//
// The AVX-512 set (kernels_bf16dot_avx512.cpp) uses vdpbf16ps (AVX512-BF16): one instruction
// multiplies 16 pairs of bf16 weights by 16 pairs of bf16 inputs and adds both products to 16
// fp32 sums. The products of two bf16 numbers are exact in fp32, so the only changes against the
// fp32-FMA kernels (kernels.h) are the rounding of the inputs to bf16 (round to nearest even, as
// torch's x.to(bfloat16)), the order of the fp32 sums and the instruction's flushing of denormal
// inputs and results to zero. The scalar set (kernels_bf16dot_scalar.cpp, isa "emubf16") computes
// the same contracts in plain C++, so the callers' layouts are tested on any CPU.
//
//   gemv  y[s * ldy + r] = sum_i W[r, i] * xs[s][i], r < rows, s < n; W bf16 rows `ldw`
//         elements apart, xs bf16 rows in natural order (W's 32-bit pairs meet x's pairs).
//   tile  inputs as a panel of nb blocks of 16 tokens whose lanes hold input PAIRS:
//         xp[((b * k2 + p) * 16 + lane) * 2 + e] = x_{16 b + lane}[2 p + e], k2 = (k + 1) / 2
//         (an odd k pads the last pair with 0), and
//         y[(b * rows + r) * 16 + lane] = sum_i W[r, i] * x_{16 b + lane}[i].
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace ftnative {

using Bf16GemvFn = void (*)(const uint16_t* w, int64_t ldw, int rows, int k,
                            const uint16_t* const* xs, int n, float* y, int ldy);
using Bf16TileFn = void (*)(const uint16_t* w, int64_t ldw, int rows, int k, const uint16_t* xp,
                            int nb, float* y);

struct Bf16DotSet {
  const char* isa;
  Bf16GemvFn gemv;
  Bf16TileFn tile;
};

// fp32 -> bf16 bits, round to nearest even; NaN -> quiet NaN (torch's rounding).
inline uint16_t to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);
  b += 0x7FFFu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

// bf16 bits -> fp32, exactly (the 16 bits above 16 zero bits).
inline float bf16_to_f32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void to_bf16(const float* x, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = to_bf16(x[i]);
}

// Element (lane, input i) of a 16-token pair panel block with k2 pairs per token.
inline int64_t pair_panel_index(int64_t i, int lane) {
  return ((i >> 1) * kTileLanes + lane) * 2 + (i & 1);
}

extern const Bf16DotSet kScalarBf16Dot;  // isa "emubf16": any CPU, for tests
#ifndef FTNATIVE_NO_X86
extern const Bf16DotSet kAvx512Bf16Dot;  // isa "avx512bf16": needs avx512_bf16
#endif

}  // namespace ftnative

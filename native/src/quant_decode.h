// Portable decode of the quantised expert formats (contract in kernels.h, bit layouts in
// daemon/experts/formats.py): lookup tables, per-group scales and single elements. The scalar
// kernels use them for everything, the SIMD kernels for scales and for the inputs past their
// last full vector step. Every value equals what formats.py's reference dequantisation gives.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels.h"

namespace ftnative {

// e2m1 codes 0..15: bit 3 sign, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
constexpr float kE2m1[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                             -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// fp8 e4m3 (bias 7, 3 mantissa bits) and e8m0 (2^(e - 127)) bytes -> fp32, exact.
struct QLuts {
  float fp8[256];
  float e8m0[256];
  QLuts() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      const float mag = e ? std::ldexp(static_cast<float>(8 + m), e - 10)
                          : std::ldexp(static_cast<float>(m), -9);
      fp8[b] = (b & 0x80) ? -mag : mag;
      e8m0[b] = std::ldexp(1.f, b - 127);
    }
  }
};
inline const QLuts kQLuts{};

// Inputs that share one scale, per format.
template <QFormat F>
constexpr int kQGroup = F == QFormat::Fp8Block ? 128 : F == QFormat::Mxfp4 ? 32 : 16;

// Scale of (task row r, input c). For Nvfp4 without the global scale: the reference multiplies
// by the block scale first and the global scale second, and so do the kernels.
template <QFormat F>
inline float q_scale(const QMat& m, int64_t r, int c) {
  const int64_t row = m.row0 + r;
  if constexpr (F == QFormat::Fp8Block)
    return static_cast<const float*>(m.s)[(row >> 7) * m.lds + (c >> 7)];
  const uint8_t b = static_cast<const uint8_t*>(m.s)[row * m.lds + c / kQGroup<F>];
  return F == QFormat::Mxfp4 ? kQLuts.e8m0[b] : kQLuts.fp8[b];
}

// Raw value (before scales) of input c of a row starting at `row`.
template <QFormat F>
inline float q_raw(const uint8_t* row, int c) {
  if constexpr (F == QFormat::Fp8Block) return kQLuts.fp8[row[c]];
  const uint8_t b = row[c >> 1];
  return kE2m1[(c & 1) ? b >> 4 : b & 15];
}

// Dequantised weight (task row r, input c).
template <QFormat F>
inline float q_elem(const QMat& m, int64_t r, int c) {
  const float v = q_raw<F>(m.w + r * m.ldw, c) * q_scale<F>(m, r, c);
  return F == QFormat::Nvfp4 ? v * m.glob : v;
}

// Dequantised inputs [c0, c1) of task row r into out[0, c1 - c0), one scale lookup per group.
template <QFormat F>
inline void q_decode_row(const QMat& m, int64_t r, int c0, int c1, float* out) {
  constexpr int G = kQGroup<F>;
  const uint8_t* row = m.w + r * m.ldw;
  for (int g = c0; g < c1;) {
    const int end = g - g % G + G < c1 ? g - g % G + G : c1;
    const float s = q_scale<F>(m, r, g);
    for (int c = g; c < end; ++c) {
      const float v = q_raw<F>(row, c) * s;
      out[c - c0] = F == QFormat::Nvfp4 ? v * m.glob : v;
    }
    g = end;
  }
}

}  // namespace ftnative

// Plain C++ qdot kernels (qdot.h): the reference every SIMD set is tested against, and the path
// for CPUs without AVX2.
#include <cmath>

#include "qdot.h"
#include "qdot_common.h"

namespace ftdense {

namespace {

void quantize(const float* x, int K, int8_t* q, float* d, int16_t* s) {
  for (int b = 0; b < K / kQActBlock; ++b) {
    const float* xb = x + b * kQActBlock;
    float amax = 0.f;
    for (int i = 0; i < kQActBlock; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int i = 0; i < kQActBlock; ++i) {
      const int v = static_cast<int>(std::nearbyint(xb[i] * inv));
      q[b * kQActBlock + i] = static_cast<int8_t>(v);
      sum += v;
    }
    d[b] = amax / 127.f;
    s[b] = static_cast<int16_t>(sum);
  }
}

void row_q8_0(const uint8_t* w, int K, const int8_t* q, const float* d, const int16_t*, int n,
              float* y, int64_t ldy) {
  const int nb = K / 32;
  for (int t = 0; t < n; ++t) {
    const int8_t* qt = q + static_cast<int64_t>(t) * K;
    const float* dt = d + static_cast<int64_t>(t) * nb;
    float acc = 0.f;
    for (int b = 0; b < nb; ++b) {
      const uint8_t* blk = w + b * kQ80Bytes;
      const int8_t* wq = reinterpret_cast<const int8_t*>(blk + 2);
      int sum = 0;
      for (int i = 0; i < 32; ++i) sum += wq[i] * qt[b * 32 + i];
      acc += load_fp16(blk) * dt[b] * static_cast<float>(sum);
    }
    y[t * ldy] = acc;
  }
}

void row_q4_k(const uint8_t* w, int K, const int8_t* q, const float* d, const int16_t* s, int n,
              float* y, int64_t ldy) {
  const int nsb = K / 256, na = K / 32;
  for (int t = 0; t < n; ++t) {
    const int8_t* qt = q + static_cast<int64_t>(t) * K;
    const float* dt = d + static_cast<int64_t>(t) * na;
    const int16_t* st = s + static_cast<int64_t>(t) * na;
    float acc = 0.f;
    for (int sb = 0; sb < nsb; ++sb) {
      const uint8_t* blk = w + sb * kQ4KBytes;
      const float dw = load_fp16(blk), dmin = load_fp16(blk + 2);
      int sc[8], m[8];
      q4k_scales(blk + 4, sc, m);
      const uint8_t* qs = blk + 16;
      for (int j = 0; j < 8; ++j) {
        const int shift = 4 * (j & 1);
        const uint8_t* qj = qs + 32 * (j / 2);
        const int8_t* xj = qt + sb * 256 + 32 * j;
        int sum = 0;
        for (int i = 0; i < 32; ++i) sum += ((qj[i] >> shift) & 0xF) * xj[i];
        const int a = sb * 8 + j;
        acc += dt[a] * (dw * static_cast<float>(sc[j] * sum) -
                        dmin * static_cast<float>(m[j] * st[a]));
      }
    }
    y[t * ldy] = acc;
  }
}

}  // namespace

const QDotSet kQDotScalar = {"scalar", quantize, {row_q8_0, row_q4_k}};

}  // namespace ftdense

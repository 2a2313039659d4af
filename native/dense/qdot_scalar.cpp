// Plain C++ qdot kernels (qdot.h): the reference every SIMD set is tested against, and the path
// for CPUs without AVX2.
#include <array>
#include <cmath>

#include <vector>

#include "qdot.h"
#include "qdot_common.h"
#include "qdot_x8_layout.h"

namespace ftdense {

std::atomic<bool> g_fp16_act_scales{false};

void set_fp16_act_scales(bool on) { g_fp16_act_scales.store(on); }

const std::array<float, 256> kE8m0Half = [] {
  std::array<float, 256> t{};
  for (int e = 0; e < 256; ++e) t[e] = e8m0_half(static_cast<uint8_t>(e));
  return t;
}();

namespace {

void quantize(const float* x, int K, int group, int8_t* q, float* d, int16_t* s) {
  for (int g = 0; g < K / group; ++g) {
    const float* xg = x + g * group;
    float amax = 0.f;
    for (int i = 0; i < group; ++i) amax = std::fmax(amax, std::fabs(xg[i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    const float scale = group == kQActBlock ? act_scale32(amax) : (amax > 0.f ? 1.f / inv : 0.f);
    for (int b = g * group / kQActBlock; b < (g + 1) * group / kQActBlock; ++b) {
      int sum = 0;
      for (int i = 0; i < kQActBlock; ++i) {
        const int v = static_cast<int>(std::nearbyint(x[b * kQActBlock + i] * inv));
        q[b * kQActBlock + i] = static_cast<int8_t>(v);
        sum += v;
      }
      d[b] = scale;
      s[b] = static_cast<int16_t>(sum);
    }
  }
}

// ---- blocks of 32 signed weights: each decoder writes the 32 integer weights, returns the scale

float decode_q8_0(const uint8_t* blk, int8_t* v) {
  std::memcpy(v, blk + 2, 32);
  return load_fp16(blk);
}

float decode_q4_0(const uint8_t* blk, int8_t* v) {
  for (int i = 0; i < 16; ++i) {
    v[i] = static_cast<int8_t>((blk[2 + i] & 0xF) - 8);
    v[i + 16] = static_cast<int8_t>((blk[2 + i] >> 4) - 8);
  }
  return load_fp16(blk);
}

float decode_q5_0(const uint8_t* blk, int8_t* v) {
  uint32_t qh;
  std::memcpy(&qh, blk + 2, sizeof qh);
  for (int i = 0; i < 16; ++i) {
    const int lo = (blk[6 + i] & 0xF) | ((qh >> i) & 1) << 4;
    const int hi = (blk[6 + i] >> 4) | ((qh >> (i + 16)) & 1) << 4;
    v[i] = static_cast<int8_t>(lo - 16);
    v[i + 16] = static_cast<int8_t>(hi - 16);
  }
  return load_fp16(blk);
}

float decode_mxfp4(const uint8_t* blk, int8_t* v) {
  for (int i = 0; i < 16; ++i) {
    v[i] = kMxfp4Values[blk[1 + i] & 0xF];
    v[i + 16] = kMxfp4Values[blk[1 + i] >> 4];
  }
  return e8m0_half(blk[0]);
}

template <int kBytes, float (*Decode)(const uint8_t*, int8_t*)>
void row_signed32(const uint8_t* w, int K, const int8_t* q, const float* d, const int16_t*,
                  int n, float* y, int64_t ldy) {
  const int nb = K / 32;
  for (int t = 0; t < n; ++t) {
    const int8_t* qt = q + static_cast<int64_t>(t) * K;
    const float* dt = d + static_cast<int64_t>(t) * nb;
    float acc = 0.f;
    for (int b = 0; b < nb; ++b) {
      int8_t v[32];
      const float dw = Decode(w + b * kBytes, v);
      int sum = 0;
      for (int i = 0; i < 32; ++i) sum += v[i] * qt[b * 32 + i];
      acc += dw * dt[b] * static_cast<float>(sum);
    }
    y[t * ldy] = acc;
  }
}

// ---- K-quants ----------------------------------------------------------------------------------

// Q4_K (kFive false) and Q5_K: unsigned 4/5-bit values with a scale and a min per 32 inputs.
template <bool kFive>
void row_scale_min(const uint8_t* w, int K, const int8_t* q, const float* d, const int16_t* s,
                   int n, float* y, int64_t ldy) {
  constexpr int kBytes = kFive ? kQ5KBytes : kQ4KBytes;
  const int nsb = K / 256, na = K / 32;
  for (int t = 0; t < n; ++t) {
    const int8_t* qt = q + static_cast<int64_t>(t) * K;
    const float* dt = d + static_cast<int64_t>(t) * na;
    const int16_t* st = s + static_cast<int64_t>(t) * na;
    float acc = 0.f;
    for (int sb = 0; sb < nsb; ++sb) {
      const uint8_t* blk = w + sb * kBytes;
      const float dw = load_fp16(blk), dmin = load_fp16(blk + 2);
      int sc[8], m[8];
      q4k_scales(blk + 4, sc, m);
      const uint8_t* qs = blk + kBytes - 128;
      for (int j = 0; j < 8; ++j) {
        const int shift = 4 * (j & 1);
        const uint8_t* qj = qs + 32 * (j / 2);
        const int8_t* xj = qt + sb * 256 + 32 * j;
        int sum = 0;
        for (int i = 0; i < 32; ++i) {
          int v = (qj[i] >> shift) & 0xF;
          if (kFive) v |= ((blk[16 + i] >> j) & 1) << 4;
          sum += v * xj[i];
        }
        const int a = sb * 8 + j;
        acc += dt[a] * (dw * static_cast<float>(sc[j] * sum) -
                        dmin * static_cast<float>(m[j] * st[a]));
      }
    }
    y[t * ldy] = acc;
  }
}

// Q6_K's 256 signed values (q - 32) of one super-block, in input order.
void q6_k_values(const uint8_t* blk, int8_t* v) {
  const uint8_t *ql = blk, *qh = blk + 128;
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 32; ++i) {
      const uint8_t l0 = ql[64 * h + i], l1 = ql[64 * h + 32 + i], top = qh[32 * h + i];
      int8_t* o = v + 128 * h + i;
      o[0] = static_cast<int8_t>(((l0 & 0xF) | (top & 3) << 4) - 32);
      o[32] = static_cast<int8_t>(((l1 & 0xF) | ((top >> 2) & 3) << 4) - 32);
      o[64] = static_cast<int8_t>(((l0 >> 4) | ((top >> 4) & 3) << 4) - 32);
      o[96] = static_cast<int8_t>(((l1 >> 4) | (top >> 6) << 4) - 32);
    }
}

void row_q6_k(const uint8_t* w, int K, const int8_t* q, const float* d, const int16_t*, int n,
              float* y, int64_t ldy) {
  const int nsb = K / 256, na = K / 32;
  int8_t v[256];
  for (int t = 0; t < n; ++t) {
    const int8_t* qt = q + static_cast<int64_t>(t) * K;
    const float* dt = d + static_cast<int64_t>(t) * na;
    float acc = 0.f;
    for (int sb = 0; sb < nsb; ++sb) {
      const uint8_t* blk = w + sb * kQ6KBytes;
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      q6_k_values(blk, v);
      const float dw = load_fp16(blk + 208);
      for (int j = 0; j < 8; ++j) {  // 32 inputs, two scales of 16
        const int8_t* xj = qt + sb * 256 + 32 * j;
        int half_sum[2] = {0, 0};
        for (int g = 0; g < 2; ++g)
          for (int i = 0; i < 16; ++i) half_sum[g] += v[32 * j + 16 * g + i] * xj[16 * g + i];
        const int sum = sc[2 * j] * half_sum[0] + sc[2 * j + 1] * half_sum[1];
        acc += dw * dt[sb * 8 + j] * static_cast<float>(sum);
      }
    }
    y[t * ldy] = acc;
  }
}

// The interleaved types (qdot.h): each of the group's 8 rows gathered back into its plain row
// (qdot_x8_layout.h), then computed as one.
template <QType kBase, QRowFn Row>
void group_x8(const uint8_t* w, int K, const int8_t* q, const float* d, const int16_t* s, int n,
              float* y, int64_t ldy) {
  const int nsb = K / x8_block_inputs(kBase), bytes = x8_block_bytes(kBase);
  thread_local std::vector<uint8_t> row;
  row.resize(static_cast<size_t>(nsb) * bytes);
  for (int r = 0; r < 8; ++r) {
    for (int sb = 0; sb < nsb; ++sb)
      x8_gather(kBase, w + sb * 8 * bytes, r, row.data() + sb * bytes);
    Row(row.data(), K, q, d, s, n, y + r, ldy);
  }
}

}  // namespace

const QDotSet kQDotScalar = {"scalar",
                             quantize,
                             {row_signed32<kQ80Bytes, decode_q8_0>, row_scale_min<false>, row_q6_k,
                              row_scale_min<true>, row_signed32<kMxfp4Bytes, decode_mxfp4>,
                              row_signed32<kQ50Bytes, decode_q5_0>,
                              row_signed32<kQ40Bytes, decode_q4_0>,
                              group_x8<QType::Q4_K, row_scale_min<false>>,
                              group_x8<QType::Q6_K, row_q6_k>,
                              group_x8<QType::MXFP4, row_signed32<kMxfp4Bytes, decode_mxfp4>>,
                              group_x8<QType::Q8_0, row_signed32<kQ80Bytes, decode_q8_0>>,
                              group_x8<QType::Q5_K, row_scale_min<true>>},
                             {}};  // no pair kernels (qdot.h)

}  // namespace ftdense

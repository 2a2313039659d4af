// The AVX-512 kernel bodies (kernels_simd.h with 16 lanes, bf16 chunks of 32, one vector per
// 16-token block) on plain 16-float arrays, compiled for the baseline ISA. Slow; it exists so
// that the AVX-512 geometry of the shared code is tested on CPUs without AVX-512 (isa "emu512").
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "quant_decode.h"

#define FT_TARGET
#define FT_INLINE inline

namespace ftnative {
namespace {

inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

struct V {
  struct T {
    float v[16];
  };
  static constexpr int kLanes = 16;
  static T zero() { return set1(0.f); }
  static T load(const float* p) {
    T t;
    std::memcpy(t.v, p, sizeof t.v);
    return t;
  }
  static void store(float* p, const T& t) { std::memcpy(p, t.v, sizeof t.v); }
  static T mul(const T& a, T b) {
    for (int i = 0; i < kLanes; ++i) b.v[i] *= a.v[i];
    return b;
  }
  static T fma(const T& a, const T& b, T c) {
    for (int i = 0; i < kLanes; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
    return c;
  }
  static T set1(float f) {
    T t;
    for (float& x : t.v) x = f;
    return t;
  }
  static float hsum(const T& t) {
    float s = 0.f;
    for (float x : t.v) s += x;
    return s;
  }
};

constexpr int kTileRows = 8;

struct WF32 {
  using E = float;
  static constexpr int kChunk = 0;
  static void load2(const float* w, V::T& a, V::T& b) {
    a = V::load(w);
    b = V::load(w + 16);
  }
  static void bcast2(const float* w, V::T& lo, V::T& hi) {
    lo = V::set1(w[0]);
    hi = V::set1(w[1]);
  }
  static float scalar(const float* w) { return *w; }
};

struct WBf16 {
  using E = uint16_t;
  static constexpr int kChunk = 32;
  // What _mm512_slli_epi32(v, 16) and _mm512_and_si512(v, 0xFFFF0000) do per 32-bit lane.
  static void split(const uint32_t* lanes, V::T& even, V::T& odd) {
    for (int l = 0; l < 16; ++l) {
      even.v[l] = from_bits(lanes[l] << 16);
      odd.v[l] = from_bits(lanes[l] & 0xFFFF0000u);
    }
  }
  static void load2(const uint16_t* w, V::T& a, V::T& b) {
    uint32_t lanes[16];
    std::memcpy(lanes, w, sizeof lanes);
    split(lanes, a, b);
  }
  static void bcast2(const uint16_t* w, V::T& lo, V::T& hi) {
    uint32_t pair, lanes[16];
    std::memcpy(&pair, w, sizeof pair);
    for (uint32_t& l : lanes) l = pair;
    split(lanes, lo, hi);
  }
  static float scalar(const uint16_t* w) { return from_bits(static_cast<uint32_t>(*w) << 16); }
};

#include "kernels_simd.h"

// What the AVX-512 decode sequences of kernels_avx512.cpp yield, lane by lane.
struct Q {
  struct Tab {
    float v[16];  // the 16 e2m1 code values times the scale
  };
  static void fp8x2(const uint8_t* p, V::T& a, V::T& b) {
    for (int l = 0; l < 16; ++l) {
      a.v[l] = kQLuts.fp8[p[l]] * 0x1p-8f;  // fp16 bit pattern of value * 2^-8, converted
      b.v[l] = kQLuts.fp8[p[16 + l]] * 0x1p-8f;
    }
  }
  static Tab table(float s) {
    Tab t;
    for (int c = 0; c < 16; ++c) t.v[c] = kE2m1[c] * s;
    return t;
  }
  static Tab tablemul(Tab t, float g) {
    for (float& x : t.v) x *= g;
    return t;
  }
  static void fp4x2(const uint8_t* p, const Tab& t0, const Tab& t1, V::T& ev, V::T& od) {
    for (int l = 0; l < 16; ++l) {
      const Tab& t = l < 8 ? t0 : t1;  // index bit 4 of vpermt2ps
      ev.v[l] = t.v[p[l] & 15];
      od.v[l] = t.v[p[l] >> 4];
    }
  }
  static void interleave(V::T ev, V::T od, V::T& lo, V::T& hi) {
    for (int j = 0; j < 8; ++j) {
      lo.v[2 * j] = ev.v[j];
      lo.v[2 * j + 1] = od.v[j];
      hi.v[2 * j] = ev.v[8 + j];
      hi.v[2 * j + 1] = od.v[8 + j];
    }
  }
};

#include "quant_simd.h"

}  // namespace

const KernelSet kEmu512F32 = {"emu512", WF32::kChunk, gemv<WF32>, tile<WF32>};
const KernelSet kEmu512Bf16 = {"emu512", WBf16::kChunk, gemv<WBf16>, tile<WBf16>};
const QKernelSet kEmu512Q[kNumQFormats] = FT_QUANT_SETS("emu512");

}  // namespace ftnative

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
  static void fp8x2(const uint8_t* p, V::T& a, V::T& b) {
    for (int l = 0; l < 16; ++l) {
      a.v[l] = kQLuts.fp8[p[l]] * 0x1p-8f;  // fp16 bit pattern of value * 2^-8, converted
      b.v[l] = kQLuts.fp8[p[16 + l]] * 0x1p-8f;
    }
  }
  static constexpr int kFp4In = 32;
  static constexpr const uint8_t* kFp4Perm = nullptr;
  static void fp4_step(const uint8_t* p, V::T* w) {
    for (int l = 0; l < 16; ++l) {
      w[0].v[l] = kE2m1[p[l] & 15];
      w[1].v[l] = kE2m1[p[l] >> 4];
    }
  }
  static constexpr int fp4_blocks() { return 2; }
  static constexpr int fp4_blk(int v, int) { return v; }
  static void fp4_scales(const float* gs, int G, V::T* sv) {
    for (int l = 0; l < 16; ++l) sv[0].v[l] = G == 32 || l < 8 ? gs[0] : gs[1];
    sv[1] = sv[0];
  }
};

#include "quant_simd.h"

}  // namespace

const KernelSet kEmu512F32 = {"emu512", WF32::kChunk, gemv<WF32>, tile<WF32>};
const KernelSet kEmu512Bf16 = {"emu512", WBf16::kChunk, gemv<WBf16>, tile<WBf16>};
const QKernelSet kEmu512Q[kNumQFormats] = FT_QUANT_SETS("emu512");

}  // namespace ftnative

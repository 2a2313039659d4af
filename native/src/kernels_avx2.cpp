// AVX2 + FMA kernels (8 fp32 lanes). bf16 weights widen to fp32 in registers: a 256-bit load of
// 16 bf16 gives the even ones by a 16-bit left shift of each 32-bit lane and the odd ones by
// masking the low half, so gemv reads its inputs de-interleaved in chunks of 16.
#include <immintrin.h>

#include <cstring>

#include "kernels.h"

#define FT_TARGET __attribute__((target("avx2,fma,f16c")))
#define FT_INLINE FT_TARGET __attribute__((always_inline)) inline

namespace ftnative {
namespace {

struct V {
  using T = __m256;
  static constexpr int kLanes = 8;
  FT_INLINE static T zero() { return _mm256_setzero_ps(); }
  FT_INLINE static T load(const float* p) { return _mm256_loadu_ps(p); }
  FT_INLINE static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  FT_INLINE static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  FT_INLINE static T set1(float f) { return _mm256_set1_ps(f); }
  FT_INLINE static float hsum(T v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};

constexpr int kTileRows = 4;  // 4 rows x 2 vectors = 8 accumulators of the 16 ymm registers

struct WF32 {
  using E = float;
  static constexpr int kChunk = 0;
  FT_INLINE static void load2(const float* w, V::T& a, V::T& b) {
    a = _mm256_loadu_ps(w);
    b = _mm256_loadu_ps(w + 8);
  }
  FT_INLINE static void bcast2(const float* w, V::T& lo, V::T& hi) {
    lo = _mm256_broadcast_ss(w);
    hi = _mm256_broadcast_ss(w + 1);
  }
  FT_INLINE static float scalar(const float* w) { return *w; }
};

struct WBf16 {
  using E = uint16_t;
  static constexpr int kChunk = 16;
  FT_INLINE static void split(__m256i v, V::T& even, V::T& odd) {
    even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  FT_INLINE static void load2(const uint16_t* w, V::T& a, V::T& b) {
    split(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), a, b);
  }
  FT_INLINE static void bcast2(const uint16_t* w, V::T& lo, V::T& hi) {
    int32_t pair;
    std::memcpy(&pair, w, sizeof pair);  // w[0] in the low half, w[1] in the high half
    split(_mm256_set1_epi32(pair), lo, hi);
  }
  FT_INLINE static float scalar(const uint16_t* w) {
    const uint32_t bits = static_cast<uint32_t>(*w) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
};

#include "kernels_simd.h"

}  // namespace

const KernelSet kAvx2F32 = {"avx2", WF32::kChunk, gemv<WF32>, tile<WF32>};
const KernelSet kAvx2Bf16 = {"avx2", WBf16::kChunk, gemv<WBf16>, tile<WBf16>};

}  // namespace ftnative

// AVX2 + FMA kernels (8 fp32 lanes). bf16 weights widen to fp32 in registers: a 256-bit load of
// 16 bf16 gives the even ones by a 16-bit left shift of each 32-bit lane and the odd ones by
// masking the low half, so gemv reads its inputs de-interleaved in chunks of 16.
// Quantised weights (quant_simd.h): e4m3 bytes become fp16 bit patterns converted by F16C;
// e2m1 nibbles index an 8-entry magnitude table with vpermps and take their sign by xor.
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "kernels.h"
#include "quant_decode.h"

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
  FT_INLINE static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
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

struct Q {
  using Tab = __m256;  // |e2m1| of codes 0..7 times the scale; bit 3 of a code is its sign

  // e4m3 s.eeee.mmm -> fp16 s.0eeee.mmm0000000 (value * 2^-8, subnormals included): sign-extend
  // to 16 bits, shift left 7 (the sign copies land on bits 15 and 14), clear bit 14.
  FT_INLINE static void fp8x2(const uint8_t* p, V::T& a, V::T& b) {
    __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
    a = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    b = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  }
  FT_INLINE static Tab table(float s) {
    return _mm256_mul_ps(_mm256_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f),
                         _mm256_set1_ps(s));
  }
  FT_INLINE static Tab tablemul(Tab t, float g) { return _mm256_mul_ps(t, _mm256_set1_ps(g)); }
  // 8 bytes, one per 32-bit lane; vpermps reads the low 3 bits of each index. A step of 16
  // inputs never spans two scale groups here (the smallest group is 16), so t1 is unused.
  FT_INLINE static void fp4x2(const uint8_t* p, Tab t0, Tab, V::T& ev, V::T& od) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
    const __m256 s_ev = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, 28), sign));
    const __m256 s_od = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, 24), sign));
    ev = _mm256_xor_ps(_mm256_permutevar8x32_ps(t0, b), s_ev);
    od = _mm256_xor_ps(_mm256_permutevar8x32_ps(t0, _mm256_srli_epi32(b, 4)), s_od);
  }
  FT_INLINE static void interleave(V::T ev, V::T od, V::T& lo, V::T& hi) {
    const __m256 u0 = _mm256_unpacklo_ps(ev, od);  // e0 o0 e1 o1 | e4 o4 e5 o5
    const __m256 u1 = _mm256_unpackhi_ps(ev, od);  // e2 o2 e3 o3 | e6 o6 e7 o7
    lo = _mm256_permute2f128_ps(u0, u1, 0x20);
    hi = _mm256_permute2f128_ps(u0, u1, 0x31);
  }
};

#include "quant_simd.h"

}  // namespace

const KernelSet kAvx2F32 = {"avx2", WF32::kChunk, gemv<WF32>, tile<WF32>};
const KernelSet kAvx2Bf16 = {"avx2", WBf16::kChunk, gemv<WBf16>, tile<WBf16>};
const QKernelSet kAvx2Q[kNumQFormats] = FT_QUANT_SETS("avx2");

}  // namespace ftnative

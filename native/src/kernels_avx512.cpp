// AVX-512 kernels (16 fp32 lanes): the same bodies as AVX2 (kernels_simd.h) on zmm registers.
// bf16 weights widen with shift/mask like AVX2, so gemv inputs are de-interleaved in chunks of
// 32. Only AVX512F/BW/VL instructions are used (no AVX512-BF16 dot products: they would round
// the fp32 activations to bf16). Quantised weights: e4m3 via fp16 bit patterns like AVX2 (with
// AVX512BW 16-bit shifts); e2m1 codes index a 32-entry table pair (vpermt2ps), one 16-entry
// signed table per scale group, so a 32-input step may span two Nvfp4 groups.
#include <immintrin.h>

// GCC 12's AVX-512 intrinsics seed their masked builtins with _mm512_undefined_*(), which trips
// -Wuninitialized at every inlining site; the values are never read.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <cstring>
#include <vector>

#include "kernels.h"
#include "quant_decode.h"

#define FT_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define FT_INLINE FT_TARGET __attribute__((always_inline)) inline

namespace ftnative {
namespace {

struct V {
  using T = __m512;
  static constexpr int kLanes = 16;
  FT_INLINE static T zero() { return _mm512_setzero_ps(); }
  FT_INLINE static T load(const float* p) { return _mm512_loadu_ps(p); }
  FT_INLINE static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  FT_INLINE static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  FT_INLINE static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  FT_INLINE static T set1(float f) { return _mm512_set1_ps(f); }
  FT_INLINE static float hsum(T v) { return _mm512_reduce_add_ps(v); }
};

constexpr int kTileRows = 8;  // 8 rows x 1 vector = 8 accumulators

struct WF32 {
  using E = float;
  static constexpr int kChunk = 0;
  FT_INLINE static void load2(const float* w, V::T& a, V::T& b) {
    a = _mm512_loadu_ps(w);
    b = _mm512_loadu_ps(w + 16);
  }
  FT_INLINE static void bcast2(const float* w, V::T& lo, V::T& hi) {
    lo = _mm512_set1_ps(w[0]);
    hi = _mm512_set1_ps(w[1]);
  }
  FT_INLINE static float scalar(const float* w) { return *w; }
};

struct WBf16 {
  using E = uint16_t;
  static constexpr int kChunk = 32;
  FT_INLINE static void split(__m512i v, V::T& even, V::T& odd) {
    even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  FT_INLINE static void load2(const uint16_t* w, V::T& a, V::T& b) {
    split(_mm512_loadu_si512(w), a, b);
  }
  FT_INLINE static void bcast2(const uint16_t* w, V::T& lo, V::T& hi) {
    int32_t pair;
    std::memcpy(&pair, w, sizeof pair);  // w[0] in the low half, w[1] in the high half
    split(_mm512_set1_epi32(pair), lo, hi);
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
  using Tab = __m512;  // the 16 e2m1 code values times the scale

  // See kernels_avx2.cpp: sign-extend, shift left 7, clear bit 14 = fp16 of value * 2^-8.
  FT_INLINE static void fp8x2(const uint8_t* p, V::T& a, V::T& b) {
    __m512i h = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    h = _mm512_and_si512(_mm512_slli_epi16(h, 7), _mm512_set1_epi16(static_cast<short>(0xBFFF)));
    a = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    b = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
  }
  FT_INLINE static Tab table(float s) {
    return _mm512_mul_ps(_mm512_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -0.5f,
                                        -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f),
                         _mm512_set1_ps(s));
  }
  FT_INLINE static Tab tablemul(Tab t, float g) { return _mm512_mul_ps(t, _mm512_set1_ps(g)); }
  // 16 bytes, one per 32-bit lane; index bit 4 (set in lanes 8..15) picks t1 over t0.
  FT_INLINE static void fp4x2(const uint8_t* p, Tab t0, Tab t1, V::T& ev, V::T& od) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i half = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16, 16, 16);
    const __m512i lo = _mm512_or_si512(_mm512_and_si512(b, _mm512_set1_epi32(15)), half);
    const __m512i hi = _mm512_or_si512(_mm512_srli_epi32(b, 4), half);
    ev = _mm512_permutex2var_ps(t0, lo, t1);
    od = _mm512_permutex2var_ps(t0, hi, t1);
  }
  FT_INLINE static void interleave(V::T ev, V::T od, V::T& lo, V::T& hi) {
    const __m512i il = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i ih =
        _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    const V::T l = _mm512_permutex2var_ps(ev, il, od);
    hi = _mm512_permutex2var_ps(ev, ih, od);
    lo = l;
  }
};

#include "quant_simd.h"

}  // namespace

const KernelSet kAvx512F32 = {"avx512", WF32::kChunk, gemv<WF32>, tile<WF32>};
const KernelSet kAvx512Bf16 = {"avx512", WBf16::kChunk, gemv<WBf16>, tile<WBf16>};
const QKernelSet kAvx512Q[kNumQFormats] = FT_QUANT_SETS("avx512");

}  // namespace ftnative

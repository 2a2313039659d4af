// The AVX-512F vectors of the prefill attention kernels (prefill_attention_impl.h), shared by
// prefill_attention_avx512.cpp and prefill_attention_avx512bf16.cpp; the including file defines
// FT_INLINE for its target.
#pragma once

#include <immintrin.h>

#include <cstdint>

// (internal linkage: each file has its own copy, compiled for its target)
namespace ftdense {
namespace {

struct Avx512 {
  using T = __m512;
  static constexpr int kLanes = 16, kRB = 8, kNV = 2;
  static constexpr bool kDot = false;
  FT_INLINE static T zero() { return _mm512_setzero_ps(); }
  FT_INLINE static T set1(float f) { return _mm512_set1_ps(f); }
  FT_INLINE static T load(const float* p) { return _mm512_loadu_ps(p); }
  FT_INLINE static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  FT_INLINE static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  FT_INLINE static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  FT_INLINE static T add(T a, T b) { return _mm512_add_ps(a, b); }
  FT_INLINE static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  FT_INLINE static T max(T a, T b) { return _mm512_max_ps(a, b); }
  FT_INLINE static T round(T a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  FT_INLINE static T pow2(T n) {
    const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  }
  FT_INLINE static T widen(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  // dst[j * ldd + i] = src[i * lds + j] for i, j < 16: pairs of rows interleaved, then groups of
  // four, then 128-bit quarters gathered by two shuffle_f32x4 steps
  FT_INLINE static void transpose(const float* src, int64_t lds, float* dst, int64_t ldd) {
    __m512 s[16], u[4][4];
    for (int g = 0; g < 4; ++g) {
      const float* p = src + 4 * g * lds;
      const __m512 r0 = load(p), r1 = load(p + lds), r2 = load(p + 2 * lds), r3 = load(p + 3 * lds);
      const __m512 t0 = _mm512_unpacklo_ps(r0, r1), t1 = _mm512_unpackhi_ps(r0, r1);
      const __m512 t2 = _mm512_unpacklo_ps(r2, r3), t3 = _mm512_unpackhi_ps(r2, r3);
      s[4 * g + 0] = _mm512_shuffle_ps(t0, t2, 0x44);  // column 4j: rows 4g .. 4g+3
      s[4 * g + 1] = _mm512_shuffle_ps(t0, t2, 0xEE);  // 4j + 1
      s[4 * g + 2] = _mm512_shuffle_ps(t1, t3, 0x44);  // 4j + 2
      s[4 * g + 3] = _mm512_shuffle_ps(t1, t3, 0xEE);  // 4j + 3
    }
    for (int c = 0; c < 4; ++c) {
      u[c][0] = _mm512_shuffle_f32x4(s[c], s[4 + c], 0x88);
      u[c][1] = _mm512_shuffle_f32x4(s[c], s[4 + c], 0xDD);
      u[c][2] = _mm512_shuffle_f32x4(s[8 + c], s[12 + c], 0x88);
      u[c][3] = _mm512_shuffle_f32x4(s[8 + c], s[12 + c], 0xDD);
      store(dst + c * ldd, _mm512_shuffle_f32x4(u[c][0], u[c][2], 0x88));
      store(dst + (4 + c) * ldd, _mm512_shuffle_f32x4(u[c][1], u[c][3], 0x88));
      store(dst + (8 + c) * ldd, _mm512_shuffle_f32x4(u[c][0], u[c][2], 0xDD));
      store(dst + (12 + c) * ldd, _mm512_shuffle_f32x4(u[c][1], u[c][3], 0xDD));
    }
  }
};

}  // namespace
}  // namespace ftdense

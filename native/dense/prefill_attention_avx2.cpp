// The prefill attention tile kernel (prefill_attention_impl.h) on AVX2 + FMA: 8 lanes, register
// tiles of 6 rows x 16 columns (12 accumulators, 2 loads, a broadcast: 15 of the 16 ymm).
#include <immintrin.h>

#define FT_TARGET __attribute__((target("avx2,fma")))
#define FT_INLINE FT_TARGET __attribute__((always_inline)) inline

#include "prefill_attention_impl.h"

namespace ftdense {
namespace {

struct Avx2 {
  using T = __m256;
  static constexpr int kLanes = 8, kRB = 6, kNV = 2;
  FT_INLINE static T zero() { return _mm256_setzero_ps(); }
  FT_INLINE static T set1(float f) { return _mm256_set1_ps(f); }
  FT_INLINE static T load(const float* p) { return _mm256_loadu_ps(p); }
  FT_INLINE static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  FT_INLINE static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  FT_INLINE static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  FT_INLINE static T add(T a, T b) { return _mm256_add_ps(a, b); }
  FT_INLINE static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  FT_INLINE static T max(T a, T b) { return _mm256_max_ps(a, b); }
  FT_INLINE static T round(T a) {
    return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  FT_INLINE static T pow2(T n) {
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  }
  FT_INLINE static T widen(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};

}  // namespace

void prefill_tile_avx2(const KvPages& kv, const PrefillTile& t) {
  prefill_impl::prefill_tile<Avx2>(kv, t);
}

}  // namespace ftdense

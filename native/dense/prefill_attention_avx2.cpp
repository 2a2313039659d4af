// The prefill attention tile kernel (prefill_attention_impl.h) on AVX2 + FMA: 8 lanes, register
// tiles of 6 rows x 16 columns (12 accumulators, 2 loads, a broadcast: 15 of the 16 ymm).
//
// Also the Lightning Indexer's scoring kernel (index_impl.h) on the same vectors: register tiles
// of 4 heads x 16 keys (8 accumulators, FMA latency x pipes on Zen 3; per column 2 key loads and
// 4 q broadcasts feed 8 fused multiply-adds). Measured on a packed tile (AMD EPYC Zen 3, one
// core, 32 heads x 128): 4 x 16 ran at 41-45 G multiply-adds/s, the core's FMA peak
// (fma_probe_avx2: 44); 6 x 16 (12 accumulators) 32, 4 x 24 33, 8 x 8 30.
#include <immintrin.h>

#define FT_TARGET __attribute__((target("avx2,fma")))
#define FT_INLINE FT_TARGET __attribute__((always_inline)) inline

#include "index_pack_x86.h"
#include "prefill_attention_impl.h"
#include "prefill_small_impl.h"
#include "sparse_attention.h"

namespace ftdense {
namespace {

struct Avx2 {
  using T = __m256;
  static constexpr int kLanes = 8, kRB = 6, kNV = 2;
  static constexpr bool kDot = false;
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
  // dst[j * ldd + i] = src[i * lds + j] for i, j < 8
  FT_INLINE static void transpose(const float* src, int64_t lds, float* dst, int64_t ldd) {
    __m256 s[8];
    for (int g = 0; g < 2; ++g) {
      const float* p = src + 4 * g * lds;
      const __m256 r0 = load(p), r1 = load(p + lds), r2 = load(p + 2 * lds), r3 = load(p + 3 * lds);
      const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
      const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
      s[4 * g + 0] = _mm256_shuffle_ps(t0, t2, 0x44);  // columns 0 | 4 of rows 4g .. 4g+3
      s[4 * g + 1] = _mm256_shuffle_ps(t0, t2, 0xEE);  // 1 | 5
      s[4 * g + 2] = _mm256_shuffle_ps(t1, t3, 0x44);  // 2 | 6
      s[4 * g + 3] = _mm256_shuffle_ps(t1, t3, 0xEE);  // 3 | 7
    }
    for (int c = 0; c < 4; ++c) {
      store(dst + c * ldd, _mm256_permute2f128_ps(s[c], s[4 + c], 0x20));
      store(dst + (4 + c) * ldd, _mm256_permute2f128_ps(s[c], s[4 + c], 0x31));
    }
  }
};

}  // namespace

void prefill_tile_avx2(const KvPages& kv, const PrefillTile& t) {
  if (prefill_small_tile(t, Avx2::kLanes)) prefill_impl::prefill_tile_small<Avx2>(kv, t);
  else prefill_impl::prefill_tile<Avx2>(kv, t);
}

void index_avx2(const float* q, const float* w, int heads, int dim, float scale,
                const char* const* keys, bool bf16, int n, float* scores) {
  using V = index_impl::IndexVec<Avx2, 4, 2, index_impl::PackX86>;
  index_impl::index_keys<V>(q, w, heads, dim, scale, keys, bf16, n, scores);
}

FT_TARGET float fma_probe_avx2(int64_t iters) {
  __m256 a[kFmaProbeChains];
  for (int i = 0; i < kFmaProbeChains; ++i) a[i] = _mm256_set1_ps(1.0f + 1e-3f * i);
  const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-6f);
  for (int64_t t = 0; t < iters; ++t)
    for (int i = 0; i < kFmaProbeChains; ++i) a[i] = _mm256_fmadd_ps(a[i], m, c);
  __m256 s = a[0];
  for (int i = 1; i < kFmaProbeChains; ++i) s = _mm256_add_ps(s, a[i]);
  alignas(32) float r[8];
  _mm256_store_ps(r, s);
  return r[0];
}

}  // namespace ftdense

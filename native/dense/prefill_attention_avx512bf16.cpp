// The prefill attention tile kernel (prefill_attention_impl.h) on AVX512-BF16 ("avx512bf16", the
// cpu_bf16_attention path): both products on vdpbf16ps, two multiply-adds per fp32 lane per
// instruction, over bf16 queries and weights (rounded to nearest even) and the bf16 pool's keys and
// values; the softmax state stays fp32 (prefill_tile says how). Its arithmetic is the "emubf16"
// kernel's (prefill_attention.cpp), bit for bit. Tiles of a fp32 pool take the AVX-512 kernel.
#include <immintrin.h>

#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define FT_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))
#define FT_INLINE FT_TARGET __attribute__((always_inline)) inline

#include "prefill_attention_impl.h"
#include "prefill_avx512_vec.h"

namespace ftdense {
namespace {

// Avx512's register tiles (8 rows x 32 columns) measured best here too (one core, 512 rows at
// 8k keys: 8 x 2 vectors 82-85 G multiply-adds/s; 4 x 4 80, 12 x 2 79, 8 x 3 78, 10 x 2 77,
// 6 x 4 75).
struct Avx512Bf16 : Avx512 {
  using I = __m512i;
  static constexpr bool kDot = true;
  FT_INLINE static I loadi(const uint32_t* p) { return _mm512_loadu_si512(p); }
  FT_INLINE static T dp(T c, uint32_t a, I b) {
    return _mm512_dpbf16_ps(c, (__m512bh)_mm512_set1_epi32(static_cast<int>(a)), (__m512bh)b);
  }
  // prefill_impl::bf16_bits on each lane
  FT_INLINE static T bf16r(T x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i one = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(one, _mm512_set1_epi32(0x7fff)));
    const __mmask16 normal = _mm512_test_epi32_mask(r, _mm512_set1_epi32(0x7f800000));
    const __m512i sign = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
    const __m512i hi = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(normal, sign, hi));
  }
  FT_INLINE static void pack(T lo, T hi, uint32_t* dst) {
    const __m512i h = _mm512_and_si512(_mm512_castps_si512(hi),
                                       _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
    _mm512_storeu_si512(dst, _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(lo), 16), h));
  }
  FT_INLINE static void interleave(const uint16_t* a, const uint16_t* b, uint32_t* dst) {
    const __m256i* pa = reinterpret_cast<const __m256i*>(a);
    const __m256i* pb = reinterpret_cast<const __m256i*>(b);
    const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(pa));
    const __m512i y = _mm512_cvtepu16_epi32(_mm256_loadu_si256(pb));
    _mm512_storeu_si512(dst, _mm512_or_si512(x, _mm512_slli_epi32(y, 16)));
  }
};

}  // namespace

void prefill_tile_avx512bf16(const KvPages& kv, const PrefillTile& t) {
  if (!kv.bf16) prefill_tile_avx512(kv, t);
  else prefill_impl::prefill_tile<Avx512Bf16>(kv, t);
}

}  // namespace ftdense

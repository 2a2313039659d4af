// The indexer's key packing on x86 (index_impl.h's IndexVec Pack), for the AVX2 and AVX-512
// kernels: whole groups of 8 keys x 8 columns widened and transposed in registers (AVX2), the
// rest (a tile's last keys, a dim off 8) one element at a time. The including file defines
// FT_INLINE with at least avx2 enabled.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "index_impl.h"

namespace ftdense {
namespace index_impl {

template <bool BF16>
FT_INLINE __m256 load8(const char* row, int e) {
  if constexpr (BF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row) + e / 8);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + e);
  }
}

// kt[(e + r) * KW + c + t] = key t's element e + r, for 8 keys and 8 columns.
template <bool BF16, int KW>
FT_INLINE void transpose8(const char* const* keys, int e, float* kt) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = load8<BF16>(keys[i], e);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  r[0] = _mm256_shuffle_ps(t[0], t[2], 0x44);
  r[1] = _mm256_shuffle_ps(t[0], t[2], 0xEE);
  r[2] = _mm256_shuffle_ps(t[1], t[3], 0x44);
  r[3] = _mm256_shuffle_ps(t[1], t[3], 0xEE);
  r[4] = _mm256_shuffle_ps(t[4], t[6], 0x44);
  r[5] = _mm256_shuffle_ps(t[4], t[6], 0xEE);
  r[6] = _mm256_shuffle_ps(t[5], t[7], 0x44);
  r[7] = _mm256_shuffle_ps(t[5], t[7], 0xEE);
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(kt + (e + i) * KW, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(kt + (e + i + 4) * KW, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

struct PackX86 {
  template <int KW>
  FT_INLINE static void run(const char* const* keys, bool bf16, int dim, int nk, float* kt) {
    if (nk != KW || dim % 8 != 0) return PackGeneric::run<KW>(keys, bf16, dim, nk, kt);
    for (int c = 0; c < KW; c += 8)
      for (int e = 0; e < dim; e += 8) {
        if (bf16) transpose8<true, KW>(keys + c, e, kt + c);
        else transpose8<false, KW>(keys + c, e, kt + c);
      }
  }
};

}  // namespace index_impl
}  // namespace ftdense

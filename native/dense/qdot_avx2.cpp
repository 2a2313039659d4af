// AVX2 qdot kernels (qdot.h): maddubs + madd on 256-bit vectors.
#include <immintrin.h>

#include <cstring>

#include "qdot.h"
#include "qdot_common.h"

namespace ftdense {

namespace {

#define QDOT_TARGET "avx2,fma,f16c"

__attribute__((target(QDOT_TARGET))) inline __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

#include "qdot_simd.h"

#undef QDOT_TARGET

}  // namespace

const QDotSet kQDotAvx2 = {"avx2", quantize_simd, {row_q8_0_simd, row_q4_k_simd}};

}  // namespace ftdense

// AVX512-VNNI qdot kernels (qdot.h): vpdpbusd on 256-bit vectors (needs AVX512VL too), the same
// bodies as the AVX2 file with the maddubs + madd pair replaced by one instruction, and madd +
// add by vpdpwssd.
#include <immintrin.h>

#include <cstring>

#include "qdot.h"
#include "qdot_common.h"
#include "row_tasks.h"

namespace ftdense {

namespace {

#define QDOT_TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"

__attribute__((target(QDOT_TARGET))) inline __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}

__attribute__((target(QDOT_TARGET))) inline __m256i madd_acc(__m256i acc, __m256i a, __m256i b) {
  return _mm256_dpwssd_epi32(acc, a, b);
}

__attribute__((target(QDOT_TARGET))) inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(acc, u, s);
}

// dot_acc is one instruction (kernels may accumulate longer before scaling)
constexpr bool kDotFused = true;

#include "qdot_simd.h"
#include "qdot_simd32.h"
#include "qdot_simd_k.h"
#include "qdot_simd_x8.h"

#undef QDOT_FN
#undef QDOT_TARGET

}  // namespace

const QDotSet kQDotVnni = {"vnni",
                            quantize_simd,
                            {row_simd<Signed32<DecodeQ8_0>>, row_simd<ScaleMin<false>>,
                             row_simd<Q6K>, row_simd<ScaleMin<true>>, row_simd<Signed32<DecodeMxfp4>>,
                             row_simd<Signed32<DecodeQ5_0>>, row_simd<Signed32<DecodeQ4_0>>,
                             group_simd<Q4KX8>, group_simd<Q6KX8>, group_simd<Mxfp4X8>,
                             group_simd<Q80X8>, group_simd<Q5KX8>},
                            {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                             pair_simd<Q4KX8>, pair_simd<Q6KX8>, pair_simd<Mxfp4X8>,
                             pair_simd<Q80X8>, pair_simd<Q5KX8>}};

}  // namespace ftdense

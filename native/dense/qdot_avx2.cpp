// AVX2 qdot kernels (qdot.h): maddubs + madd on 256-bit vectors.
#include <immintrin.h>

#include <cstring>

#include "qdot.h"
#include "qdot_common.h"
#include "row_tasks.h"

namespace ftdense {

namespace {

#define QDOT_TARGET "avx2,fma,f16c"

__attribute__((target(QDOT_TARGET))) inline __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

__attribute__((target(QDOT_TARGET))) inline __m256i madd_acc(__m256i acc, __m256i a, __m256i b) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}

__attribute__((target(QDOT_TARGET))) inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, dot_u8s8(u, s));
}

// dot_acc is one instruction (kernels may accumulate longer before scaling)
constexpr bool kDotFused = false;

// The dword at p in every lane (qdot_vnni.cpp's is a load GCC cannot forward from a store)
__attribute__((target(QDOT_TARGET))) inline __m256i bcast32_load(const int32_t* p) {
  return _mm256_set1_epi32(*p);
}

// dot_acc against the 4 activation bytes at p in every lane (qdot_vnni.cpp's one instruction)
__attribute__((target(QDOT_TARGET))) inline __m256i dot_acc_b32(__m256i acc, __m256i u,
                                                                const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return dot_acc(acc, u, _mm256_set1_epi32(v));
}

#define QDOT_HAS_512 0  // 256-bit AVX2 only

#include "qdot_simd.h"
#include "qdot_simd32.h"
#include "qdot_simd_k.h"
#include "qdot_simd_x8.h"

#undef QDOT_FN
#undef QDOT_TARGET
#undef QDOT_HAS_512

}  // namespace

const QDotSet kQDotAvx2 = {"avx2",
                            quantize_simd,
                            {row_simd<Signed32<DecodeQ8_0>>, row_simd<ScaleMin<false>>,
                             row_simd<Q6K>, row_simd<ScaleMin<true>>, row_simd<Signed32<DecodeMxfp4>>,
                             row_simd<Signed32<DecodeQ5_0>>, row_simd<Signed32<DecodeQ4_0>>,
                             group_simd<Q4KX8>, group_simd<Q6KX8>, group_simd<Mxfp4X8>,
                             group_simd<Q80X8>, group_simd<Q5KX8>},
                            {}};  // no pair kernels (qdot.h)

}  // namespace ftdense

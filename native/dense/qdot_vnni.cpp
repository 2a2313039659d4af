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

// dot_acc against the 4 activation bytes at p in every lane, the broadcast folded into the
// vpdpbusd as its memory operand ({1to8}): GCC 12 emits a separate vpbroadcastd for
// _mm256_set1_epi32 of a loaded dword, one more instruction and register per dot, which the
// Q6_K x8 kernel at 4 tokens (256 dots a super-block) could not spare (qdot_simd_x8_kquant.h).
__attribute__((target(QDOT_TARGET))) inline __m256i dot_acc_b32(__m256i acc, __m256i u,
                                                                const void* p) {
  __asm__("vpdpbusd %2%{1to8%}, %1, %0"
          : "+v"(acc)
          : "v"(u), "m"(*static_cast<const int32_t*>(p)));
  return acc;
}

// The dword at p in every lane, loaded by the broadcast itself: where the dword was stored just
// before (Q6KX8's accumulator starts), GCC 12 kept the stored vector in registers and extracted
// each lane (vpextrd, valignd), several instructions a broadcast.
__attribute__((target(QDOT_TARGET))) inline __m256i bcast32_load(const int32_t* p) {
  __m256i v;
  __asm__("vpbroadcastd %1, %0" : "=v"(v) : "m"(*p));
  return v;
}

// 512-bit AVX-512 instructions may be used (the target has avx512f)
#define QDOT_HAS_512 1

#include "qdot_simd.h"
#include "qdot_simd32.h"
#include "qdot_simd_k.h"
#include "qdot_simd_x8.h"

#undef QDOT_FN
#undef QDOT_TARGET
#undef QDOT_HAS_512

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

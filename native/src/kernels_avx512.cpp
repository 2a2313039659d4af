// AVX-512 kernels (16 fp32 lanes): the same bodies as AVX2 (kernels_simd.h) on zmm registers.
// bf16 weights widen with shift/mask like AVX2, so gemv inputs are de-interleaved in chunks of
// 32. Only AVX512F/BW/VL instructions are used (no AVX512-BF16 dot products: they would round
// the fp32 activations to bf16). Quantised weights: e4m3 via fp16 bit patterns like AVX2 (with
// AVX512BW 16-bit shifts); e2m1 codes index a 16-entry value table (vpermps).
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
  // See kernels_avx2.cpp: sign-extend, shift left 7, clear bit 14 = fp16 of value * 2^-8.
  FT_INLINE static void fp8x2(const uint8_t* p, V::T& a, V::T& b) {
    __m512i h = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    h = _mm512_and_si512(_mm512_slli_epi16(h, 7), _mm512_set1_epi16(static_cast<short>(0xBFFF)));
    a = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    b = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
  }

  // 32 inputs per step, even ones then odd ones (the bf16 layout of this ISA).
  static constexpr int kFp4In = 32;
  static constexpr const uint8_t* kFp4Perm = nullptr;
  // 16 bytes, one per 32-bit lane; vpermps reads the low 4 bits of each index: the code.
  FT_INLINE static void fp4_step(const uint8_t* p, V::T* w) {
    const __m512 values = _mm512_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -0.5f,
                                         -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f);
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    w[0] = _mm512_permutexvar_ps(b, values);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), values);
  }
  // Lanes 0-7 hold inputs [0, 16) of the step, lanes 8-15 inputs [16, 32).
  static constexpr int fp4_blocks() { return 2; }
  static constexpr int fp4_blk(int v, int) { return v; }
  FT_INLINE static void fp4_scales(const float* gs, int G, V::T* sv) {
    sv[0] = sv[1] = G == 32 ? _mm512_set1_ps(gs[0])
                            : _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(gs[0]),
                                                   _mm512_set1_ps(gs[1]));
  }
};

#include "quant_simd.h"

}  // namespace

const KernelSet kAvx512F32 = {"avx512", WF32::kChunk, gemv<WF32>, tile<WF32>};
const KernelSet kAvx512Bf16 = {"avx512", WBf16::kChunk, gemv<WBf16>, tile<WBf16>};
const QKernelSet kAvx512Q[kNumQFormats] = FT_QUANT_SETS("avx512");

}  // namespace ftnative

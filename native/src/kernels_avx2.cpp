// AVX2 + FMA kernels (8 fp32 lanes). bf16 weights widen to fp32 in registers: a 256-bit load of
// 16 bf16 gives the even ones by a 16-bit left shift of each 32-bit lane and the odd ones by
// masking the low half, so gemv reads its inputs de-interleaved in chunks of 16.
// Quantised weights (quant_simd.h): e4m3 bytes become fp16 bit patterns converted by F16C;
// e2m1 codes become bf16 through two vpshufb byte tables, in a permuted input order (Fp4Perm).
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "kernels.h"
#include "quant_decode.h"

#define FT_TARGET __attribute__((target("avx2,fma,f16c")))
#define FT_INLINE FT_TARGET __attribute__((always_inline)) inline

namespace ftnative {
namespace {

struct V {
  using T = __m256;
  static constexpr int kLanes = 8;
  FT_INLINE static T zero() { return _mm256_setzero_ps(); }
  FT_INLINE static T load(const float* p) { return _mm256_loadu_ps(p); }
  FT_INLINE static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  FT_INLINE static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  FT_INLINE static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  FT_INLINE static T set1(float f) { return _mm256_set1_ps(f); }
  FT_INLINE static float hsum(T v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};

constexpr int kTileRows = 4;  // 4 rows x 2 vectors = 8 accumulators of the 16 ymm registers

struct WF32 {
  using E = float;
  static constexpr int kChunk = 0;
  FT_INLINE static void load2(const float* w, V::T& a, V::T& b) {
    a = _mm256_loadu_ps(w);
    b = _mm256_loadu_ps(w + 8);
  }
  FT_INLINE static void bcast2(const float* w, V::T& lo, V::T& hi) {
    lo = _mm256_broadcast_ss(w);
    hi = _mm256_broadcast_ss(w + 1);
  }
  FT_INLINE static float scalar(const float* w) { return *w; }
};

struct WBf16 {
  using E = uint16_t;
  static constexpr int kChunk = 16;
  FT_INLINE static void split(__m256i v, V::T& even, V::T& odd) {
    even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  FT_INLINE static void load2(const uint16_t* w, V::T& a, V::T& b) {
    split(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), a, b);
  }
  FT_INLINE static void bcast2(const uint16_t* w, V::T& lo, V::T& hi) {
    int32_t pair;
    std::memcpy(&pair, w, sizeof pair);  // w[0] in the low half, w[1] in the high half
    split(_mm256_set1_epi32(pair), lo, hi);
  }
  FT_INLINE static float scalar(const uint16_t* w) {
    const uint32_t bits = static_cast<uint32_t>(*w) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
};

#include "kernels_simd.h"

// Input layout of an e2m1 step (64 inputs, 32 bytes): vector v, lane l holds input
// 2 * byte + nibble with byte = 16 (l / 4) + 8 (v / 2 % 2) + 4 (v % 2) + l % 4, nibble = v / 4;
// what the in-lane byte and word unpacks of Q::fp4_step produce.
struct Fp4Perm {
  uint8_t v[64];
  constexpr Fp4Perm() : v{} {
    for (int vec = 0; vec < 8; ++vec)
      for (int l = 0; l < 8; ++l) {
        const int byte = 16 * (l / 4) + 8 * (vec / 2 % 2) + 4 * (vec % 2) + l % 4;
        v[8 * vec + l] = static_cast<uint8_t>(2 * byte + vec / 4);
      }
  }
};

struct Q {
  // e4m3 s.eeee.mmm -> fp16 s.0eeee.mmm0000000 (value * 2^-8, subnormals included): sign-extend
  // to 16 bits, shift left 7 (the sign copies land on bits 15 and 14), clear bit 14.
  FT_INLINE static void fp8x2(const uint8_t* p, V::T& a, V::T& b) {
    __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
    a = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    b = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  }

  static constexpr int kFp4In = 64;
  static constexpr Fp4Perm kPermTable{};
  static constexpr const uint8_t* kFp4Perm = kPermTable.v;

  // Each e2m1 code's value as bf16: vpshufb looks up its high and low byte, byte and word
  // unpacks widen to fp32 (bf16 is the top half of an fp32). All shuffles are in-lane, so no
  // lane-crossing uop; measured 1.6x the rate of a vpermps table with sign fix-up on Zen 3.
  FT_INLINE static void fp4_step(const uint8_t* p, V::T* w) {
    const __m256i hi_b = _mm256_setr_epi8(
        0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, -0x80, -0x41, -0x41, -0x41, -0x40, -0x40,
        -0x40, -0x40, 0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, -0x80, -0x41, -0x41, -0x41,
        -0x40, -0x40, -0x40, -0x40);
    const __m256i lo_b = _mm256_setr_epi8(
        0x00, 0x00, -0x80, -0x40, 0x00, 0x40, -0x80, -0x40, 0x00, 0x00, -0x80, -0x40, 0x00, 0x40,
        -0x80, -0x40, 0x00, 0x00, -0x80, -0x40, 0x00, 0x40, -0x80, -0x40, 0x00, 0x00, -0x80, -0x40,
        0x00, 0x40, -0x80, -0x40);
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i zero = _mm256_setzero_si256();
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i nib[2] = {_mm256_and_si256(b, m4), _mm256_and_si256(_mm256_srli_epi16(b, 4), m4)};
    for (int n = 0; n < 2; ++n) {
      const __m256i lo = _mm256_shuffle_epi8(lo_b, nib[n]), hi = _mm256_shuffle_epi8(hi_b, nib[n]);
      const __m256i words[2] = {_mm256_unpacklo_epi8(lo, hi), _mm256_unpackhi_epi8(lo, hi)};
      for (int h = 0; h < 2; ++h) {
        w[4 * n + 2 * h] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, words[h]));
        w[4 * n + 2 * h + 1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, words[h]));
      }
    }
  }
  // Lanes 0-3 of every vector come from inputs [0, 32) of the step, lanes 4-7 from [32, 64);
  // with 16-input groups, vectors v / 2 % 2 == 0 hold groups 0 | 2, the others 1 | 3.
  static constexpr int fp4_blocks() { return 2; }
  static constexpr int fp4_blk(int v, int) { return v / 2 % 2; }
  FT_INLINE static void fp4_scales(const float* gs, int G, V::T* sv) {
    if (G == 32) {
      sv[0] = sv[1] = _mm256_setr_ps(gs[0], gs[0], gs[0], gs[0], gs[1], gs[1], gs[1], gs[1]);
    } else {
      sv[0] = _mm256_setr_ps(gs[0], gs[0], gs[0], gs[0], gs[2], gs[2], gs[2], gs[2]);
      sv[1] = _mm256_setr_ps(gs[1], gs[1], gs[1], gs[1], gs[3], gs[3], gs[3], gs[3]);
    }
  }
};

#include "quant_simd.h"

}  // namespace

const KernelSet kAvx2F32 = {"avx2", WF32::kChunk, gemv<WF32>, tile<WF32>};
const KernelSet kAvx2Bf16 = {"avx2", WBf16::kChunk, gemv<WBf16>, tile<WBf16>};
const QKernelSet kAvx2Q[kNumQFormats] = FT_QUANT_SETS("avx2");

}  // namespace ftnative

// The kernels of qdot_simd_x8.h whose unit is one 32-input block (MXFP4_X8, Q8_0_X8): included
// by it, after its shared helpers and before x8_run.
#pragma once

// MXFP4 x8: per block of 32 inputs the 8 rows' e8m0 bytes, then four words, lane r of word c
// holding bytes 4c .. 4c + 3 of row r's nibble bytes (low nibbles: inputs 4c .. 4c + 3, high
// nibbles: 16 + 4c ..). Each code becomes its doubled e2m1 value plus 12 (0 .. 24, unsigned:
// no sign trick), and 12 times the block's activation sum (the quantiser's s) comes off the
// integer sum: one table lookup and one vpdpbusd per word and half, 8 rows a lane each.
// (Block32X8: what the kernels whose unit is one 32-input block share.)
struct Block32X8 {
  static constexpr bool kSums16 = false;
  static constexpr bool kSumsNeg32 = false;
  static constexpr bool kPairBlock = false;
  static constexpr int kSbInputs = 32;  // the unit is one block (sb counts blocks)

 protected:
  // res += total (the block's integer sums of the 8 rows) * dw (their scales) * token u's d.
  __attribute__((target(QDOT_TARGET), always_inline)) static inline void add_scaled(
      __m256i total, __m256 dw, const float* d, int u, int na, int sb, __m256& res) {
    res = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total),
                          _mm256_mul_ps(dw, _mm256_set1_ps(d[u * na + sb])), res);
  }
};
struct Mxfp4X8 : Block32X8 {
  static constexpr int kMaxTokens = 4;
  static constexpr int kBlockBytes = kMxfp4Bytes;  // per row and block
  template <int NT>
  __attribute__((target(QDOT_TARGET), always_inline)) static inline void block(
      const uint8_t* blk, const uint8_t* pf, int K, const int8_t* q, const float* d,
      const int16_t* s, int sb, __m256* res) {
    const int na = K / 32;
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i table = _mm256_add_epi8(  // kMxfp4Values + 12 in both halves: 0 .. 24
        _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kMxfp4Values))),
        _mm256_set1_epi8(12));
    request_unit<kMxfp4Bytes>(pf);
    // One or two tokens: low and high nibbles on two chains a token. One chain of 8 dependent
    // dot products a block held the kernel to the dot's latency: from L2 on one Zen 4 core,
    // interleaved in one process, 1.10-1.13x (group and pair kernels, T = 1); three or more
    // tokens are chains enough (and AVX2's 16 registers would spill a second set).
    constexpr int kChains = NT <= 2 ? 2 : 1;
    __m256i acc[NT][2];
    for (int u = 0; u < NT; ++u) acc[u][0] = acc[u][1] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 8 + 32 * c));
      const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low));
      const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
      for (int u = 0; u < NT; ++u) {
        const int8_t* xs = q + static_cast<int64_t>(u) * K + sb * 32 + 4 * c;
        acc[u][0] = dot_acc(acc[u][0], lo, bcast32(xs));
        acc[u][kChains - 1] = dot_acc(acc[u][kChains - 1], hi, bcast32(xs + 16));
      }
    }
    // the rows' half scales 2^(e - 128), as e8m0_half (qdot_common.h): subnormal for e < 2
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk)));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256 dw = _mm256_castsi256_ps(
        _mm256_blendv_epi8(normal, small, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
    for (int u = 0; u < NT; ++u) {
      const __m256i sum = kChains == 2 ? _mm256_add_epi32(acc[u][0], acc[u][1]) : acc[u][0];
      add_scaled(_mm256_sub_epi32(sum, _mm256_set1_epi32(12 * s[u * na + sb])), dw, d, u, na, sb,
                 res[u]);
    }
  }
};

// Q8_0 x8: per block of 32 inputs the 8 rows' fp16 d, then eight words, lane r of word c
// holding row r's int8 q[4c .. 4c + 3]. With vpdpbusd (kDotFused) each byte is flipped to
// q + 128 (unsigned) and 128 times the block's activation sum comes off the int32 sum, one op a
// word shared by the tokens; maddubs would saturate its int16 pairs on that, so AVX2 takes the
// sign trick (|q| against x signed by q: pairs of at most 2 * 128 * 127).
struct Q80X8 : Block32X8 {
  static constexpr int kMaxTokens = 4;  // 2 accumulators a token
  static constexpr int kBlockBytes = kQ80Bytes;  // per row and block
  template <int NT>
  __attribute__((target(QDOT_TARGET), always_inline)) static inline void block(
      const uint8_t* blk, const uint8_t* pf, int K, const int8_t* q, const float* d,
      const int16_t* s, int sb, __m256* res) {
    const int na = K / 32;
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    request_unit<kQ80Bytes>(pf);
    __m256i acc[NT][2];  // even and odd words: two chains a token
    for (int u = 0; u < NT; ++u) acc[u][0] = acc[u][1] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * c));
      if constexpr (kDotFused) {
        const __m256i uv = _mm256_xor_si256(v, flip);  // q + 128
        for (int u = 0; u < NT; ++u)
          acc[u][c & 1] =
              dot_acc(acc[u][c & 1], uv, bcast32(q + u * int64_t{K} + sb * 32 + 4 * c));
      } else {
        const __m256i av = _mm256_abs_epi8(v);
        for (int u = 0; u < NT; ++u) {
          const __m256i xv = bcast32(q + u * int64_t{K} + sb * 32 + 4 * c);
          acc[u][c & 1] = dot_acc(acc[u][c & 1], av, _mm256_sign_epi8(xv, v));
        }
      }
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    for (int u = 0; u < NT; ++u) {
      __m256i total = _mm256_add_epi32(acc[u][0], acc[u][1]);
      if constexpr (kDotFused)
        total = _mm256_sub_epi32(total, _mm256_set1_epi32(128 * s[u * na + sb]));
      add_scaled(total, dw, d, u, na, sb, res[u]);
    }
  }
};

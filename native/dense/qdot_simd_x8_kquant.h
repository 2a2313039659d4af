// The K-quant kernels of qdot_simd_x8.h (Q4_K_X8, Q5_K_X8, Q6_K_X8): included by it, after its
// shared helpers (bcast32, kLaneControls, shift_bit_to_4) and before x8_run, which calls a
// kernel's `block` (and Q6_K's `block_pair`) per super-block.
#pragma once

// Q4_K x8: per super-block the 8 rows' fp16 d and dmin (16 bytes each), their packed 6-bit
// scales as three 32-byte words (word w of row r at 32 + 32w + 4r), then the nibbles: vector
// v = 4 * i4 + c (c < 4, the 64-input chunk; i4 < 8) holds, in lane r, bytes 4 * i4 .. 4 * i4 + 3
// of row r's 32 nibble bytes of chunk c: low nibbles are inputs 64c + 4 * i4 + (0..3) (sub-block
// 2c), high nibbles the same + 32 (sub-block 2c + 1).
// Q5_K x8 (kFive): the same, with eight qh words between the scales and the nibbles (lane r of
// word i4 holding row r's qh[4 * i4 .. + 3]: bit j of each byte is the fifth bit of input
// 32j + the byte's index), the nibbles at 384; the values are 0..31, the same arithmetic.
template <bool kFive>
struct ScaleMinX8 {
  // decode's form: 8 accumulators a token, 3 tokens; passes of more tokens take the
  // tokens-wide form (block_wide: 2 accumulators and a sum a token), up to 8 with VNNI's 32
  // registers and 4 with AVX2's 16. AVX2 had no wide form before (3 tokens a pass, 24
  // accumulators in 16 registers); Intel Xeon VM, one core, Q4_K 4096 rows of 2048 in cache, 32
  // tokens: 1.4x (4 a pass) and 1.1x (6: spills); prefill 512 of the Q4_K_M benchmark file, 2
  // threads, builds alternated: 1.15x and 1.26x.
  static constexpr int kWideTokens = 8;
  static constexpr int kMaxTokens = kDotFused ? kWideTokens : 4;
  static constexpr int kBlockBytes = kFive ? kQ5KBytes : kQ4KBytes;  // per row and super-block
  static constexpr bool kSums16 = false;  // block's s: the quantiser's 32-input sums (qdot.h)
  static constexpr bool kPairBlock = false;  // (Q6KX8's block_pair)
  static constexpr bool kSumsNeg32 = false;  // (Q6KX8's)
  static constexpr int kSbInputs = 256;  // inputs of one unit (block's sb)
  // Q4_K with vpdpbusd (no saturation): the high nibbles are read in place (v & 0xF0, 16 times
  // their values: 4 * 240 * 128 a dword a step, 8 steps a sum, fits int32 with a 6-bit scale)
  // and each sub-block's sum shifted right by 4 once (exact: a multiple of 16) instead of
  // every nibble word shifted; maddubs (AVX2) would saturate its int16 pairs, so not there.
  static constexpr bool kHiTimes16 = kDotFused && !kFive;
  // block's eight steps of 32 inputs unrolled with VNNI, whose 32 registers hold the 8
  // accumulators of each token in place: rolled, GCC copied each accumulator out and back
  // around its vpdpbusd (two moves a dot). Intel Xeon VM (AVX-512, 2 cores), one token, old and
  // new builds alternated: Q4_K with kHiTimes16, one core, 512 x 2048 in L2 23.0 -> 26.1 GB/s
  // of weights (medians of 3), 4096 x 4096 from DRAM 9.8 -> 10.6; Q5_K from DRAM 8.8 -> 10.0;
  // decode of the Q4_K_M benchmark file, 2 threads, 1.05-1.11x. AVX2 (maddubs, 16 registers)
  // measured slower unrolled (8.6-8.7 vs 8.9-9.1 GB/s from DRAM), so it keeps the loop.
  static constexpr bool kUnrollSteps = kDotFused;
  // Super-block sb of one group (its 8 rows' bytes at blk) added into res[u], u < NT.
  template <int NT>
  __attribute__((target(QDOT_TARGET), always_inline)) static inline void block(
      const uint8_t* blk, const uint8_t* pf, int K, const int8_t* q, const float* d,
      const int16_t* s, int sb, __m256* res) {
    if constexpr (NT > 3) {
      block_wide<NT>(blk, pf, K, q, d, s, sb, res);
      return;
    }
    request_unit<kBlockBytes>(pf);
    // each weight word is unpacked once and read against the NT tokens
    __m256i acc[NT][8];
    for (int u = 0; u < NT; ++u)
      for (int j = 0; j < 8; ++j) acc[u][j] = _mm256_setzero_si256();
    if constexpr (kUnrollSteps) {
#pragma GCC unroll 8
      for (int i4 = 0; i4 < 8; ++i4) step<NT>(blk, K, q, sb, i4, acc);
    } else {
      for (int i4 = 0; i4 < 8; ++i4) step<NT>(blk, K, q, sb, i4, acc);
    }
    const __m256i sclo = scale_bytes(blk, false), schi = scale_bytes(blk, true);
    __m256i sumi[NT];
    for (int u = 0; u < NT; ++u) {
      sumi[u] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j)
        sumi[u] = _mm256_add_epi32(sumi[u], _mm256_mullo_epi32(hi_sum(acc[u][j], j % 2 == 1),
                                                               scale(j < 4 ? sclo : schi, j)));
    }
    finish<NT>(blk, K, d, s, sb, sumi, res);
  }

  // The same sums for NT > 3 tokens (prefill; VNNI's 32 registers): sub-blocks 2c and 2c + 1
  // at a time, their scales applied before the next pair, so a token holds two accumulators and
  // its scaled sum: each weight word is unpacked once for up to 8 tokens instead of 3.
  template <int NT>
  __attribute__((target(QDOT_TARGET), always_inline)) static inline void block_wide(
      const uint8_t* blk, const uint8_t* pf, int K, const int8_t* q, const float* d,
      const int16_t* s, int sb, __m256* res) {
    request_unit<kBlockBytes>(pf);
    __m256i sumi[NT];
    for (int u = 0; u < NT; ++u) sumi[u] = _mm256_setzero_si256();
    if constexpr (!kDotFused) {
      wide_pairs16<NT>(blk, K, q, sb, sumi);
      finish<NT>(blk, K, d, s, sb, sumi, res);
      return;
    }
    for (int c = 0; c < 4; ++c) {
      __m256i acc[NT][2];
      for (int u = 0; u < NT; ++u) acc[u][0] = acc[u][1] = _mm256_setzero_si256();
      for (int i4 = 0; i4 < 8; ++i4) {
        __m256i lo, hi;
        values(blk, fifth_bits(blk, i4), i4, c, lo, hi);
        for (int u = 0; u < NT; ++u) {
          const int8_t* xs = q + static_cast<int64_t>(u) * K + sb * 256 + 64 * c + 4 * i4;
          acc[u][0] = dot_acc_b32(acc[u][0], lo, xs);
          acc[u][1] = dot_acc_b32(acc[u][1], hi, xs + 32);
        }
      }
      const __m256i word = scale_bytes(blk, c >= 2);  // scales 2c and 2c + 1 of each row
      const __m256i sc0 = scale(word, 2 * c), sc1 = scale(word, 2 * c + 1);
      for (int u = 0; u < NT; ++u)
        sumi[u] = _mm256_add_epi32(
            sumi[u], _mm256_add_epi32(_mm256_mullo_epi32(acc[u][0], sc0),
                                      _mm256_mullo_epi32(hi_sum(acc[u][1], true), sc1)));
    }
    finish<NT>(blk, K, d, s, sb, sumi, res);
  }

 private:
  // block_wide's sums with maddubs (AVX2): each step's int16 pair sums are added in int16 for
  // kRun steps, then multiplied by the sub-block's scale in one madd (the scale in both int16 of
  // its row's lane), instead of a madd by ones and an add in int32 every step and a multiply of
  // the int32 sum. A pair sum is at most 2 * 15 * 127 = 3810 in magnitude (Q5_K: 2 * 31 * 127 =
  // 7874), so 8 steps (Q5_K: 4) stay below 2^15: the same exact integers as dot_acc's, so the
  // same results bit for bit, with one multiply-port instruction per token and weight word
  // instead of two (Zen 3, one core, Q4_K 1536 x 2048 in cache, 128 tokens: see the commit).
  template <int NT>
  __attribute__((target(QDOT_TARGET), always_inline)) static inline void wide_pairs16(
      const uint8_t* blk, int K, const int8_t* q, int sb, __m256i* sumi) {
    constexpr int kRun = kFive ? 4 : 8;
    for (int c = 0; c < 4; ++c)
      for (int i0 = 0; i0 < 8; i0 += kRun) {
        __m256i acc[NT][2];
        for (int u = 0; u < NT; ++u) acc[u][0] = acc[u][1] = _mm256_setzero_si256();
        if constexpr (NT == 4 && !kFive) {  // (kRun 8) the chunk's steps as one loop
          q4k_x8_chunk4(blk + 128 + 32 * c, q + sb * 256 + 64 * c, K, acc);
        } else {
          for (int i4 = i0; i4 < i0 + kRun; ++i4) {
            __m256i lo, hi;
            values(blk, fifth_bits(blk, i4), i4, c, lo, hi);
            for (int u = 0; u < NT; ++u) {
              const int8_t* xs = q + static_cast<int64_t>(u) * K + sb * 256 + 64 * c + 4 * i4;
              acc[u][0] = _mm256_add_epi16(acc[u][0], _mm256_maddubs_epi16(lo, bcast32(xs)));
              acc[u][1] = _mm256_add_epi16(acc[u][1], _mm256_maddubs_epi16(hi, bcast32(xs + 32)));
            }
          }
        }
        const __m256i word = scale_bytes(blk, c >= 2);  // scales 2c and 2c + 1 of each row
        const __m256i sc0 = scale16(word, 2 * c), sc1 = scale16(word, 2 * c + 1);
        for (int u = 0; u < NT; ++u)
          sumi[u] = _mm256_add_epi32(sumi[u], _mm256_add_epi32(_mm256_madd_epi16(acc[u][0], sc0),
                                                               _mm256_madd_epi16(acc[u][1], sc1)));
      }
  }

  // Scale j of each row (from scale_bytes(j >= 4)) in both int16 of its lane.
  __attribute__((target(QDOT_TARGET), always_inline)) static inline __m256i scale16(__m256i bytes,
                                                                                   int j) {
    return _mm256_srli_epi16(_mm256_shuffle_epi8(bytes, load_ctl(kLaneControls.high[j & 3])), 8);
  }

  // block's step i4: inputs 64c + 4 * i4 + (0..3) and the same + 32 of each chunk c, against
  // the NT tokens, into the sub-blocks' accumulators.
  template <int NT>
  __attribute__((target(QDOT_TARGET), always_inline)) static inline void step(
      const uint8_t* blk, int K, const int8_t* q, int sb, int i4, __m256i (&acc)[NT][8]) {
    const __m256i qh = fifth_bits(blk, i4);
    for (int c = 0; c < 4; ++c) {
      __m256i lo, hi;
      values(blk, qh, i4, c, lo, hi);
      for (int u = 0; u < NT; ++u) {
        const int8_t* xs = q + static_cast<int64_t>(u) * K + sb * 256 + 64 * c + 4 * i4;
        acc[u][2 * c] = dot_acc_b32(acc[u][2 * c], lo, xs);
        acc[u][2 * c + 1] = dot_acc_b32(acc[u][2 * c + 1], hi, xs + 32);
      }
    }
  }

  // A sub-block's integer sum: the odd (high-nibble) ones divided by 16 where kHiTimes16.
  __attribute__((target(QDOT_TARGET), always_inline)) static inline __m256i hi_sum(__m256i acc,
                                                                                  bool high) {
    if constexpr (kHiTimes16) return high ? _mm256_srai_epi32(acc, 4) : acc;
    return acc;
  }

  // Q5_K: qh word i4 (its lanes' fifth bits); Q4_K: zeros, not read.
  __attribute__((target(QDOT_TARGET), always_inline)) static inline __m256i fifth_bits(
      const uint8_t* blk, int i4) {
    if constexpr (kFive)
      return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * i4));
    return _mm256_setzero_si256();
  }

  // Nibble word 4 * i4 + c as the values of sub-blocks 2c (lo) and 2c + 1 (hi); Q5_K adds bits
  // 2c and 2c + 1 of each qh byte as bit 4 (16-bit shifts: no bit crosses into bit 4 of the
  // other byte for shifts of at most 4 left, 3 right).
  __attribute__((target(QDOT_TARGET), always_inline)) static inline void values(
      const uint8_t* blk, __m256i qh, int i4, int c, __m256i& lo, __m256i& hi) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const uint8_t* qs = blk + (kFive ? 384 : 128);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (4 * i4 + c)));
    lo = _mm256_and_si256(v, low);
    if constexpr (kHiTimes16) {  // the high nibbles where they are: 16 times their values
      hi = _mm256_andnot_si256(low, v);
      return;
    }
    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    if constexpr (kFive) {
      const __m256i fifth = _mm256_set1_epi8(0x10);
      lo = _mm256_or_si256(lo, _mm256_and_si256(shift_bit_to_4(qh, 2 * c), fifth));
      hi = _mm256_or_si256(hi, _mm256_and_si256(shift_bit_to_4(qh, 2 * c + 1), fifth));
    }
  }

  // Each row's 6-bit scales 0..3 (high: 4..7) as the bytes of its lane (qdot.h's packing).
  __attribute__((target(QDOT_TARGET), always_inline)) static inline __m256i scale_bytes(
      const uint8_t* blk, bool high) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32));
    if (!high) return _mm256_and_si256(w0, _mm256_set1_epi32(0x3F3F3F3F));
    const __m256i w2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 96));
    const __m256i top = _mm256_set1_epi32(0x30303030);
    return _mm256_or_si256(_mm256_and_si256(w2, _mm256_set1_epi8(0x0F)),
                           _mm256_and_si256(_mm256_srli_epi32(w0, 2), top));
  }

  // Scale j of each row as an int32, from scale_bytes(j >= 4).
  __attribute__((target(QDOT_TARGET), always_inline)) static inline __m256i scale(__m256i bytes,
                                                                                 int j) {
    return _mm256_shuffle_epi8(bytes, load_ctl(kLaneControls.byte[j & 3]));
  }

  // res[u] += d * sumi[u] - dmin * sum_j m_j * (sum of the activations of sub-block j), the
  // mins two sub-blocks a madd.
  template <int NT>
  __attribute__((target(QDOT_TARGET), always_inline)) static inline void finish(
      const uint8_t* blk, int K, const float* d, const int16_t* s, int sb, const __m256i* sumi,
      __m256* res) {
    const int na = K / 32;
    const __m256i low = _mm256_set1_epi8(0x0F), six = _mm256_set1_epi32(0x3F3F3F3F);
    const __m256i top = _mm256_set1_epi32(0x30303030);
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64));
    const __m256i w2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 96));
    const __m256i mlo = _mm256_and_si256(w1, six);
    const __m256i mhi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w2, 4), low),
                                        _mm256_and_si256(_mm256_srli_epi32(w1, 2), top));
    __m256i mp[4];  // each row's mins (2p, 2p + 1) as int16
    for (int p = 0; p < 4; ++p)
      mp[p] = _mm256_shuffle_epi8(p < 2 ? mlo : mhi, load_ctl(kLaneControls.pair[p & 1]));
    const __m256 dw0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    const __m256 dm0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
    for (int u = 0; u < NT; ++u) {
      const int16_t* su = s + u * na + sb * 8;
      __m256i mins = _mm256_setzero_si256();
      for (int p = 0; p < 4; ++p) mins = madd_acc(mins, mp[p], bcast32(su + 2 * p));
      const __m256 dx = _mm256_set1_ps(d[u * na + sb * 8]);
      res[u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[u]), _mm256_mul_ps(dw0, dx), res[u]);
      res[u] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dm0, dx), res[u]);
    }
  }
};

using Q4KX8 = ScaleMinX8<false>;
using Q5KX8 = ScaleMinX8<true>;

// The 16 sums of 16 activations of a super-block's 256 (xs) as int16, in order: two madds give
// each 32 inputs' 4-input sums and three hadds the 16-input sums (lanes [g0 g2 g4 g6 | g1 g3 g5
// g7] of each 128 inputs); the caller reads pairs (g, g + 1) as one int32.
QDOT_FN void sums16(const int8_t* xs, int16_t* out) {
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  alignas(32) int32_t part[16];
  for (int half = 0; half < 2; ++half) {
    __m256i t[4];
    for (int j = 0; j < 4; ++j)
      t[j] = _mm256_madd_epi16(
          _mm256_maddubs_epi16(ones8, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                          xs + 128 * half + 32 * j))),
          ones16);
    const __m256i s =
        _mm256_hadd_epi32(_mm256_hadd_epi32(t[0], t[1]), _mm256_hadd_epi32(t[2], t[3]));
    _mm256_store_si256(reinterpret_cast<__m256i*>(part + 8 * half), s);
  }
  for (int half = 0; half < 2; ++half)
    for (int k = 0; k < 4; ++k) {
      out[8 * half + 2 * k] = static_cast<int16_t>(part[8 * half + k]);
      out[8 * half + 2 * k + 1] = static_cast<int16_t>(part[8 * half + 4 + k]);
    }
}

// The 16 sums of 16 activations of a super-block's 256 (xs), each times -32, as int32 in order
// (Q6KX8's accumulator start under kDotFused). VNNI: four 512-bit vpdpbusd against ones give
// the 4-input sums (dword 4L + i of t[j]: inputs 64j + 16L + 4i .. + 3, L the 128-bit lane), two
// rounds of unpack + add the 16-input ones (dword 4L + j of s: group 4j + L), one permute puts
// them in order; AVX2: sums16's int16 widened.
QDOT_FN void neg32_sums16(const int8_t* xs, int32_t* out) {
#if QDOT_HAS_512
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i t[4];
  for (int j = 0; j < 4; ++j)
    t[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(xs + 64 * j));
  // (the zero-masked unpacks with every lane kept: GCC 12's plain ones warn of an undefined
  // source, the same instruction)
  constexpr __mmask16 kAll16 = 0xFFFF;
  constexpr __mmask8 kAll8 = 0xFF;
  const __m512i a = _mm512_add_epi32(_mm512_maskz_unpacklo_epi32(kAll16, t[0], t[1]),
                                     _mm512_maskz_unpackhi_epi32(kAll16, t[0], t[1]));
  const __m512i b = _mm512_add_epi32(_mm512_maskz_unpacklo_epi32(kAll16, t[2], t[3]),
                                     _mm512_maskz_unpackhi_epi32(kAll16, t[2], t[3]));
  const __m512i sum = _mm512_add_epi32(_mm512_maskz_unpacklo_epi64(kAll8, a, b),
                                       _mm512_maskz_unpackhi_epi64(kAll8, a, b));
  // group g is dword 4 * (g % 4) + g / 4
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i g16 = _mm512_maskz_permutexvar_epi32(kAll16, order, sum);
  _mm512_storeu_si512(out, _mm512_sub_epi32(_mm512_setzero_si512(),
                                            _mm512_maskz_slli_epi32(kAll16, g16, 5)));
#else
  alignas(32) int16_t s16[16];
  sums16(xs, s16);
  for (int g = 0; g < 16; ++g) out[g] = -32 * s16[g];
#endif
}

// Q6_K x8: the 4 unsigned 6-bit values (q in 0..63) of inputs 128h + 32k + 4 * i4 + (0..3),
// k < 4, of each row (lane) of super-block ``blk`` (Q6KX8's layout), v[k].
QDOT_FN void q6k_x8_values(const uint8_t* blk, int h, int i4, __m256i low, __m256i top,
                           __m256i* v) {
  const uint8_t* p = blk + 144 + 96 * (8 * h + i4);
  const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
  const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64));
  v[0] = _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_and_si256(_mm256_slli_epi16(hb, 4), top));
  v[1] = _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_and_si256(_mm256_slli_epi16(hb, 2), top));
  v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(hb, top));
  v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                         _mm256_and_si256(_mm256_srli_epi16(hb, 2), top));
}

// Q6_K x8: per super-block the 8 rows' fp16 d (16 bytes), their 16 int8 scales as four 32-byte
// words (word v of row r at 16 + 32v + 4r: scales 4v..4v+3), then for each half h and i4 < 8
// three words at 144 + 96 * (8h + i4): lane r of the first two holds bytes 4 * i4 .. + 3 of row
// r's ql[64h .. 64h + 31] and ql[64h + 32 ..], of the third the same of qh[32h ..]. From them
// the values of inputs 128h + 32k + 4 * i4 + (0..3), k < 4 (qdot.h's Q6_K packing), unsigned
// (q in 0..63); with kDotFused (vpdpbusd) each 16-input group's sum is exact in int32 and
// multiplied by its scale once, else maddubs pair sums are multiplied by the scale (madd) and
// accumulated; 32 * sum_g sc_g * (the 16 inputs' activation sum) is taken off once per
// super-block (with kDotFused: each group's accumulator starts at -32 times that sum instead).
// Both give the same integers, so the same floats.
struct Q6KX8 {
  // 4 tokens a pass in both forms (kDotFused at 3 measured slower for 4 tokens: a 3 + 1 split)
  static constexpr int kMaxTokens = 4;
  static constexpr int kBlockBytes = kQ6KBytes;  // per row and super-block
  // block's s: the super-block's 16-input activation sums (sums16), 16 a token, which x8_run
  // computes once for the groups it runs side by side; under kDotFused (block, not block_pair)
  // those sums times -32 as int32 instead (neg32_sums16: kSumsNeg32), passed as int16_t*
  static constexpr bool kSums16 = true;
  static constexpr bool kSumsNeg32 = kDotFused;
  // Super-block sb of one group (its 8 rows' bytes at blk) added into res[u], u < NT.
  template <int NT>
  __attribute__((target(QDOT_TARGET), always_inline)) static inline void block(
      const uint8_t* blk, const uint8_t* pf, int K, const int8_t* q, const float* d,
      const int16_t* s16, int sb, __m256* res) {
    const int na = K / 32;
    request_unit<kQ6KBytes>(pf);
    if constexpr (kDotFused) {
      block_fused<NT>(blk, K, q, d, reinterpret_cast<const int32_t*>(s16), sb, res);
      return;
    }
    const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    __m256i words[4];
    for (int v = 0; v < 4; ++v)
      words[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * v));
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    __m256i sumi[NT];
    {  // the AVX2 form (block_fused under kDotFused)
      // per token 4 accumulators, one per k; each weight word is unpacked once for the NT
      // tokens. Two i4 steps' maddubs pair sums are added in int16 before the scale's madd: each
      // is at most 2 * 63 * 128 = 16128 in magnitude, so the sum is exact and one multiply in
      // four is saved: one token on one Zen 4 core, rows in cache, 23.5 -> 26.3 GB/s of weights
      // (this path is compute-bound on 2 cores when memory reads fast; VNNI's reads 33)
      // One accumulator a token: the scaled terms of the four k add into it (int32 sums in
      // another order, the same integers). Four a token (16 of AVX2's 16 registers at 4 tokens)
      // spilled: x8_run<Q6KX8, 4, 1> had 207 ymm loads and stores on the stack, now 111. AMD
      // EPYC (Zen 3) VM, one thread, 512 rows in cache, Q6_K time over Q4_K's in the same
      // process (median of 30 pairs; builds alternated, machine shared): 64 tokens x 768 inputs
      // 1.74 -> 1.55x, 32 x 2048 1.90 -> 1.59x.
      for (int u = 0; u < NT; ++u) sumi[u] = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h)
        for (int half = 0; half < 2; ++half) {
          __m256i sc[4];  // scale g = 8h + 2k + half of each row, as two equal int16
          for (int k = 0; k < 4; ++k) {
            const int g = 8 * h + 2 * k + half;
            sc[k] = _mm256_srai_epi16(
                _mm256_shuffle_epi8(words[g / 4], load_ctl(kLaneControls.high[g % 4])), 8);
          }
          if constexpr (NT == 4) {  // the quarter's steps as one loop (qdot_x8_avx2_runs.h)
            q6k_x8_quarter4(blk + 144 + 96 * (8 * h + 4 * half), q + sb * 256 + 128 * h + 16 * half,
                            K, sc, sumi);
            continue;
          }
          for (int i4 = 4 * half; i4 < 4 * half + 4; i4 += 2) {
            __m256i v0[4], v1[4];
            q6k_x8_values(blk, h, i4, low, top, v0);
            q6k_x8_values(blk, h, i4 + 1, low, top, v1);
            for (int k = 0; k < 4; ++k)
              for (int u = 0; u < NT; ++u) {
                const int8_t* xs =
                    q + static_cast<int64_t>(u) * K + sb * 256 + 128 * h + 4 * i4 + 32 * k;
                const __m256i p0 = _mm256_maddubs_epi16(v0[k], bcast32(xs));
                const __m256i p1 = _mm256_maddubs_epi16(v1[k], bcast32(xs + 4));
                const __m256i pairs = _mm256_add_epi16(p0, p1);
                // madd + add, not madd_acc: on Zen 4 vpdpwssd measured slower here (T = 1)
                sumi[u] = _mm256_add_epi32(sumi[u], _mm256_madd_epi16(pairs, sc[k]));
              }
          }
        }
    }
    __m256i scp[8];  // scale pairs (2p, 2p + 1) of each row as int16
    for (int p = 0; p < 8; ++p)
      scp[p] = _mm256_srai_epi16(
          _mm256_shuffle_epi8(words[p / 2], load_ctl(kLaneControls.pair_high[p % 2])), 8);
    for (int u = 0; u < NT; ++u) {
      // 32 * sum_g sc_g * sum16_g: scale pairs (g, g + 1) against the sums' pairs
      __m256i corr = _mm256_setzero_si256();
      for (int p = 0; p < 8; ++p) corr = madd_acc(corr, scp[p], bcast32(s16 + 16 * u + 2 * p));
      const __m256i total = _mm256_sub_epi32(sumi[u], _mm256_slli_epi32(corr, 5));
      res[u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total),
                               _mm256_mul_ps(dw, _mm256_set1_ps(d[u * na + sb * 8])), res[u]);
    }
  }

  // block under kDotFused: vpdpbusd sums each 16-input group (4 i4 steps of 4 inputs) exactly
  // in int32, times its scale once. Each accumulator starts at -32 times its group's activation
  // sum (n32: neg32_sums16, 16 a token), so it ends at sum (q - 32) * x and no correction is
  // taken off afterwards: the same int32 total as the old form (sum_g sc_g * acc_g - 32 * sum_g
  // sc_g * s_g), so the same floats. Each dot takes its activation dword as a broadcast memory
  // operand (dot_acc_b32), the scales are taken from the words in memory as needed, and the
  // values are built with vpternlogd (block_pair's), so the 4-token body holds its 16
  // accumulators, 4 values and 4 sums in registers: the old form (a vpbroadcastd per dot, the
  // scale words held) was compiled with some 350 stack moves a super-block, about 1700
  // instructions in all.
  template <int NT>
  __attribute__((target(QDOT_TARGET), always_inline)) static inline void block_fused(
      const uint8_t* blk, int K, const int8_t* q, const float* d, const int32_t* n32, int sb,
      __m256* res) {
    const int na = K / 32;
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i even = _mm256_set1_epi8(0x33), odd = _mm256_set1_epi8(static_cast<char>(0xCC));
    const int8_t* xu[NT];  // each token's super-block: the dots' addresses are constant offsets
    for (int u = 0; u < NT; ++u) xu[u] = q + static_cast<int64_t>(u) * K + sb * 256;
    __m256i sumi[NT];
    for (int u = 0; u < NT; ++u) sumi[u] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h)
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        __m256i acc[NT][4];
        for (int u = 0; u < NT; ++u)
          for (int k = 0; k < 4; ++k) acc[u][k] = bcast32_load(n32 + 16 * u + 8 * h + 2 * k + half);
#pragma GCC unroll 4
        for (int i4 = 4 * half; i4 < 4 * half + 4; ++i4) {
          __m256i v[4];
          q6k_x8_values_tern(blk + 144 + 96 * (8 * h + i4), low, even, odd, v);
          for (int u = 0; u < NT; ++u)
            for (int k = 0; k < 4; ++k)
              acc[u][k] = dot_acc_b32(acc[u][k], v[k], xu[u] + 128 * h + 4 * i4 + 32 * k);
        }
        for (int k = 0; k < 4; ++k) {
          const int g = 8 * h + 2 * k + half;  // scale g of each row (byte g % 4 of word g / 4)
          const __m256i sc = scale32(blk, g);
          for (int u = 0; u < NT; ++u)
            sumi[u] = _mm256_add_epi32(sumi[u], _mm256_mullo_epi32(acc[u][k], sc));
        }
        // the quarter's sums complete here, before the next quarter's loads: GCC otherwise ran
        // the next quarter's dots first, its 16 accumulators and these in registers at once,
        // and spilled them to the stack
        for (int u = 0; u < NT; ++u) __asm__ volatile("" : "+v"(sumi[u])::"memory");
      }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    for (int u = 0; u < NT; ++u)
      res[u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[u]),
                               _mm256_mul_ps(dw, _mm256_set1_ps(d[u * na + sb * 8])), res[u]);
  }

  // Scale g of each row as an int32: byte g % 4 of the row's scale word g / 4, moved to the
  // top byte and sign extended (two shifts, the word read from memory).
  __attribute__((target(QDOT_TARGET), always_inline)) static inline __m256i scale32(
      const uint8_t* blk, int g) {
    const __m256i word = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * (g / 4)));
    const int up = 8 * (3 - g % 4);
    return _mm256_srai_epi32(up ? _mm256_slli_epi32(word, up) : word, 24);
  }

  // The 4 values v[k] of q6k_x8_values from the three words at p (ql, ql + 32, qh) with
  // vpternlogd (VNNI's AVX-512VL): qh bits (0, 1) and (4, 5) of each byte, and (2, 3) and
  // (6, 7), each shifted so the value's two bits land on bits 4-5 with zeros above, the low
  // four bits picked from the ql word.
  __attribute__((target(QDOT_TARGET), always_inline)) static inline void q6k_x8_values_tern(
      const uint8_t* p, __m256i low, __m256i even, __m256i odd, __m256i* v) {
    constexpr int kPick = 0xE4;  // vpternlogd (a, b, c): c ? a : b, bit by bit
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64));
    const __m256i he = _mm256_and_si256(hb, even), ho = _mm256_and_si256(hb, odd);
    v[0] = _mm256_ternarylogic_epi32(l0, _mm256_slli_epi16(he, 4), low, kPick);
    v[1] = _mm256_ternarylogic_epi32(l1, _mm256_slli_epi16(ho, 2), low, kPick);
    v[2] = _mm256_ternarylogic_epi32(_mm256_srli_epi16(l0, 4), he, low, kPick);
    v[3] = _mm256_ternarylogic_epi32(_mm256_srli_epi16(l1, 4), _mm256_srli_epi16(ho, 2), low,
                                     kPick);
  }

  // The pair kernel's super-block (x8_run with G = 2, NT = 1; VNNI only): super-block sb of
  // the two groups at b[0] and b[1] in one pass, added into res[0] and res[1]. The same
  // integers as block<1> on each: each activation dword is broadcast once for both groups,
  // each 6-bit value assembled by one vpternlogd (bits 0-3 from the ql word, 4-5 from the qh
  // word masked and shifted into place), and nothing but the accumulators is held across the
  // loops; block<1> called for each group in turn was compiled with some 150 stack spills and
  // reloads per super-block (its scale words and broadcasts did not fit the 32 registers).
  static constexpr bool kPairBlock = kDotFused;
  static constexpr int kSbInputs = 256;
  template <int NT>
  __attribute__((target(QDOT_TARGET), always_inline)) static inline void block_pair(
      const uint8_t* const* b, const uint8_t* const* pf, int /*K: sb * 256 indexes q*/,
      const int8_t* q, const float* d, const int16_t* s16, int sb, __m256* const* res) {
    static_assert(NT == 1, "one token a pass");
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i even = _mm256_set1_epi8(0x33), odd = _mm256_set1_epi8(static_cast<char>(0xCC));
    for (int g = 0; g < 2; ++g) request_unit<kQ6KBytes>(pf[g]);
    const int8_t* xq = q + sb * 256;
    __m256i sumi[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int h = 0; h < 2; ++h)
      for (int half = 0; half < 2; ++half) {
        __m256i acc[2][4];
        for (int g = 0; g < 2; ++g)
          for (int k = 0; k < 4; ++k) acc[g][k] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int i4 = 4 * half; i4 < 4 * half + 4; ++i4) {
          __m256i x[4];
          for (int k = 0; k < 4; ++k) x[k] = bcast32(xq + 128 * h + 4 * i4 + 32 * k);
          for (int g = 0; g < 2; ++g) {
            __m256i v[4];
            q6k_x8_values_tern(b[g] + 144 + 96 * (8 * h + i4), low, even, odd, v);
            for (int k = 0; k < 4; ++k) acc[g][k] = dot_acc(acc[g][k], v[k], x[k]);
          }
        }
        for (int g = 0; g < 2; ++g)
          for (int k = 0; k < 4; ++k) {
            const int j = 8 * h + 2 * k + half;  // scale j of each row as an int32
            const __m256i word =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[g] + 16 + 32 * (j / 4)));
            const __m256i sc = _mm256_srai_epi32(
                _mm256_shuffle_epi8(word, load_ctl(kLaneControls.top[j % 4])), 24);
            sumi[g] = _mm256_add_epi32(sumi[g], _mm256_mullo_epi32(acc[g][k], sc));
          }
      }
    const __m256 dx = _mm256_set1_ps(d[sb * 8]);
    for (int g = 0; g < 2; ++g) {
      // 32 * sum_j sc_j * sum16_j, scale pairs (j, j + 1) against the sums' pairs (block's)
      __m256i corr = _mm256_setzero_si256();
      for (int p = 0; p < 8; ++p) {
        const __m256i word =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[g] + 16 + 32 * (p / 2)));
        const __m256i scp = _mm256_srai_epi16(
            _mm256_shuffle_epi8(word, load_ctl(kLaneControls.pair_high[p % 2])), 8);
        corr = madd_acc(corr, scp, bcast32(s16 + 2 * p));
      }
      const __m256i total = _mm256_sub_epi32(sumi[g], _mm256_slli_epi32(corr, 5));
      const __m256 dw =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b[g])));
      *res[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(dw, dx), *res[g]);
    }
  }
};

// 256-bit qdot kernels for the K-quants (super-blocks of 256 inputs): Q4_K and Q5_K (unsigned
// values with a scale and a min per 32 inputs), Q6_K (signed values, a scale per 16 inputs).
// Included by qdot_<isa>.cpp after qdot_simd.h (see there).
//
// The K-quants read activations quantised per 256 inputs (qdot.h's act_group: one scale per
// super-block, read once as d[8 sb]), so a super-block's whole dot product, its sub-block scales
// included, is one exact int32 sum per token: maddubs gives int16 pair sums of value x input and
// madd_acc multiplies them by the 16-bit sub-block scales into int32 lanes, with no float work
// and no horizontal reduction until the super-block's one FMA (llama.cpp's scheme). Bounds:
// pair sums <= 2 * 63 * 127 (Q5_K 31, Q6_K's magnitudes 32: all below 2^15); a super-block's
// sum <= 256 * 63 * 127 * 63 (Q4_K/Q5_K) or 256 * 32 * 127 * 128 (Q6_K): below 2^31.

// The 8 6-bit scales and mins of a Q4_K/Q5_K super-block (packing in qdot.h) as int16 lanes of
// *sc and *m, unpacked in 32-bit words: bytes 0-3 hold sc_0..3 and the top bits of sc_4..7,
// bytes 4-7 m_0..3 and the top bits of m_4..7, bytes 8-11 the low nibbles of sc_4..7 and m_4..7.
QDOT_FN void k_scales16(const uint8_t* p, __m128i* sc, __m128i* m) {
  uint32_t w[3];
  std::memcpy(w, p, sizeof w);
  const uint32_t six = 0x3F3F3F3Fu, top = 0x30303030u, nib = 0x0F0F0F0Fu;
  const uint64_t scs = (w[0] & six) | static_cast<uint64_t>((w[2] & nib) | ((w[0] >> 2) & top)) << 32;
  const uint64_t ms = (w[1] & six) | static_cast<uint64_t>(((w[2] >> 4) & nib) | ((w[1] >> 2) & top)) << 32;
  const __m128i both = _mm_set_epi64x(static_cast<int64_t>(ms), static_cast<int64_t>(scs));
  *sc = _mm_cvtepu8_epi16(both);
  *m = _mm_cvtepu8_epi16(_mm_srli_si128(both, 8));
}

QDOT_FN float hsum4(__m128 v) {
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  v = _mm_add_ss(v, _mm_movehdup_ps(v));
  return _mm_cvtss_f32(v);
}

// Q4_K / Q5_K: per super-block the 256 values are unpacked once into registers in input order
// (sub-block j = 32 values) with each sub-block's scale broadcast to 16 int16 lanes; per token
// the scaled integer sum, and the mins' sum_j m_j * sum_x[j] with one madd.
template <bool kFive>
struct ScaleMin {
  static constexpr int kBytes = kFive ? kQ5KBytes : kQ4KBytes;

  template <int NT>
  __attribute__((target(QDOT_TARGET))) static void run(const uint8_t* w, int K, const int8_t* q,
                                                       const float* d, const int16_t* s, float* y,
                                                       int64_t ldy) {
    const int nsb = K / 256, na = K / 32;
    const __m256i low = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    __m256 acc[NT];
    __m128 macc[NT];
    for (int u = 0; u < NT; ++u) {
      acc[u] = _mm256_setzero_ps();
      macc[u] = _mm_setzero_ps();
    }
    for (int sb = 0; sb < nsb; ++sb) {
      const uint8_t* blk = w + sb * kBytes;
      __m128i sc16, m16;
      k_scales16(blk + 4, &sc16, &m16);
      const __m256i sc2 = _mm256_broadcastsi128_si256(sc16);
      const float dw = fp16s(blk), dmin = fp16s(blk + 2);
      // Q5_K: bit j of qh[i] is the fifth bit of input 32j + i; qh shifts right once per j.
      __m256i qh = kFive ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16))
                         : _mm256_setzero_si256();
      __m256i v[8], scb[8];
      for (int c = 0; c < 4; ++c) {
        const __m256i qv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kBytes - 128 + 32 * c));
        v[2 * c] = _mm256_and_si256(qv, low);
        v[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(qv, 4), low);
        if (kFive) {
          v[2 * c] = _mm256_or_si256(v[2 * c], _mm256_slli_epi16(_mm256_and_si256(qh, one), 4));
          qh = _mm256_srli_epi16(qh, 1);
          v[2 * c + 1] =
              _mm256_or_si256(v[2 * c + 1], _mm256_slli_epi16(_mm256_and_si256(qh, one), 4));
          qh = _mm256_srli_epi16(qh, 1);
        }
      }
      for (int j = 0; j < 8; ++j)  // int16 lane j of sc16 in every lane
        scb[j] = _mm256_shuffle_epi8(sc2, _mm256_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * j)));
      for (int u = 0; u < NT; ++u) {
        const int8_t* xs = q + static_cast<int64_t>(u) * K + sb * 256;
        __m256i part[4];  // independent chains: vpdpwssd's latency would serialise one
        for (int j = 0; j < 8; ++j) {
          const __m256i pairs = _mm256_maddubs_epi16(
              v[j], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + 32 * j)));
          part[j & 3] = j < 4 ? _mm256_madd_epi16(pairs, scb[j]) : madd_acc(part[j & 3], pairs, scb[j]);
        }
        const __m256i sumi = _mm256_add_epi32(_mm256_add_epi32(part[0], part[1]),
                                              _mm256_add_epi32(part[2], part[3]));
        const float dx = d[u * na + sb * 8];
        acc[u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(dw * dx), acc[u]);
        const __m128i sx = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + u * na + sb * 8));
        macc[u] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(sx, m16)), _mm_set1_ps(dmin * dx),
                               macc[u]);
      }
    }
    for (int u = 0; u < NT; ++u) y[u * ldy] = hsum8(acc[u]) - hsum4(macc[u]);
  }
};

// Q6_K: per super-block the signed values q - 32 and their magnitudes are unpacked once, and for
// each 32 inputs j the 16-bit scale vector [sc_2j x 8 | sc_2j+1 x 8]; per token and 32 inputs the
// sign-trick maddubs gives 16 lanes of pair sums that madd_acc multiplies by the scales into the
// super-block's int32 sum.
struct Q6K {
  template <int NT>
  __attribute__((target(QDOT_TARGET))) static void run(const uint8_t* w, int K, const int8_t* q,
                                                       const float* d, const int16_t*, float* y,
                                                       int64_t ldy) {
    const int nsb = K / 256, na = K / 32;
    const __m256i low = _mm256_set1_epi8(0x0F), bits2 = _mm256_set1_epi8(3);
    const __m256i m32 = _mm256_set1_epi8(32);
    // within each 128-bit half: int16 0 (low half) or 1 (high half) of the 32-bit word, x 8
    const __m256i pick = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3,
                                          2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    alignas(32) int8_t val[256];
    alignas(32) uint8_t mag[256];
    __m256 acc[NT];
    for (int u = 0; u < NT; ++u) acc[u] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; ++sb) {
      const uint8_t* blk = w + sb * kQ6KBytes;
      for (int h = 0; h < 2; ++h) {
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
        const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
        const __m256i lows[4] = {_mm256_and_si256(l0, low), _mm256_and_si256(l1, low),
                                 _mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                                 _mm256_and_si256(_mm256_srli_epi16(l1, 4), low)};
        __m256i top = hb;
        for (int k = 0; k < 4; ++k) {
          const __m256i v = _mm256_sub_epi8(
              _mm256_or_si256(lows[k], _mm256_slli_epi16(_mm256_and_si256(top, bits2), 4)), m32);
          top = _mm256_srli_epi16(top, 2);
          _mm256_store_si256(reinterpret_cast<__m256i*>(val + 128 * h + 32 * k), v);
          _mm256_store_si256(reinterpret_cast<__m256i*>(mag + 128 * h + 32 * k),
                             _mm256_abs_epi8(v));
        }
      }
      // int16 scales; 32-bit word j holds sc_2j and sc_2j+1
      const __m256i sc16 = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
      __m256i scv[8];
      for (int j = 0; j < 8; ++j)
        scv[j] = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(sc16, _mm256_set1_epi32(j)), pick);
      const float dw = fp16s(blk + 208);
      for (int u = 0; u < NT; ++u) {
        const int8_t* xs = q + static_cast<int64_t>(u) * K + sb * 256;
        __m256i part[4];  // independent chains, as ScaleMin
        for (int j = 0; j < 8; ++j) {
          const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(val + 32 * j));
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + 32 * j));
          const __m256i pairs = _mm256_maddubs_epi16(
              _mm256_load_si256(reinterpret_cast<const __m256i*>(mag + 32 * j)),
              _mm256_sign_epi8(xv, wv));
          part[j & 3] = j < 4 ? _mm256_madd_epi16(pairs, scv[j]) : madd_acc(part[j & 3], pairs, scv[j]);
        }
        const __m256i sumi = _mm256_add_epi32(_mm256_add_epi32(part[0], part[1]),
                                              _mm256_add_epi32(part[2], part[3]));
        acc[u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi),
                                 _mm256_set1_ps(dw * d[u * na + sb * 8]), acc[u]);
      }
    }
    for (int u = 0; u < NT; ++u) y[u * ldy] = hsum8(acc[u]);
  }
};

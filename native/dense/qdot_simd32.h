// 256-bit qdot kernels for the formats of 32 signed weights per block (Q8_0, Q4_0, Q5_0, MXFP4):
// one kernel over a decoder that turns a block into 32 int8 weights and a float scale. Included
// by qdot_<isa>.cpp after qdot_simd.h (see there).

// Decoders: kBytes per block; values(blk) the 32 signed weights in input order; scale(blk) the
// block scale in every lane.
struct DecodeQ8_0 {
  static constexpr int kBytes = kQ80Bytes;
  QDOT_FN static __m256i values(const uint8_t* blk) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  }
  QDOT_FN static __m256 scale(const uint8_t* blk) { return _mm256_set1_ps(fp16s(blk)); }
};

struct DecodeQ4_0 {
  static constexpr int kBytes = kQ40Bytes;
  QDOT_FN static __m256i values(const uint8_t* blk) {
    return _mm256_sub_epi8(nibbles32(blk + 2), _mm256_set1_epi8(8));
  }
  QDOT_FN static __m256 scale(const uint8_t* blk) { return _mm256_set1_ps(fp16s(blk)); }
};

struct DecodeQ5_0 {
  static constexpr int kBytes = kQ50Bytes;
  // Byte i of the result is 0x10 where bit i of qh is set: byte i / 8 of qh is spread over the
  // 8 bytes of its group, each byte tested against its own bit.
  QDOT_FN static __m256i values(const uint8_t* blk) {
    uint32_t qh;
    std::memcpy(&qh, blk + 2, sizeof qh);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int>(qh)),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                         3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    const __m256i u = _mm256_or_si256(nibbles32(blk + 6),
                                      _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    return _mm256_sub_epi8(u, _mm256_set1_epi8(16));
  }
  QDOT_FN static __m256 scale(const uint8_t* blk) { return _mm256_set1_ps(fp16s(blk)); }
};

struct DecodeMxfp4 {
  static constexpr int kBytes = kMxfp4Bytes;
  QDOT_FN static __m256i values(const uint8_t* blk) {
    const __m256i table = _mm256_broadcastsi128_si256(
        _mm_load_si128(reinterpret_cast<const __m128i*>(kMxfp4Values)));
    return _mm256_shuffle_epi8(table, nibbles32(blk + 1));
  }
  QDOT_FN static __m256 scale(const uint8_t* blk) {  // a broadcast load, no shuffle
    return _mm256_broadcast_ss(&kE8m0Half[blk[0]]);
  }
};

// Per block and token: acc += (d_w * d_x) * (|w| . sign(x, w)), the integer dot in 8 lanes.
template <class Decode>
struct Signed32 {
  template <int NT>
  __attribute__((target(QDOT_TARGET))) static void run(const uint8_t* w, int K, const int8_t* q,
                                                       const float* d, const int16_t*, float* y,
                                                       int64_t ldy) {
    const int nb = K / 32;
    __m256 acc[NT];
    for (int u = 0; u < NT; ++u) acc[u] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      const uint8_t* blk = w + b * Decode::kBytes;
      const __m256i wv = Decode::values(blk);
      const __m256i aw = _mm256_abs_epi8(wv);
      const __m256 dw = Decode::scale(blk);
      for (int u = 0; u < NT; ++u) {
        const __m256i xv = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(q + static_cast<int64_t>(u) * K + b * 32));
        const __m256i p = dot_u8s8(aw, _mm256_sign_epi8(xv, wv));
        const __m256 scale = _mm256_mul_ps(dw, _mm256_broadcast_ss(d + u * nb + b));
        acc[u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[u]);
      }
    }
    for (int u = 0; u < NT; ++u) y[u * ldy] = hsum8(acc[u]);
  }
};

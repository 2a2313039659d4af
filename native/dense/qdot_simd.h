// The 256-bit qdot kernels (qdot.h), written once for the AVX2 and the AVX512-VNNI file. The
// including file defines:
//   QDOT_TARGET  the target attribute string of every function here
//   dot_u8s8(u, s)  8 int32 lanes, each the sum of 4 adjacent products u8 x s8 (maddubs + madd
//                   on AVX2: exact, as |u * s| * 2 stays below 2^15 for the values used here;
//                   vpdpbusd on VNNI)
// and includes this inside its own anonymous namespace (after <immintrin.h> and <cstring>).
//
// Q8_0 weights are signed: |w| as the unsigned operand and x carrying w's sign (the usual sign
// trick; both are in [-127, 127] so nothing saturates). Q4_K nibbles are unsigned already.

#define QDOT_FN __attribute__((target(QDOT_TARGET))) inline

QDOT_FN float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

QDOT_FN int hsum8i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

__attribute__((target(QDOT_TARGET))) void quantize_simd(const float* x, int K, int8_t* q,
                                                        float* d, int16_t* s) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int b = 0; b < K / kQActBlock; ++b) {
    const float* xb = x + b * kQActBlock;
    __m256 v[4];
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      m = _mm256_max_ps(m, _mm256_and_ps(v[i], absmask));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i)
      qi[i] = _mm256_cvtps_epi32(  // current rounding mode: nearest even, as the scalar path
          _mm256_round_ps(_mm256_mul_ps(v[i], vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]),
                                         _mm256_add_epi32(qi[2], qi[3]));
    // int32 -> int8 keeping order: packs interleave 128-bit lanes, the permute restores them.
    const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]);
    const __m256i p16b = _mm256_packs_epi32(qi[2], qi[3]);
    const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    const __m256i ordered =
        _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kQActBlock), ordered);
    d[b] = amax / 127.f;
    s[b] = static_cast<int16_t>(hsum8i(sum));
  }
}

QDOT_FN float fp16s(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);
}

// NT tokens at once against one weight row: each weight block is loaded (and, for Q4_K, its
// nibbles split and scales unpacked) once for NT tokens, with NT independent accumulators.
template <int NT>
__attribute__((target(QDOT_TARGET))) void q8_0_tokens(const uint8_t* w, int K, const int8_t* q,
                                                      const float* d, float* y, int64_t ldy) {
  const int nb = K / 32;
  __m256 acc[NT];
  for (int u = 0; u < NT; ++u) acc[u] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * kQ80Bytes;
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    const __m256i aw = _mm256_sign_epi8(wv, wv);
    const float dw = fp16s(blk);
    for (int u = 0; u < NT; ++u) {
      const __m256i xv =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + static_cast<int64_t>(u) * K + b * 32));
      const __m256i p = dot_u8s8(aw, _mm256_sign_epi8(xv, wv));
      acc[u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * d[u * nb + b]), acc[u]);
    }
  }
  for (int u = 0; u < NT; ++u) y[u * ldy] = hsum8(acc[u]);
}

// Lane j = the sum of the 8 int32 lanes of v[j] (8 sub-block dot products -> one vector).
QDOT_FN __m256i reduce8(const __m256i* v) {
  const __m256i t0 = _mm256_hadd_epi32(v[0], v[1]), t1 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i t2 = _mm256_hadd_epi32(v[4], v[5]), t3 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
  // u0 = [v0..v3 over the low 128 bits | v0..v3 over the high 128 bits], u1 likewise v4..v7
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20),
                          _mm256_permute2x128_si256(u0, u1, 0x31));
}

// Q4_K: per super-block the nibbles are split once into a 256-byte buffer in input order, then
// per token the 8 sub-block dot products are reduced into one vector and scaled with one FMA
// (lane j: d_x[j] * d * sc_j), the mins with another (d_x[j] * dmin * m_j * sum_x[j]).
template <int NT>
__attribute__((target(QDOT_TARGET))) void q4_k_tokens(const uint8_t* w, int K, const int8_t* q,
                                                      const float* d, const int16_t* s, float* y,
                                                      int64_t ldy) {
  const int nsb = K / 256, na = K / 32;
  const __m256i low = _mm256_set1_epi8(0x0F);
  alignas(32) uint8_t nib[256];
  __m256 acc[NT], macc[NT];
  for (int u = 0; u < NT; ++u) acc[u] = macc[u] = _mm256_setzero_ps();
  for (int sb = 0; sb < nsb; ++sb) {
    const uint8_t* blk = w + sb * kQ4KBytes;
    int sc[8], m[8];
    q4k_scales(blk + 4, sc, m);
    const __m256 scv = _mm256_mul_ps(
        _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc))),
        _mm256_set1_ps(fp16s(blk)));
    const __m256 mv = _mm256_mul_ps(
        _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m))),
        _mm256_set1_ps(fp16s(blk + 2)));
    for (int c = 0; c < 4; ++c) {
      const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * c));
      _mm256_store_si256(reinterpret_cast<__m256i*>(nib + 64 * c), _mm256_and_si256(qv, low));
      _mm256_store_si256(reinterpret_cast<__m256i*>(nib + 64 * c + 32),
                         _mm256_and_si256(_mm256_srli_epi16(qv, 4), low));
    }
    for (int u = 0; u < NT; ++u) {
      const int8_t* xs = q + static_cast<int64_t>(u) * K + sb * 256;
      const float* du = d + u * na + sb * 8;
      const int16_t* su = s + u * na + sb * 8;
      __m256i p[8];
      for (int j = 0; j < 8; ++j)
        p[j] = dot_u8s8(_mm256_load_si256(reinterpret_cast<const __m256i*>(nib + 32 * j)),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + 32 * j)));
      const __m256 dx = _mm256_loadu_ps(du);
      acc[u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(p)), _mm256_mul_ps(dx, scv), acc[u]);
      const __m256 sx = _mm256_cvtepi32_ps(
          _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(su))));
      macc[u] = _mm256_fmadd_ps(sx, _mm256_mul_ps(dx, mv), macc[u]);
    }
  }
  for (int u = 0; u < NT; ++u) y[u * ldy] = hsum8(_mm256_sub_ps(acc[u], macc[u]));
}

__attribute__((target(QDOT_TARGET))) void row_q8_0_simd(const uint8_t* w, int K, const int8_t* q,
                                                        const float* d, const int16_t*, int n,
                                                        float* y, int64_t ldy) {
  const int64_t nb = K / 32;
  int t = 0;
  for (; t + 4 <= n; t += 4) q8_0_tokens<4>(w, K, q + t * int64_t{K}, d + t * nb, y + t * ldy, ldy);
  for (; t < n; ++t) q8_0_tokens<1>(w, K, q + t * int64_t{K}, d + t * nb, y + t * ldy, ldy);
}

__attribute__((target(QDOT_TARGET))) void row_q4_k_simd(const uint8_t* w, int K, const int8_t* q,
                                                        const float* d, const int16_t* s, int n,
                                                        float* y, int64_t ldy) {
  const int64_t na = K / 32;
  int t = 0;
  for (; t + 4 <= n; t += 4)
    q4_k_tokens<4>(w, K, q + t * int64_t{K}, d + t * na, s + t * na, y + t * ldy, ldy);
  for (; t < n; ++t)
    q4_k_tokens<1>(w, K, q + t * int64_t{K}, d + t * na, s + t * na, y + t * ldy, ldy);
}

#undef QDOT_FN

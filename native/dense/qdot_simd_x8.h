// 256-bit qdot kernels for K-quant rows interleaved by 8 (qdot.h's Q4_K_X8 layout): one call
// computes 8 weight rows for n tokens, y[t * ldy + r] for r < 8. Included by qdot_<isa>.cpp after
// qdot_simd.h, which also defines
//   dot_acc(acc, u, s)  acc + dot_u8s8(u, s) (one vpdpbusd on VNNI)
//
// With the rows interleaved, each 32-byte load holds 4 consecutive weight bytes of each of the 8
// rows (one row per 32-bit lane), so one activation dword broadcast to every lane gives the 8
// rows' partial sums in their own lanes: no horizontal reduction, no per-row scale shuffles, and
// each activation byte is read once per 8 rows. The integer sums are exact, as the row kernels'.

// The 4 bytes at p as one 32-bit lane in all 8 lanes (a broadcast load).
QDOT_FN __m256i bcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

// vpshufb controls (both 128-bit halves alike): kLaneByte[b] takes byte b of every 32-bit lane
// to the lane's low byte, zeroing the rest (the byte as an int32); kLanePair[h] takes bytes 2h
// and 2h + 1 to the lane's two int16 (zero extended).
struct LaneControls {
  uint8_t byte[4][32];
  uint8_t pair[2][32];
};
constexpr LaneControls make_lane_controls() {
  LaneControls c{};
  for (int i = 0; i < 32; ++i) {
    const int k = (i % 16) / 4, pos = i % 4;
    for (int b = 0; b < 4; ++b) c.byte[b][i] = pos == 0 ? static_cast<uint8_t>(4 * k + b) : 0x80;
    for (int h = 0; h < 2; ++h)
      c.pair[h][i] = pos % 2 == 0 ? static_cast<uint8_t>(4 * k + 2 * h + pos / 2) : 0x80;
  }
  return c;
}
alignas(32) constexpr LaneControls kLaneControls = make_lane_controls();

QDOT_FN __m256i load_ctl(const uint8_t* p) {
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
}

// Weight bytes an interleaved kernel requests ahead of the super-block it computes (2.3, 4 and 8
// KiB measured alike, 2 threads from DRAM; without it the stream reads ~1.3x slower).
constexpr int kX8PrefetchBytes = 4096;

// Q4_K x8: per super-block the 8 rows' fp16 d and dmin (16 bytes each), their packed 6-bit
// scales as three 32-byte words (word w of row r at 32 + 32w + 4r), then the nibbles: vector
// v = 4 * i4 + c (c < 4, the 64-input chunk; i4 < 8) holds, in lane r, bytes 4 * i4 .. 4 * i4 + 3
// of row r's 32 nibble bytes of chunk c: low nibbles are inputs 64c + 4 * i4 + (0..3) (sub-block
// 2c), high nibbles the same + 32 (sub-block 2c + 1).
struct Q4KX8 {
  template <int NT>
  __attribute__((target(QDOT_TARGET))) static void run(const uint8_t* w, int K, const int8_t* q,
                                                       const float* d, const int16_t* s, float* y,
                                                       int64_t ldy) {
    const int nsb = K / 256, na = K / 32;
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i six = _mm256_set1_epi32(0x3F3F3F3F), top = _mm256_set1_epi32(0x30303030);
    __m256 res[NT];
    for (int u = 0; u < NT; ++u) res[u] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; ++sb) {
      const uint8_t* blk = w + sb * 8 * kQ4KBytes;
      const uint8_t* qs = blk + 128;
      // the stream kX8PrefetchBytes ahead, a super-block's worth of lines per super-block (the
      // callers do not prefetch interleaved rows: a group's burst of lines would stall the core)
      for (int i = 0; i < 8 * kQ4KBytes; i += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + kX8PrefetchBytes + i), _MM_HINT_T0);
      for (int u = 0; u < NT; ++u) {
        const int8_t* xs = q + static_cast<int64_t>(u) * K + sb * 256;
        __m256i acc[8];
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_si256();
        for (int i4 = 0; i4 < 8; ++i4)
          for (int c = 0; c < 4; ++c) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (4 * i4 + c)));
            acc[2 * c] = dot_acc(acc[2 * c], _mm256_and_si256(v, low), bcast32(xs + 64 * c + 4 * i4));
            acc[2 * c + 1] = dot_acc(acc[2 * c + 1], _mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                     bcast32(xs + 64 * c + 32 + 4 * i4));
          }
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64));
        const __m256i w2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 96));
        // bytes sc_0..3 | sc_4..7 | m_0..3 | m_4..7 of each row (qdot.h's packing)
        const __m256i sclo = _mm256_and_si256(w0, six);
        const __m256i schi = _mm256_or_si256(_mm256_and_si256(w2, low),
                                             _mm256_and_si256(_mm256_srli_epi32(w0, 2), top));
        const __m256i mlo = _mm256_and_si256(w1, six);
        const __m256i mhi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w2, 4), low),
                                            _mm256_and_si256(_mm256_srli_epi32(w1, 2), top));
        __m256i sumi = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
          const int b = j & 3;  // byte b of each lane, zero extended
          const __m256i sc = _mm256_shuffle_epi8(j < 4 ? sclo : schi, load_ctl(kLaneControls.byte[b]));
          sumi = _mm256_add_epi32(sumi, _mm256_mullo_epi32(acc[j], sc));
        }
        // sum_j m_j * (sum of the activations of sub-block j), two sub-blocks a madd
        const int16_t* su = s + u * na + sb * 8;
        __m256i mins = _mm256_setzero_si256();
        for (int p = 0; p < 4; ++p) {
          mins = madd_acc(mins, _mm256_shuffle_epi8(p < 2 ? mlo : mhi, load_ctl(kLaneControls.pair[p & 1])),
                          bcast32(su + 2 * p));
        }
        const __m256 dx = _mm256_set1_ps(d[u * na + sb * 8]);
        const __m256 dw = _mm256_mul_ps(
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk))), dx);
        const __m256 dm = _mm256_mul_ps(
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16))), dx);
        res[u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), dw, res[u]);
        res[u] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), dm, res[u]);
      }
    }
    for (int u = 0; u < NT; ++u) _mm256_storeu_ps(y + u * ldy, res[u]);  // lane r: row r
  }
};

template <class Kernel>
__attribute__((target(QDOT_TARGET))) void group_simd(const uint8_t* w, int K, const int8_t* q,
                                                     const float* d, const int16_t* s, int n,
                                                     float* y, int64_t ldy) {
  const int64_t na = K / kQActBlock;
  int t = 0;
  for (; t + 2 <= n; t += 2)
    Kernel::template run<2>(w, K, q + t * int64_t{K}, d + t * na, s + t * na, y + t * ldy, ldy);
  if (t < n) Kernel::template run<1>(w, K, q + t * int64_t{K}, d + t * na, s + t * na, y + t * ldy, ldy);
}

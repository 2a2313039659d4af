// The 256-bit qdot kernels (qdot.h), written once for the AVX2 and the AVX512-VNNI file: the shared
// helpers and the activation quantisation here, the weight formats in qdot_simd32.h (blocks of 32
// signed weights: Q8_0, Q4_0, Q5_0, MXFP4) and qdot_simd_k.h (K-quants). The including file
// defines:
//   QDOT_TARGET  the target attribute string of every function here
//   dot_u8s8(u, s)  8 int32 lanes, each the sum of 4 adjacent products u8 x s8 (maddubs + madd
//                   on AVX2: exact, as |u * s| * 2 stays below 2^15 for the values used here;
//                   vpdpbusd on VNNI)
//   madd_acc(acc, a, b)  acc + the int32 pair sums of the int16 products a x b (madd + add on
//                   AVX2, vpdpwssd on VNNI)
//   dot_acc(acc, u, s)  acc + dot_u8s8(u, s)
//   dot_acc_b32(acc, u, p)  dot_acc(acc, u, the 4 bytes at p in every lane) (one vpdpbusd with
//                   a broadcast memory operand on VNNI)
//   bcast32_load(p)  the int32 at p in every lane, read from memory (an asm load on VNNI)
//   QDOT_HAS_512 1 where 512-bit AVX-512 instructions may be used (VNNI), else 0
//   kDotFused    constexpr bool: dot_acc is one instruction (VNNI), so a kernel may sum longer
//                in int32 before it scales (the Q6_K x8 kernel does)
// and includes the three inside its own anonymous namespace (after <immintrin.h> and <cstring>).
//
// Signed weights: |w| as the unsigned operand and x carrying w's sign (the usual sign trick; both
// are in [-127, 127] so nothing saturates). Q4_K/Q5_K values are unsigned already.
//
// A format's kernel is a struct with `template <int NT> static void run(w, K, q, d, s, y, ldy)`:
// NT tokens at once against one weight row, each weight block loaded (and unpacked) once for the
// NT tokens, with NT independent accumulators; row_simd<Kernel> is its QRowFn.

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

__attribute__((target(QDOT_TARGET))) void quantize_simd(const float* x, int K, int group,
                                                        int8_t* q, float* d, int16_t* s) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int g = 0; g < K / group; ++g) {
    const float* xg = x + g * group;
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < group; i += 8)
      m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(xg + i), absmask));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    const float scale = group == kQActBlock ? act_scale32(amax) : (amax > 0.f ? 1.f / inv : 0.f);
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int b = g * group / kQActBlock; b < (g + 1) * group / kQActBlock; ++b) {
      const float* xb = x + b * kQActBlock;
      __m256i qi[4];
      for (int i = 0; i < 4; ++i)
        qi[i] = _mm256_cvtps_epi32(  // current rounding mode: nearest even, as the scalar path
            _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * i), vinv),
                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]),
                                           _mm256_add_epi32(qi[2], qi[3]));
      // int32 -> int8 keeping order: packs interleave 128-bit lanes, the permute restores them.
      const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]);
      const __m256i p16b = _mm256_packs_epi32(qi[2], qi[3]);
      const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
      const __m256i ordered =
          _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kQActBlock), ordered);
      d[b] = scale;
      s[b] = static_cast<int16_t>(hsum8i(sum));
    }
  }
}

QDOT_FN float fp16s(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);
}

// The 32 nibbles of 16 bytes in input order: low nibbles (inputs 0-15), then high (16-31). The
// bytes are broadcast to both halves by the load itself and the high half shifted by 4 with a
// per-lane shift, keeping the shuffle port free for the decoders' table lookups.
QDOT_FN __m256i nibbles32(const uint8_t* p) {
  const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i shifted = _mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
  return _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F));
}

template <class Kernel>
__attribute__((target(QDOT_TARGET))) void row_simd(const uint8_t* w, int K, const int8_t* q,
                                                   const float* d, const int16_t* s, int n,
                                                   float* y, int64_t ldy) {
  const int64_t na = K / kQActBlock;
  int t = 0;
  for (; t + 4 <= n; t += 4)
    Kernel::template run<4>(w, K, q + t * int64_t{K}, d + t * na, s + t * na, y + t * ldy, ldy);
  // The rest in one pass too: prefill routes an expert a few tokens (Qwen3-30B-A3B, 32 tokens:
  // about 2 per expert), and a pass per token would unpack every weight block again.
  const int64_t o = t;
  const int8_t* qt = q + o * K;
  if (n - t == 3) Kernel::template run<3>(w, K, qt, d + o * na, s + o * na, y + o * ldy, ldy);
  if (n - t == 2) Kernel::template run<2>(w, K, qt, d + o * na, s + o * na, y + o * ldy, ldy);
  if (n - t == 1) Kernel::template run<1>(w, K, qt, d + o * na, s + o * na, y + o * ldy, ldy);
}

// The inner loops of the AVX2 K-quant x8 kernels at 4 tokens a pass (qdot_simd_x8_kquant.h:
// Q4_K's wide_pairs16, Q6_K's block), as fixed instruction sequences: each weight word is
// loaded and unpacked once for the 4 tokens and every accumulator is added to in its own
// register. Written as intrinsics, GCC 12 kept each int16 accumulator in a second register and
// copied it back every step, spilled one and reloaded the nibble mask: Q4_K's loop took 43
// instructions per weight word and 4 tokens (7 register copies, 2 stack accesses), this one 32;
// Q6_K's took 177 per two steps (26 stack accesses: products and scaled sums), this one 156
// (none). At 4 tokens the front end, not the multiply ports, set the pace (Zen 3). AMD EPYC
// (Zen 3) VM, shared, one thread, 256 rows of 2048 in cache, 4 tokens, builds alternated (3
// processes each, the minimum of 40 timings of the qlinear call): Q4_K 38.6 -> 34.5 us, Q6_K
// 55.2 -> 50.8 us; one token unchanged. The same instructions on the same values as the
// intrinsics (maddubs pair sums added in int16, a madd by the scale, int32 adds), so the same
// integers: the callers' float steps are unchanged, each row's result the same bits. Included
// by qdot_simd_x8.h (only the kernels without kDotFused call them). Each asm reads the weights
// and activations through its pointers ("memory").

// One token's maddubs step: the 4 activation bytes at `mem` in every lane against value word
// `w`, added (int16) into accumulator `acc`; %[t] is scratch.
#define FT_X8_MADDUBS_ADD(mem, w, acc) \
  "vpbroadcastd " mem ", %[t]\n\t"      \
  "vpmaddubsw %[t], %[" w "], %[t]\n\t" \
  "vpaddw %[t], %[" acc "], %[" acc "]\n\t"

// Q4_K x8, chunk c of a super-block for 4 tokens: its 8 steps i4 (nibble word 4 * i4 + c at
// w + 128 * i4; token u's activations of the chunk at x + u * K: low nibbles against bytes
// 4 * i4 .. + 3, high ones against the same + 32) into acc[u][0] (low) and acc[u][1] (high),
// int16 pair sums (the caller keeps them below 2^15).
__attribute__((target(QDOT_TARGET), always_inline)) inline void q4k_x8_chunk4(
    const uint8_t* w, const int8_t* x, int64_t K, __m256i (&acc)[4][2]) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const int64_t k3 = 3 * K;
  __m256i lo, hi, t;
  int n;
  asm("mov $8, %k[n]\n"
      "1:\n\t"
      "vmovdqu (%[w]), %[lo]\n\t"
      "vpsrlw $4, %[lo], %[hi]\n\t"
      "vpand %[low], %[lo], %[lo]\n\t"
      "vpand %[low], %[hi], %[hi]\n\t"  //
      FT_X8_MADDUBS_ADD("(%[x])", "lo", "a00")           //
      FT_X8_MADDUBS_ADD("32(%[x])", "hi", "a01")         //
      FT_X8_MADDUBS_ADD("(%[x],%[K])", "lo", "a10")      //
      FT_X8_MADDUBS_ADD("32(%[x],%[K])", "hi", "a11")    //
      FT_X8_MADDUBS_ADD("(%[x],%[K],2)", "lo", "a20")    //
      FT_X8_MADDUBS_ADD("32(%[x],%[K],2)", "hi", "a21")  //
      FT_X8_MADDUBS_ADD("(%[x],%[K3])", "lo", "a30")     //
      FT_X8_MADDUBS_ADD("32(%[x],%[K3])", "hi", "a31")   //
      "add $128, %[w]\n\t"
      "add $4, %[x]\n\t"
      "dec %k[n]\n\t"
      "jnz 1b"
      : [a00] "+x"(acc[0][0]), [a01] "+x"(acc[0][1]), [a10] "+x"(acc[1][0]),
        [a11] "+x"(acc[1][1]), [a20] "+x"(acc[2][0]), [a21] "+x"(acc[2][1]),
        [a30] "+x"(acc[3][0]), [a31] "+x"(acc[3][1]), [w] "+r"(w), [x] "+r"(x), [n] "=&r"(n),
        [lo] "=&x"(lo), [hi] "=&x"(hi), [t] "=&x"(t)
      : [K] "r"(K), [K3] "r"(k3), [low] "x"(low)
      : "memory", "cc");
}

// One token's two steps of value index k: the activation dwords at `mem` and `mem` + 4 against
// the steps' value words v0 and v1, their int16 sum times the scale word at `sc` (madd), added
// into `acc` (int32); %[t0] and %[t1] are scratch.
#define FT_X8_PAIRS_MADD(mem, mem4, sc, acc) \
  "vpbroadcastd " mem ", %[t0]\n\t"          \
  "vpbroadcastd " mem4 ", %[t1]\n\t"         \
  "vpmaddubsw %[t0], %[v0], %[t0]\n\t"       \
  "vpmaddubsw %[t1], %[v1], %[t1]\n\t"       \
  "vpaddw %[t1], %[t0], %[t0]\n\t"           \
  "vpmaddwd " sc ", %[t0], %[t0]\n\t"        \
  "vpaddd %[t0], %[" acc "], %[" acc "]\n\t"

// The 4 tokens of FT_X8_PAIRS_MADD for value index k (activations 32k on, scale word k).
#define FT_X8_PAIRS_MADD4(k)                                                                \
  FT_X8_PAIRS_MADD(#k "*32(%[x])", #k "*32+4(%[x])", #k "*32(%[sc])", "s0")                \
  FT_X8_PAIRS_MADD(#k "*32(%[x],%[K])", #k "*32+4(%[x],%[K])", #k "*32(%[sc])", "s1")      \
  FT_X8_PAIRS_MADD(#k "*32(%[x],%[K],2)", #k "*32+4(%[x],%[K],2)", #k "*32(%[sc])", "s2")  \
  FT_X8_PAIRS_MADD(#k "*32(%[x],%[K3])", #k "*32+4(%[x],%[K3])", #k "*32(%[sc])", "s3")

// Q6_K x8, one quarter (h, half) of a super-block for 4 tokens: its steps i4 = 4 * half .. + 3
// two at a time (step j's ql words at p + 96 j and + 32, its qh word at + 64; token u's
// activations of the step's inputs 32k + 4 * j .. + 3 at x + u * K + 32k + 4j), value index k
// of two steps against scale word sc[k] (each row's scale in both int16 of its lane), into
// sumi[u] (int32). The values as q6k_x8_values forms them: bits 0-3 from the ql nibble, 4-5
// from the qh byte's bits 2k, 2k + 1.
__attribute__((target(QDOT_TARGET), always_inline)) inline void q6k_x8_quarter4(
    const uint8_t* p, const int8_t* x, int64_t K, const __m256i* sc, __m256i (&sumi)[4]) {
  const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  const int64_t k3 = 3 * K;
  __m256i hb0, hb1, v0, v1, tmp, t0, t1;
  int n;
  asm("mov $2, %k[n]\n"
      "1:\n\t"
      "vmovdqu 64(%[p]), %[hb0]\n\t"
      "vmovdqu 160(%[p]), %[hb1]\n\t"
      // k = 0: the low nibbles of the first ql word, qh bits 0-1 (shifted left 4)
      "vpsllw $4, %[hb0], %[v0]\n\t"
      "vpand %[top], %[v0], %[v0]\n\t"
      "vpand (%[p]), %[low], %[tmp]\n\t"
      "vpor %[tmp], %[v0], %[v0]\n\t"
      "vpsllw $4, %[hb1], %[v1]\n\t"
      "vpand %[top], %[v1], %[v1]\n\t"
      "vpand 96(%[p]), %[low], %[tmp]\n\t"
      "vpor %[tmp], %[v1], %[v1]\n\t"  //
      FT_X8_PAIRS_MADD4(0)
      // k = 1: the low nibbles of the second ql word, qh bits 2-3 (shifted left 2)
      "vpsllw $2, %[hb0], %[v0]\n\t"
      "vpand %[top], %[v0], %[v0]\n\t"
      "vpand 32(%[p]), %[low], %[tmp]\n\t"
      "vpor %[tmp], %[v0], %[v0]\n\t"
      "vpsllw $2, %[hb1], %[v1]\n\t"
      "vpand %[top], %[v1], %[v1]\n\t"
      "vpand 128(%[p]), %[low], %[tmp]\n\t"
      "vpor %[tmp], %[v1], %[v1]\n\t"  //
      FT_X8_PAIRS_MADD4(1)
      // k = 2: the high nibbles of the first ql word, qh bits 4-5 in place
      "vmovdqu (%[p]), %[tmp]\n\t"
      "vpsrlw $4, %[tmp], %[tmp]\n\t"
      "vpand %[low], %[tmp], %[tmp]\n\t"
      "vpand %[top], %[hb0], %[v0]\n\t"
      "vpor %[tmp], %[v0], %[v0]\n\t"
      "vmovdqu 96(%[p]), %[tmp]\n\t"
      "vpsrlw $4, %[tmp], %[tmp]\n\t"
      "vpand %[low], %[tmp], %[tmp]\n\t"
      "vpand %[top], %[hb1], %[v1]\n\t"
      "vpor %[tmp], %[v1], %[v1]\n\t"  //
      FT_X8_PAIRS_MADD4(2)
      // k = 3: the high nibbles of the second ql word, qh bits 6-7 (shifted right 2)
      "vmovdqu 32(%[p]), %[tmp]\n\t"
      "vpsrlw $4, %[tmp], %[tmp]\n\t"
      "vpand %[low], %[tmp], %[tmp]\n\t"
      "vpsrlw $2, %[hb0], %[v0]\n\t"
      "vpand %[top], %[v0], %[v0]\n\t"
      "vpor %[tmp], %[v0], %[v0]\n\t"
      "vmovdqu 128(%[p]), %[tmp]\n\t"
      "vpsrlw $4, %[tmp], %[tmp]\n\t"
      "vpand %[low], %[tmp], %[tmp]\n\t"
      "vpsrlw $2, %[hb1], %[v1]\n\t"
      "vpand %[top], %[v1], %[v1]\n\t"
      "vpor %[tmp], %[v1], %[v1]\n\t"  //
      FT_X8_PAIRS_MADD4(3)
      "add $192, %[p]\n\t"
      "add $8, %[x]\n\t"
      "dec %k[n]\n\t"
      "jnz 1b"
      : [s0] "+x"(sumi[0]), [s1] "+x"(sumi[1]), [s2] "+x"(sumi[2]), [s3] "+x"(sumi[3]),
        [p] "+r"(p), [x] "+r"(x), [n] "=&r"(n), [hb0] "=&x"(hb0), [hb1] "=&x"(hb1),
        [v0] "=&x"(v0), [v1] "=&x"(v1), [tmp] "=&x"(tmp), [t0] "=&x"(t0), [t1] "=&x"(t1)
      : [K] "r"(K), [K3] "r"(k3), [sc] "r"(sc), [low] "x"(low), [top] "x"(top)
      : "memory", "cc");
}

#undef FT_X8_PAIRS_MADD4
#undef FT_X8_PAIRS_MADD
#undef FT_X8_MADDUBS_ADD

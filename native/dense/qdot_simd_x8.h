// 256-bit qdot kernels for K-quant, MXFP4 and Q8_0 rows interleaved by 8 (qdot.h's Q4_K_X8,
// Q5_K_X8, Q6_K_X8, MXFP4_X8, Q8_0_X8): one call computes 8 weight rows for n tokens,
// y[t * ldy + r] for r < 8. Included by qdot_<isa>.cpp after qdot_simd.h, which also defines
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

// vpshufb controls (both 128-bit halves alike), per 32-bit lane: byte[b] takes the lane's byte
// b to its low byte, zeroing the rest (the byte as an int32); pair[h] its bytes 2h and 2h + 1 to
// the low bytes of its two int16 (zero extended); high[b] byte b to the high bytes of both
// int16, and pair_high[h] bytes 2h and 2h + 1 to them (an arithmetic shift by 8 then sign
// extends: Q6_K's signed scales); top[b] byte b to the lane's top byte (a shift by 24 then
// sign extends it to an int32).
struct LaneControls {
  uint8_t byte[4][32];
  uint8_t pair[2][32];
  uint8_t high[4][32];
  uint8_t pair_high[2][32];
  uint8_t top[4][32];
};
constexpr LaneControls make_lane_controls() {
  LaneControls c{};
  for (int i = 0; i < 32; ++i) {
    const int k = (i % 16) / 4, pos = i % 4;
    const auto at = [k](int b) { return static_cast<uint8_t>(4 * k + b); };
    for (int b = 0; b < 4; ++b) {
      c.byte[b][i] = pos == 0 ? at(b) : 0x80;
      c.high[b][i] = pos % 2 == 1 ? at(b) : 0x80;
      c.top[b][i] = pos == 3 ? at(b) : 0x80;
    }
    for (int h = 0; h < 2; ++h) {
      c.pair[h][i] = pos % 2 == 0 ? at(2 * h + pos / 2) : 0x80;
      c.pair_high[h][i] = pos % 2 == 1 ? at(2 * h + pos / 2) : 0x80;
    }
  }
  return c;
}
alignas(32) constexpr LaneControls kLaneControls = make_lane_controls();

QDOT_FN __m256i load_ctl(const uint8_t* p) {
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
}

// Bit j (j < 8, a constant once unrolled) of each byte moved to bit 4 by a 16-bit shift; the
// caller masks bit 4 (bits shifted across the byte boundary land elsewhere for j in 0..7).
QDOT_FN __m256i shift_bit_to_4(__m256i v, int j) {
  return j <= 4 ? _mm256_slli_epi16(v, 4 - j) : _mm256_srli_epi16(v, j - 4);
}

// An interleaved kernel's caller (x8_run) requests its weight bytes row_tasks.h's kX8AheadBytes
// ahead, into L2, a super-block's lines for each super-block a group computes (2 threads from
// DRAM: Q4_K at 1.2-1.3x the plain kernel's rate; when the callers prefetched whole groups
// instead, the burst stalled the core and it read at 0.87x; the callers prefetch only a
// stream's first lines); ``block`` requests the lines at ``pf`` (none if null): request_unit.

// The lines of one unit of the 8 rows (kRowBytes bytes a row) at pf requested; none if pf is null.
template <int kRowBytes>
__attribute__((target(QDOT_TARGET), always_inline)) inline void request_unit(const uint8_t* pf) {
  if (pf != nullptr)
    for (int i = 0; i < 8 * kRowBytes; i += 64) prefetch_ahead(pf + i);
}

#include "qdot_x8_avx2_runs.h"
#include "qdot_simd_x8_kquant.h"
#include "qdot_simd_x8_block32.h"

// An interleaved kernel over K inputs for NT tokens and G adjacent groups (8G rows, the groups'
// bytes one after the other; G = 2 with NT = 1: pair_simd), super-block by super-block, the
// groups' streams side by side: y[u * ldy + 8g + r] is row r of group g.
template <class Kernel, int NT, int G>
__attribute__((target(QDOT_TARGET))) void x8_run(const uint8_t* w, int K, const int8_t* q,
                                                 const float* d, const int16_t* s, float* y,
                                                 int64_t ldy) {
  const int nsb = K / Kernel::kSbInputs;
  constexpr int64_t kSbBytes = 8 * Kernel::kBlockBytes;  // a group's super-block (unit)
  const int64_t gstride = nsb * kSbBytes;
  // The G groups' bytes (one region) are requested as one linear stream kX8AheadBytes ahead,
  // at the rate they are read: G super-blocks' lines per super-block (row_tasks.h), past the
  // stream's end where the caller says (X8Stream).
  const X8Stream stream = tl_x8_stream;
  const uintptr_t w0 = reinterpret_cast<uintptr_t>(w) + kX8AheadBytes;
  __m256 res[G][NT];
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < NT; ++u) res[g][u] = _mm256_setzero_ps();
  for (int sb = 0; sb < nsb; ++sb) {
    constexpr bool kPair = G == 2 && NT == 1 && Kernel::kPairBlock;
    // (Kernel::kSums16) once for the G groups: block_pair's int16 sums, or block's sums times
    // -32 as int32 where Kernel::kSumsNeg32
    alignas(64) int16_t s16[NT][16];
    alignas(64) int32_t n32[NT][16];
    const int16_t* sk = s;
    if constexpr (Kernel::kSums16) {
      if constexpr (!kPair && Kernel::kSumsNeg32) {
        for (int u = 0; u < NT; ++u) neg32_sums16(q + u * int64_t{K} + sb * 256, n32[u]);
        sk = reinterpret_cast<const int16_t*>(&n32[0][0]);  // (block reads int32)
      } else {
        for (int u = 0; u < NT; ++u) sums16(q + u * int64_t{K} + sb * 256, s16[u]);
        sk = &s16[0][0];
      }
    }
    if constexpr (kPair) {
      const uint8_t* blks[2] = {w + sb * kSbBytes, w + gstride + sb * kSbBytes};
      const uint8_t* pfs[2];
      __m256* outs[2] = {res[0], res[1]};
      for (int g = 0; g < 2; ++g)
        pfs[g] = reinterpret_cast<const uint8_t*>(
            x8_request(stream, w0 + (sb * G + g) * kSbBytes));
      Kernel::template block_pair<NT>(blks, pfs, K, q, d, sk, sb, outs);
    } else {
#pragma GCC unroll 2
      for (int g = 0; g < G; ++g) {
        const uintptr_t pf = x8_request(stream, w0 + (sb * G + g) * kSbBytes);
        Kernel::template block<NT>(w + g * gstride + sb * kSbBytes,
                                   reinterpret_cast<const uint8_t*>(pf), K, q, d, sk, sb, res[g]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < NT; ++u) _mm256_storeu_ps(y + u * ldy + 8 * g, res[g][u]);
}

// The last r < kMaxTokens tokens in one pass (x8_run with NT = r, r <= R).
template <class Kernel, int R>
__attribute__((target(QDOT_TARGET))) void group_rest(int r, const uint8_t* w, int K,
                                                     const int8_t* q, const float* d,
                                                     const int16_t* s, float* y, int64_t ldy) {
  if constexpr (R >= 1) {
    if (r == R) x8_run<Kernel, R, 1>(w, K, q, d, s, y, ldy);
    else group_rest<Kernel, R - 1>(r, w, K, q, d, s, y, ldy);
  }
}

// Kernel::kMaxTokens tokens a pass while they last (each weight word unpacked once for them),
// then the rest in one pass.
template <class Kernel>
__attribute__((target(QDOT_TARGET))) void group_simd(const uint8_t* w, int K, const int8_t* q,
                                                     const float* d, const int16_t* s, int n,
                                                     float* y, int64_t ldy) {
  constexpr int kMax = Kernel::kMaxTokens;
  const int64_t na = K / kQActBlock;
  int t = 0;
  for (; t + kMax <= n; t += kMax)
    x8_run<Kernel, kMax, 1>(w, K, q + t * int64_t{K}, d + t * na, s + t * na, y + t * ldy, ldy);
  const int64_t o = t;
  group_rest<Kernel, kMax - 1>(n - t, w, K, q + o * K, d + o * na, s + o * na, y + o * ldy, ldy);
}

// Two adjacent groups (16 rows: the second group's bytes follow the first's) for n tokens, one
// at a time: the two groups' streams are read side by side. One core reads a single sequential
// stream at about 10 GB/s from DRAM (Sapphire Rapids: a bf16 gemv of 8 streams reads at the
// core's full rate); two streams measured 1.13x that for Q4_K on 1 thread, and decode of the
// Q4_K_M benchmark file (2 threads) went from 15.9 to 14.1 ms/token, its Q6_K lm_head from 5.0
// to 4.1 ms. Two groups' accumulators need the 32 vector registers of AVX-512 (the VNNI set).
// The callers take it in the pair mode only (row_tasks.h's X8Streams: not on AMD CPUs by default,
// where one group a call with no requests read faster).
template <class Kernel>
__attribute__((target(QDOT_TARGET))) void pair_simd(const uint8_t* w, int K, const int8_t* q,
                                                    const float* d, const int16_t* s, int n,
                                                    float* y, int64_t ldy) {
  const int64_t na = K / kQActBlock;
  for (int t = 0; t < n; ++t)
    x8_run<Kernel, 1, 2>(w, K, q + t * int64_t{K}, d + t * na, s + t * na, y + t * ldy, ldy);
}

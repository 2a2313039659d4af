// AVX512-BF16 dot-product kernels (contracts in kernels_bf16dot.h). Compiled with a per-function
// target attribute, like kernels_avx512.cpp, so the build needs no -march flag; the executor and
// the dense path call them only when cpu_features reports avx512_bf16.
//
// gemv: one 64-byte load holds 32 bf16 weights of a row, i.e. 16 pairs, and vdpbf16ps adds each
// pair's two products against the token's matching input pair to one of 16 fp32 sums: one
// instruction per 32 weights and token, where the fp32 path widens (shift, mask) and runs two
// FMAs. tile: a weight pair is broadcast to all 16 lanes (an embedded {1to16} broadcast) and meets
// 16 tokens' input pairs from the panel.
#include <immintrin.h>

#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <cstring>

#include "kernels_bf16dot.h"

#define FT_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))
#define FT_INLINE FT_TARGET __attribute__((always_inline)) inline

namespace ftnative {
namespace {

FT_INLINE __m512 dp(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// R weight rows x TT tokens; row r starts at w + r * rs, its result goes to y[t * ldy + r * ys].
template <int R, int TT>
FT_TARGET void gemv_block(const uint16_t* w, int64_t rs, int k, const uint16_t* const* xs,
                          float* y, int ldy, int ys) {
  __m512 acc[R][TT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  const int kmain = k - k % 32;
  for (int i = 0; i < kmain; i += 32) {
    __m512i xv[TT];
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) xv[t] = _mm512_loadu_si512(xs[t] + i);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i wv = _mm512_loadu_si512(w + r * rs + i);
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) acc[r][t] = dp(acc[r][t], wv, xv[t]);
    }
  }
  if (kmain < k) {  // masked loads: both operands read as 0 past k
    const __mmask32 m = static_cast<__mmask32>((1ull << (k - kmain)) - 1);
    __m512i xv[TT];
    for (int t = 0; t < TT; ++t) xv[t] = _mm512_maskz_loadu_epi16(m, xs[t] + kmain);
    for (int r = 0; r < R; ++r) {
      const __m512i wv = _mm512_maskz_loadu_epi16(m, w + r * rs + kmain);
      for (int t = 0; t < TT; ++t) acc[r][t] = dp(acc[r][t], wv, xv[t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) y[t * ldy + r * ys] = _mm512_reduce_add_ps(acc[r][t]);
}

// As kernels_simd.h's gemv_rows: the R concurrent rows are S rows apart, so each of the R memory
// streams walks S consecutive rows (long sequential streams for the prefetchers), S <= 32.
constexpr int kMaxStreamRows = 32;

template <int R, int TT>
FT_TARGET void gemv_rows(const uint16_t* w, int64_t ldw, int rows, int k,
                         const uint16_t* const* xs, float* y, int ldy) {
  int r0 = 0;
  while (rows - r0 >= R) {
    const int S = (rows - r0) / R < kMaxStreamRows ? (rows - r0) / R : kMaxStreamRows;
    for (int b = 0; b < S; ++b)
      gemv_block<R, TT>(w + (r0 + b) * ldw, S * ldw, k, xs, y + r0 + b, ldy, S);
    r0 += R * S;
  }
  for (int r = r0; r < rows; ++r) gemv_block<1, TT>(w + r * ldw, ldw, k, xs, y + r, ldy, 1);
}

// How far ahead of its reads gemv_seq requests weight lines, into L2 (prefetcht1). The hardware
// prefetchers alone left a bf16 decode step at ~87% of the read bandwidth. Zen 4 VM, 2 threads,
// the bf16 benchmark model's decode (dense projections, experts and lm_head all on gemv_seq),
// distances alternated in one process, medians of 7-10 rounds against none: 2 KiB 1.044x and
// 1.053x (slow-memory spells, ~21 ms/token), 1.023x (fast spell, ~13 ms); 4 KiB 1.048x and
// 1.054x; 16 KiB 1.008x; two streams (halves of the rows in turn, as row_tasks.h's two_streams)
// at 2 KiB 1.046x, no better than one.
constexpr int kSeqAheadBytes = 2048;

// One token, rows in order: one sequential stream, where gemv_rows reads 8 side by side (each
// too short in an expert's task of rows). Measured against gemv_rows<8, 1> on Zen 4, 2 threads,
// from DRAM: the dense projections alone 1.01-1.08x (lm_head, qkv and o sizes), a bf16 decode
// step 0.98-1.04x, then 1.012x and 1.029x over 10 and 16 alternated rounds. Two sums a row, so
// the dot chain is not latency-bound on rows in cache. The stream's first kSeqAheadBytes are
// requested at once (into L1), the rest kSeqAheadBytes ahead as the rows are read: the rows lie
// back to back (every caller passes ldw = k), so the bytes ahead are the next rows'. A task's
// last requests fall past its rows (harmless: a prefetch never faults).
FT_TARGET void gemv_seq(const uint16_t* w, int64_t ldw, int rows, int k, const uint16_t* x,
                        float* y) {
  const int k64 = k - k % 64, k32 = k - k % 32;
  const char* start = reinterpret_cast<const char*>(w);
  for (int b = 0; b < kSeqAheadBytes; b += 64) _mm_prefetch(start + b, _MM_HINT_T0);
  for (int r = 0; r < rows; ++r) {
    const uint16_t* wr = w + r * ldw;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (int i = 0; i < k64; i += 64) {  // 128 bytes of the row: two lines requested ahead
      const char* ahead = reinterpret_cast<const char*>(wr + i) + kSeqAheadBytes;
      _mm_prefetch(ahead, _MM_HINT_T1);
      _mm_prefetch(ahead + 64, _MM_HINT_T1);
      a0 = dp(a0, _mm512_loadu_si512(wr + i), _mm512_loadu_si512(x + i));
      a1 = dp(a1, _mm512_loadu_si512(wr + i + 32), _mm512_loadu_si512(x + i + 32));
    }
    if (k64 < k32) a0 = dp(a0, _mm512_loadu_si512(wr + k64), _mm512_loadu_si512(x + k64));
    if (k32 < k) {
      const __mmask32 m = static_cast<__mmask32>((1ull << (k - k32)) - 1);
      a1 = dp(a1, _mm512_maskz_loadu_epi16(m, wr + k32), _mm512_maskz_loadu_epi16(m, x + k32));
    }
    y[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  }
}

FT_TARGET void gemv(const uint16_t* w, int64_t ldw, int rows, int k, const uint16_t* const* xs,
                    int n, float* y, int ldy) {
  // Up to 4 tokens share each weight load (16 accumulators); a lone token reads rows in order.
  for (int s = 0; s < n;) {
    float* ys = y + static_cast<int64_t>(s) * ldy;
    if (n - s >= 4) {
      gemv_rows<4, 4>(w, ldw, rows, k, xs + s, ys, ldy);
      s += 4;
    } else if (n - s >= 2) {
      gemv_rows<4, 2>(w, ldw, rows, k, xs + s, ys, ldy);
      s += 2;
    } else {
      gemv_seq(w, ldw, rows, k, xs[s], ys);
      s += 1;
    }
  }
}

// R rows x NB 16-token blocks: y[(b * rows + r) * 16 + lane] for the NB blocks from b0.
template <int R, int NB>
FT_TARGET void tile_block(const uint16_t* w, int64_t ldw, int rows, int k, const uint16_t* xp,
                          int64_t block, float* y) {
  __m512 acc[R][NB];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  const int kp = k / 2;  // full pairs
  for (int p = 0; p < kp; ++p) {
    __m512i xv[NB];
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) xv[b] = _mm512_loadu_si512(xp + b * block + p * 2 * kTileLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, w + r * ldw + 2 * p, sizeof pair);
      const __m512i wv = _mm512_set1_epi32(pair);
#pragma GCC unroll 2
      for (int b = 0; b < NB; ++b) acc[r][b] = dp(acc[r][b], wv, xv[b]);
    }
  }
  if (k & 1) {  // the last pair holds (x[k - 1], 0); pair the weight with 0 as well
    __m512i xv[NB];
    for (int b = 0; b < NB; ++b) xv[b] = _mm512_loadu_si512(xp + b * block + kp * 2 * kTileLanes);
    for (int r = 0; r < R; ++r) {
      const __m512i wv = _mm512_set1_epi32(static_cast<int32_t>(w[r * ldw + k - 1]));
      for (int b = 0; b < NB; ++b) acc[r][b] = dp(acc[r][b], wv, xv[b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b)
      _mm512_storeu_ps(y + (static_cast<int64_t>(b) * rows + r) * kTileLanes, acc[r][b]);
}

constexpr int kTileRows = 8;  // 8 rows x 2 blocks = 16 accumulators

// Rows [r0, r0 + R) for every block; y is the whole [nb][rows][16] output.
template <int R>
FT_TARGET void tile_rows(const uint16_t* w, int64_t ldw, int rows, int r0, int k,
                         const uint16_t* xp, int nb, float* y) {
  const int64_t block = static_cast<int64_t>((k + 1) / 2) * 2 * kTileLanes;
  const uint16_t* wr = w + r0 * ldw;
  float* yr = y + static_cast<int64_t>(r0) * kTileLanes;
  int b = 0;
  for (; b + 2 <= nb; b += 2)
    tile_block<R, 2>(wr, ldw, rows, k, xp + b * block, block,
                     yr + static_cast<int64_t>(b) * rows * kTileLanes);
  if (b < nb)
    tile_block<R, 1>(wr, ldw, rows, k, xp + b * block, block,
                     yr + static_cast<int64_t>(b) * rows * kTileLanes);
}

FT_TARGET void tile(const uint16_t* w, int64_t ldw, int rows, int k, const uint16_t* xp, int nb,
                    float* y) {
  // Rows outer, token blocks inner: the kTileRows weight rows stay in L1 across all blocks.
  int r = 0;
  for (; r + kTileRows <= rows; r += kTileRows) tile_rows<kTileRows>(w, ldw, rows, r, k, xp, nb, y);
  for (; r < rows; ++r) tile_rows<1>(w, ldw, rows, r, k, xp, nb, y);
}

}  // namespace

const Bf16DotSet kAvx512Bf16Dot = {"avx512bf16", gemv, tile};

}  // namespace ftnative

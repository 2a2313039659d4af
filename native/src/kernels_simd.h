// ISA-generic bodies of the SIMD kernels (see kernels.h for what gemv and tile compute).
//
// Included by kernels_avx2.cpp, kernels_avx512.cpp and kernels_emu512.cpp only, inside an
// anonymous namespace, after they define:
//   FT_TARGET  the function attribute carrying the ISA (target("...")),
//   FT_INLINE  FT_TARGET plus always_inline,
//   V          vector traits: T, kLanes, zero, load, store, fma, set1, hsum,
//   kTileRows  weight rows per tile micro-kernel (accumulators = kTileRows * 16 / kLanes),
// and weight policies W (one per bank dtype) with:
//   E                  element type of the bank
//   kChunk             gemv input de-interleave width (0 or 2 * kLanes)
//   load2(w, a, b)     2 * kLanes weights; a multiplies x[i, i+L), b multiplies x[i+L, i+2L)
//                      of the (possibly de-interleaved) input
//   bcast2(w, lo, hi)  w[0] and w[1] broadcast to all lanes
//   scalar(w)          w[0] as fp32
// Everything here has internal linkage, so the per-ISA copies never merge at link time.

#ifndef FT_TARGET
#error "define FT_TARGET, FT_INLINE, V, kTileRows and the weight policies before including"
#endif

constexpr int kVpb = kTileLanes / V::kLanes;  // vectors per 16-token panel block
constexpr int kStep = 2 * V::kLanes;          // gemv inputs consumed per step

// R weight rows x TT tokens of dot products; every weight vector is loaded once and used TT times.
// Row r of the block starts at w + r * rs; its result goes to y[t * ldy + r * ys].
template <class W, int R, int TT>
FT_TARGET void gemv_block(const typename W::E* w, int64_t rs, int k, const float* const* xs,
                          float* y, int ldy, int ys) {
  typename V::T acc[R][TT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) acc[r][t] = V::zero();
  const int kmain = k - k % kStep;
  for (int i = 0; i < kmain; i += kStep) {
    typename V::T xa[TT], xb[TT];
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) {
      xa[t] = V::load(xs[t] + i);
      xb[t] = V::load(xs[t] + i + V::kLanes);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      typename V::T a, b;
      W::load2(w + r * rs + i, a, b);
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) {
        acc[r][t] = V::fma(a, xa[t], acc[r][t]);
        acc[r][t] = V::fma(b, xb[t], acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) {
      float s = V::hsum(acc[r][t]);
      for (int i = kmain; i < k; ++i) s += W::scalar(w + r * rs + i) * xs[t][i];
      y[t * ldy + r * ys] = s;
    }
}

// The R rows computed together are taken S = rows / R apart, so each of the R concurrent memory
// streams walks S consecutive rows: a few long sequential streams keep the hardware prefetchers
// ahead. Measured from DRAM on Zen 3 (bf16, 1 token): 2x over R adjacent rows for 1.5 KiB rows
// (I = 768), 1.3x for 4 KiB rows, and above a plain one-stream read; explicit software
// prefetches were never faster. Streams stay at most kMaxStreamRows apart: far-apart streams
// (~1 MiB) collided in DRAM and ran 3x slower.
constexpr int kMaxStreamRows = 32;

template <class W, int R, int TT>
FT_TARGET void gemv_rows(const typename W::E* w, int64_t ldw, int rows, int k,
                         const float* const* xs, float* y, int ldy) {
  int r0 = 0;
  while (rows - r0 >= R) {
    const int S = (rows - r0) / R < kMaxStreamRows ? (rows - r0) / R : kMaxStreamRows;
    for (int b = 0; b < S; ++b)
      gemv_block<W, R, TT>(w + (r0 + b) * ldw, S * ldw, k, xs, y + r0 + b, ldy, S);
    r0 += R * S;
  }
  for (int r = r0; r < rows; ++r) gemv_block<W, 1, TT>(w + r * ldw, ldw, k, xs, y + r, ldy, 1);
}

template <class W>
FT_TARGET void gemv(const void* wv, int64_t ldw, int rows, int k, const float* const* xs, int n,
                    float* y, int ldy) {
  const typename W::E* w = static_cast<const typename W::E*>(wv);
  // Two tokens share each weight load (R = 4 rows, 8 accumulators); measured on Zen 3, more
  // tokens per pass run out of registers and lose to repeated pairs (the block's weights are
  // re-read from L1/L2, not DRAM). A lone token takes 8 rows at once.
  for (int s = 0; s < n; s += 2) {
    float* ys = y + static_cast<int64_t>(s) * ldy;
    if (n - s >= 2) gemv_rows<W, 4, 2>(w, ldw, rows, k, xs + s, ys, ldy);
    else gemv_rows<W, 8, 1>(w, ldw, rows, k, xs + s, ys, ldy);
  }
}

// R weight rows x one 16-token block; y[r * 16 + lane].
template <class W, int R>
FT_TARGET void tile_block(const typename W::E* w, int64_t ldw, int k, const float* xp, float* y) {
  typename V::T acc[R][kVpb];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < kVpb; ++v) acc[r][v] = V::zero();
  int i = 0;
  for (; i + 2 <= k; i += 2) {  // two inputs per step: bf16 weights come in 32-bit pairs
    const float* p = xp + i * kTileLanes;
    typename V::T x0[kVpb], x1[kVpb];
#pragma GCC unroll 2
    for (int v = 0; v < kVpb; ++v) {
      x0[v] = V::load(p + v * V::kLanes);
      x1[v] = V::load(p + kTileLanes + v * V::kLanes);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      typename V::T lo, hi;
      W::bcast2(w + r * ldw + i, lo, hi);
#pragma GCC unroll 2
      for (int v = 0; v < kVpb; ++v) {
        acc[r][v] = V::fma(lo, x0[v], acc[r][v]);
        acc[r][v] = V::fma(hi, x1[v], acc[r][v]);
      }
    }
  }
  if (i < k) {
    const float* p = xp + i * kTileLanes;
    for (int r = 0; r < R; ++r) {
      const typename V::T wi = V::set1(W::scalar(w + r * ldw + i));
      for (int v = 0; v < kVpb; ++v) acc[r][v] = V::fma(wi, V::load(p + v * V::kLanes), acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVpb; ++v) V::store(y + r * kTileLanes + v * V::kLanes, acc[r][v]);
}

template <class W>
FT_TARGET void tile(const void* wv, int64_t ldw, int rows, int k, const float* xp, int nb,
                    float* y) {
  const typename W::E* w = static_cast<const typename W::E*>(wv);
  const int64_t block = static_cast<int64_t>(k) * kTileLanes;
  // Rows outer, token blocks inner: the kTileRows weight rows stay in L1 across all blocks.
  int r = 0;
  for (; r + kTileRows <= rows; r += kTileRows)
    for (int b = 0; b < nb; ++b)
      tile_block<W, kTileRows>(w + r * ldw, ldw, k, xp + b * block,
                               y + (static_cast<int64_t>(b) * rows + r) * kTileLanes);
  for (; r < rows; ++r)
    for (int b = 0; b < nb; ++b)
      tile_block<W, 1>(w + r * ldw, ldw, k, xp + b * block,
                       y + (static_cast<int64_t>(b) * rows + r) * kTileLanes);
}

// ISA-generic bodies of the quantised SIMD kernels (contract in kernels.h: QGemvFn, QTileFn).
//
// Included by kernels_avx2.cpp, kernels_avx512.cpp and kernels_emu512.cpp after kernels_simd.h
// (it reuses V, WF32, tile_block, kStep and kMaxStreamRows), inside the same anonymous
// namespace; the including file also includes <vector> and quant_decode.h at file scope. Before
// this header it defines V::mul and the decode primitives in struct Q:
//   fp8x2(p, a, b)         2 * kLanes e4m3 bytes -> a, b: their values times 2^-8, in order
//   kFp4In                 inputs per e2m1 step, a multiple of 32 and of 2 * kLanes
//   kFp4Perm               the input layout of a step (QKernelSet::perm; null: even then odd)
//   fp4_step(p, w)         kFp4In / 2 bytes -> kFp4In / kLanes vectors of unscaled e2m1 values,
//                          in layout order
//   fp4_blocks()           accumulators per e2m1 step (each has one scale vector)
//   fp4_blk(v, G)          the accumulator of vector v when scale groups are G inputs
//   fp4_scales(gs, G, sv)  the step's group scales gs[kFp4In / G] -> fp4_blocks() scale vectors
//
// gemv: a scale span (fp8: the 128 inputs of a block; e2m1: one step, whose lanes may belong to
// different groups) is summed unscaled into per-span accumulators, which are then multiplied by
// the span's scale vectors into the row's sum: one multiply per span instead of one per weight
// vector, which is what bounds these kernels (measured on Zen 3: 1.3x for fp8, 1.4x for e2m1).
// tile: kTileRows rows at a time are dequantised into a per-thread buffer in the same input
// layout as the panel and run through the fp32 tile; that decode is shared by every 16-token
// block of the expert.

// Per-format policy: kIn inputs per step decoded into kVec vectors; kSpan inputs per scale span;
// kBlk accumulators per row and token, vector v going to blk(v), each scaled by scales()[blk].
template <QFormat F>
struct QF;

template <>
struct QF<QFormat::Fp8Block> {
  static constexpr QFormat kF = QFormat::Fp8Block;
  static constexpr int kIn = kStep, kVec = 2, kSpan = 128, kBlk = 2;  // 2 chains per row
  static constexpr int kChunk = 0;
  static constexpr const uint8_t* kPerm = nullptr;
  // Rows per gemv block for one token / for a token pair: the per-span accumulators take the
  // registers that the bf16 kernel spends on more rows (measured on Zen 3).
  static constexpr int kRowsSolo = 4, kRowsPair = 1;
  static constexpr int blk(int v) { return v; }
  // 256: fp8x2 yields each value times 2^-8
  FT_INLINE static void scales(const QMat& m, int64_t r, int c, V::T* sv) {
    sv[0] = sv[1] = V::set1(q_scale<kF>(m, r, c) * 256.f);
  }
  FT_INLINE static void decode(const uint8_t* row, int i, V::T* w) {
    Q::fp8x2(row + i, w[0], w[1]);
  }
};

template <QFormat F>
struct QFp4 {
  static constexpr int G = kQGroup<F>;
  static constexpr int kIn = Q::kFp4In, kVec = kIn / V::kLanes, kSpan = kIn;
  static constexpr int kBlk = Q::fp4_blocks();
  static constexpr int kChunk = kIn;
  static constexpr const uint8_t* kPerm = Q::kFp4Perm;
  static constexpr int kRowsSolo = 2, kRowsPair = 1;  // 8 decoded vectors per step
  static constexpr int blk(int v) { return Q::fp4_blk(v, G); }
  FT_INLINE static void scales(const QMat& m, int64_t r, int c, V::T* sv) {
    float gs[kIn / G];
    for (int g = 0; g < kIn / G; ++g)
      gs[g] = F == QFormat::Nvfp4 ? q_scale<F>(m, r, c + g * G) * m.glob
                                  : q_scale<F>(m, r, c + g * G);
    Q::fp4_scales(gs, G, sv);
  }
  FT_INLINE static void decode(const uint8_t* row, int i, V::T* w) { Q::fp4_step(row + i / 2, w); }
};

template <>
struct QF<QFormat::Mxfp4> : QFp4<QFormat::Mxfp4> {};
template <>
struct QF<QFormat::Nvfp4> : QFp4<QFormat::Nvfp4> {};

// R rows (task rows r0, r0 + rs, ..) x TT tokens; y[t * ldy + j * ys] for row j.
template <QFormat F, int R, int TT>
FT_TARGET void qgemv_block(const QMat& m, int64_t r0, int64_t rs, int k, const float* const* xs,
                           float* y, int ldy, int ys) {
  using P = QF<F>;
  typename V::T acc[R][TT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) acc[r][t] = V::zero();
  const uint8_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = m.w + (r0 + r * rs) * m.ldw;
  const int kmain = k - k % P::kIn;
  for (int c0 = 0; c0 < kmain; c0 += P::kSpan) {
    const int c1 = c0 + P::kSpan < kmain ? c0 + P::kSpan : kmain;
    typename V::T blk[R][TT][P::kBlk];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t)
#pragma GCC unroll 2
        for (int b = 0; b < P::kBlk; ++b) blk[r][t][b] = V::zero();
    for (int i = c0; i < c1; i += P::kIn) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        typename V::T w[P::kVec];
        P::decode(rows[r], i, w);
#pragma GCC unroll 8
        for (int v = 0; v < P::kVec; ++v)
#pragma GCC unroll 4
          for (int t = 0; t < TT; ++t) {
            typename V::T& b = blk[r][t][P::blk(v)];
            b = V::fma(w[v], V::load(xs[t] + i + v * V::kLanes), b);
          }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      typename V::T sv[P::kBlk];
      P::scales(m, r0 + r * rs, c0, sv);
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t)
#pragma GCC unroll 2
        for (int b = 0; b < P::kBlk; ++b) acc[r][t] = V::fma(blk[r][t][b], sv[b], acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) {
      float s = V::hsum(acc[r][t]);
      for (int i = kmain; i < k; ++i) s += q_elem<F>(m, r0 + r * rs, i) * xs[t][i];
      y[t * ldy + r * ys] = s;
    }
}

// Row streams as in gemv_rows (kernels_simd.h): R concurrent rows S apart.
template <QFormat F, int R, int TT>
FT_TARGET void qgemv_rows(const QMat& m, int rows, int k, const float* const* xs, float* y,
                          int ldy) {
  int r0 = 0;
  while (rows - r0 >= R) {
    const int S = (rows - r0) / R < kMaxStreamRows ? (rows - r0) / R : kMaxStreamRows;
    for (int b = 0; b < S; ++b) qgemv_block<F, R, TT>(m, r0 + b, S, k, xs, y + r0 + b, ldy, S);
    r0 += R * S;
  }
  for (int r = r0; r < rows; ++r) qgemv_block<F, 1, TT>(m, r, 1, k, xs, y + r, ldy, 1);
}

template <QFormat F>
FT_TARGET void qgemv(const QMat& m, int rows, int k, const float* const* xs, int n, float* y,
                     int ldy) {
  using P = QF<F>;
  for (int s = 0; s < n; s += 2) {
    float* ys = y + static_cast<int64_t>(s) * ldy;
    if (n - s >= 2) qgemv_rows<F, P::kRowsPair, 2>(m, rows, k, xs + s, ys, ldy);
    else qgemv_rows<F, P::kRowsSolo, 1>(m, rows, k, xs + s, ys, ldy);
  }
}

// Task rows [r, r + nr) dequantised into out[nr][k], in the kernel set's input layout.
template <QFormat F>
FT_TARGET void qdecode_rows(const QMat& m, int r, int nr, int k, float* out) {
  using P = QF<F>;
  const int kmain = k - k % P::kIn;
  for (int j = 0; j < nr; ++j) {
    const uint8_t* row = m.w + static_cast<int64_t>(r + j) * m.ldw;
    float* o = out + static_cast<int64_t>(j) * k;
    for (int c0 = 0; c0 < kmain; c0 += P::kSpan) {
      typename V::T sv[P::kBlk];
      P::scales(m, r + j, c0, sv);
      const int c1 = c0 + P::kSpan < kmain ? c0 + P::kSpan : kmain;
      for (int i = c0; i < c1; i += P::kIn) {
        typename V::T w[P::kVec];
        P::decode(row, i, w);
        for (int v = 0; v < P::kVec; ++v)
          V::store(o + i + v * V::kLanes, V::mul(w[v], sv[P::blk(v)]));
      }
    }
    q_decode_row<F>(m, r + j, kmain, k, o + kmain);
  }
}

template <QFormat F>
FT_TARGET void qtile(const QMat& m, int rows, int k, const float* xp, int nb, float* y) {
  thread_local std::vector<float> buf;  // [kTileRows][k], this worker's decoded rows
  const size_t need = static_cast<size_t>(kTileRows) * k;
  if (buf.size() < need) buf.resize(need);
  const int64_t block = static_cast<int64_t>(k) * kTileLanes;
  int r = 0;
  for (; r + kTileRows <= rows; r += kTileRows) {
    qdecode_rows<F>(m, r, kTileRows, k, buf.data());
    for (int b = 0; b < nb; ++b)
      tile_block<WF32, kTileRows>(buf.data(), k, k, xp + b * block,
                                  y + (static_cast<int64_t>(b) * rows + r) * kTileLanes);
  }
  for (; r < rows; ++r) {
    qdecode_rows<F>(m, r, 1, k, buf.data());
    for (int b = 0; b < nb; ++b)
      tile_block<WF32, 1>(buf.data(), k, k, xp + b * block,
                          y + (static_cast<int64_t>(b) * rows + r) * kTileLanes);
  }
}

// The QKernelSet array of an ISA, in QFormat order.
#define FT_QSET(isa, f) \
  {isa, QF<QFormat::f>::kChunk, QF<QFormat::f>::kPerm, qgemv<QFormat::f>, qtile<QFormat::f>}
#define FT_QUANT_SETS(isa) {FT_QSET(isa, Fp8Block), FT_QSET(isa, Mxfp4), FT_QSET(isa, Nvfp4)}

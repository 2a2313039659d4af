// ISA-generic bodies of the quantised SIMD kernels (contract in kernels.h: QGemvFn, QTileFn).
//
// Included by kernels_avx2.cpp, kernels_avx512.cpp and kernels_emu512.cpp after kernels_simd.h
// (it reuses V, WF32, tile_block and kMaxStreamRows), inside the same anonymous namespace, once
// they define V::mul and the decode primitives in struct Q:
//   fp8x2(p, a, b)            2 * kLanes e4m3 bytes -> a, b: their values times 2^-8, in order
//   Tab, table(s)             the e2m1 code values times s, in the ISA's lookup form
//   tablemul(t, g)            every entry of t times g
//   fp4x2(p, t0, t1, ev, od)  kLanes bytes -> ev: low nibbles (inputs 0, 2, 4, ..), od: high
//                             nibbles (inputs 1, 3, ..), decoded with t0 for the first half of
//                             the bytes and t1 for the second half
//   interleave(ev, od, lo, hi)  ev/od back to input order: lo inputs [0, L), hi [L, 2L)
//
// The including file also includes <vector> and quant_decode.h at file scope (this header is
// read inside its anonymous namespace).
//
// A gemv step consumes kStep = 2 * kLanes inputs. fp8 decodes them in order (gemv chunk 0);
// e2m1 decodes even and odd inputs into separate vectors, so gemv reads inputs de-interleaved in
// chunks of kStep, the same layout as bf16 (kernels.h, shuffle_index). Scales are applied to the
// decoded weights (fp8: one multiply per vector; e2m1: folded into the 16-entry lookup table once
// per group), which keeps each weight bit-identical to the torch reference. The tiled kernel
// decodes kTileRows rows at a time into a per-thread buffer and runs the fp32 tile on them: its
// decode cost is shared by every 16-token block of the expert.

// Per format: the scale state of one row over one `kSuper`-input span (a multiple of kStep and
// of the scale group), and the decode of one step with it.
template <QFormat F>
struct QF;

template <>
struct QF<QFormat::Fp8Block> {
  static constexpr QFormat kF = QFormat::Fp8Block;
  static constexpr int kSuper = 128;
  static constexpr int kChunk = 0;
  struct St {
    V::T s;
  };
  // 256: fp8x2 yields the byte's value times 2^-8; a power of two, so q * s rounds as in torch.
  FT_INLINE static St state(const QMat& m, int64_t r, int c) {
    return {V::set1(q_scale<kF>(m, r, c) * 256.f)};
  }
  FT_INLINE static void decode(const uint8_t* row, int i, const St& st, V::T& a, V::T& b) {
    Q::fp8x2(row + i, a, b);
    a = V::mul(a, st.s);
    b = V::mul(b, st.s);
  }
};

template <>
struct QF<QFormat::Mxfp4> {
  static constexpr QFormat kF = QFormat::Mxfp4;
  static constexpr int kSuper = kStep > 32 ? kStep : 32;
  static constexpr int kChunk = kStep;
  struct St {
    Q::Tab t;
  };
  FT_INLINE static St state(const QMat& m, int64_t r, int c) {
    return {Q::table(q_scale<kF>(m, r, c))};
  }
  FT_INLINE static void decode(const uint8_t* row, int i, const St& st, V::T& a, V::T& b) {
    Q::fp4x2(row + i / 2, st.t, st.t, a, b);
  }
};

template <>
struct QF<QFormat::Nvfp4> {
  static constexpr QFormat kF = QFormat::Nvfp4;
  static constexpr int kSuper = kStep > 16 ? kStep : 16;
  static constexpr int kChunk = kStep;
  struct St {
    Q::Tab t0, t1;  // groups of the first and (16-lane ISAs) second half of a step
  };
  FT_INLINE static Q::Tab group(const QMat& m, int64_t r, int c) {
    return Q::tablemul(Q::table(q_scale<kF>(m, r, c)), m.glob);
  }
  FT_INLINE static St state(const QMat& m, int64_t r, int c) {
    const Q::Tab t0 = group(m, r, c);
    return {t0, kStep > 16 ? group(m, r, c + 16) : t0};
  }
  FT_INLINE static void decode(const uint8_t* row, int i, const St& st, V::T& a, V::T& b) {
    Q::fp4x2(row + i / 2, st.t0, st.t1, a, b);
  }
};

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
  const int kmain = k - k % kStep;
  for (int g0 = 0; g0 < kmain; g0 += P::kSuper) {
    const int g1 = g0 + P::kSuper < kmain ? g0 + P::kSuper : kmain;
    typename P::St st[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) st[r] = P::state(m, r0 + r * rs, g0);
    for (int i = g0; i < g1; i += kStep) {
      typename V::T xa[TT], xb[TT];
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) {
        xa[t] = V::load(xs[t] + i);
        xb[t] = V::load(xs[t] + i + V::kLanes);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        typename V::T a, b;
        P::decode(rows[r], i, st[r], a, b);
#pragma GCC unroll 4
        for (int t = 0; t < TT; ++t) {
          acc[r][t] = V::fma(a, xa[t], acc[r][t]);
          acc[r][t] = V::fma(b, xb[t], acc[r][t]);
        }
      }
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

// The scale state (a vector or a lookup table per row) takes registers the bf16 kernel spends
// on a wider row block, so two tokens share 2 rows and a lone token takes 4.
template <QFormat F>
FT_TARGET void qgemv(const QMat& m, int rows, int k, const float* const* xs, int n, float* y,
                     int ldy) {
  for (int s = 0; s < n; s += 2) {
    float* ys = y + static_cast<int64_t>(s) * ldy;
    if (n - s >= 2) qgemv_rows<F, 2, 2>(m, rows, k, xs + s, ys, ldy);
    else qgemv_rows<F, 4, 1>(m, rows, k, xs + s, ys, ldy);
  }
}

// Task rows [r, r + nr) dequantised into out[nr][k], inputs in order.
template <QFormat F>
FT_TARGET void qdecode_rows(const QMat& m, int r, int nr, int k, float* out) {
  using P = QF<F>;
  const int kmain = k - k % kStep;
  for (int j = 0; j < nr; ++j) {
    const uint8_t* row = m.w + static_cast<int64_t>(r + j) * m.ldw;
    float* o = out + static_cast<int64_t>(j) * k;
    for (int g0 = 0; g0 < kmain; g0 += P::kSuper) {
      const typename P::St st = P::state(m, r + j, g0);
      const int g1 = g0 + P::kSuper < kmain ? g0 + P::kSuper : kmain;
      for (int i = g0; i < g1; i += kStep) {
        typename V::T a, b;
        P::decode(row, i, st, a, b);
        if constexpr (P::kChunk != 0) Q::interleave(a, b, a, b);
        V::store(o + i, a);
        V::store(o + i + V::kLanes, b);
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
#define FT_QSET(isa, f) {isa, QF<QFormat::f>::kChunk, qgemv<QFormat::f>, qtile<QFormat::f>}
#define FT_QUANT_SETS(isa) {FT_QSET(isa, Fp8Block), FT_QSET(isa, Mxfp4), FT_QSET(isa, Nvfp4)}

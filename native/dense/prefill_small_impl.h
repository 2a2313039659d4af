// The prefill attention kernel for tiles of few query rows (prefill_attention.h), one template on
// an ISA's vector type as prefill_attention_impl.h (included first, by the same ISA file).
//
// The tile kernel puts the tile's query rows (query i, head g) in the vector lanes of its logits:
// a tile of R = nq * G rows fills R / L of a vector, and below L rows the lanes are partly empty.
// This one puts the keys of a block in the lanes of the logits (st [R, KB], row r's logits of the
// block's keys side by side; its K is widened as the tile kernel's and transposed L x L at a time,
// V::transpose, to kt [d, KB]) and the head dims in the lanes of the weighted values, as the tile
// kernel does. Which tiles take it: prefill_small_tile (prefill_attention.h). Every result keeps
// the tile kernel's bits (the batch invariance of prefill_attention.h holds across the two),
// operation by operation:
//  - a logit is the same fma chain over the head dim in order, from 0 (fma(q, k, c) is
//    fma(k, q, c): one rounding of the exact product plus c);
//  - the block's max is over the row's keys with the masked ones at -inf, across the key vectors
//    and then their lanes: max is exact, so it is the tile kernel's value up to the sign of a
//    zero, which changes nothing below (x - 0 is x for x != 0, exp_neg(+0) = exp_neg(-0) = 1);
//  - the new max, the rescale corr and the weights are the same exp_neg of the same differences,
//    computed lane by lane on the same ISA's vectors (here over rows, and over keys);
//  - the block's weight sum is fma(l, corr, w_0) + w_1 + ... + w_{nk-1} in key order, masked
//    keys as exact zeros: the tile kernel's lane-wise sequence, here a scalar one per row (lanes
//    are keys, so a vector sum would reassociate it);
//  - acc = acc * corr + w V is the same gemm call with the weights read row-wise;
//  - the output is the same finish_rows.
#pragma once

#include "prefill_attention_impl.h"

namespace ftdense {
namespace prefill_impl {

template <class V>
FT_TARGET void prefill_tile_small(const KvPages& kv, const PrefillTile& t) {
  constexpr int L = V::kLanes;
  const int d = kv.d, G = t.G, R = t.nq * G, Rp = (R + L - 1) / L * L;
  const int ldk = padded_stride(KB), ldd = padded_stride(d);
  thread_local std::vector<float> buf;
  const size_t need = static_cast<size_t>(2 * R + 2 * KB) * ldd +
                      static_cast<size_t>(R + d) * ldk + 6 * static_cast<size_t>(Rp);
  if (buf.size() < need) buf.resize(need);
  float* qs = buf.data();     // [R, ldd] scaled queries
  float* acc = qs + R * ldd;  // [R, ldd] weighted values
  float* vb = acc + R * ldd;  // [KB, ldd] the block's values
  float* kb = vb + KB * ldd;  // [KB, ldd] the block's keys (rows past a short block's: finite)
  float* st = kb + KB * ldd;  // [R, ldk] logits, then weights
  float* kt = st + R * ldk;   // [d, ldk] the block's keys, transposed
  float* m = kt + d * ldk;    // [Rp] running max
  float* l = m + Rp;          // [Rp] running sum
  float* corr = l + Rp;       // [Rp] this block's rescale of acc
  float* mx = corr + Rp;      // [Rp] this block's max
  float* sub = mx + Rp;       // [Rp] what the weights subtract
  float* w0 = sub + Rp;       // [Rp] the first weight of a row
  for (int r = 0; r < R; ++r) {
    const float* src =
        t.q + (r / G) * t.row_stride + static_cast<int64_t>(t.kv_head * G + r % G) * d;
    for (int e = 0; e < d; ++e) qs[r * ldd + e] = src[e] * t.scale;
    std::fill(acc + r * ldd, acc + r * ldd + d, 0.0f);
  }
  std::fill(kb, kb + KB * ldd, 0.0f);  // the rows past a short block's keys stay finite
  std::fill(m, m + Rp, kNegInf);
  std::fill(l, l + Rp, 0.0f);
  std::fill(w0, w0 + Rp, 0.0f);

  const Blocks bl(kv, t);
  const typename V::T lowest = V::set1(std::numeric_limits<float>::lowest());
  int64_t offs[KB];
  int64_t offs_at = -1;
  for (int64_t b0 = bl.first(); b0 <= bl.last; b0 += KB) {
    const int nk = bl.keys(b0), qa = bl.qa(b0), qb = bl.qb(b0, nk);
    if (qa >= qb) continue;
    const int ra = qa * G, rb = qb * G, nc = (nk + L - 1) / L * L;
    if (offs_at != b0) bl.offsets(b0, nk, offs);
    for (int k = 0; k < nk; ++k) {
      widen_row<V>(kv.k, offs[k], kv.bf16, d, kb + k * ldd);
      widen_row<V>(kv.v, offs[k], kv.bf16, d, vb + k * ldd);
    }
    for (int k = 0; k < nc; k += L)
      for (int e = 0; e < d; e += L) V::transpose(kb + k * ldd + e, ldd, kt + e * ldk + k, ldk);
    Ahead ahead = bl.ahead(b0, offs, offs_at);
    {
      const int tiles = gemm_tiles<V>(nc, ra, rb) + gemm_tiles<V>(d, ra, rb);
      ahead.per = (ahead.lines + tiles - 1) / tiles;
    }
    // logits st[r, 0:nc] of the rows that see the block
    gemm<V>(qs, {ldd, 1}, kt, ldk, st, ldk, d, nc, ra, rb, nullptr, ahead);
    // the block's max over each row's visible keys [ka, ke) (-inf for the other rows)
    std::fill(mx, mx + Rp, kNegInf);
    for (int r = ra; r < rb; ++r) {
      float* s = st + r * ldk;
      const auto [ka, ke] = bl.visible(b0, nk, t.pos0 + r / G);
      std::fill(s, s + ka, kNegInf);
      std::fill(s + ke, s + nc, kNegInf);
      typename V::T v = V::load(s);
      for (int k = L; k < nc; k += L) v = V::max(v, V::load(s + k));
      float lanes[L];
      V::store(lanes, v);
      for (int j = 0; j < L; ++j) mx[r] = std::max(mx[r], lanes[j]);
    }
    for (int r = 0; r < Rp; r += L) {
      const typename V::T mo = V::load(m + r), mn = V::max(mo, V::load(mx + r));
      const typename V::T s = V::max(mn, lowest);
      V::store(m + r, mn);
      V::store(sub + r, s);
      V::store(corr + r, exp_neg<V>(V::sub(mo, s)));
    }
    // weights, keys in the lanes; masked keys exactly 0
    for (int r = ra; r < rb; ++r) {
      float* s = st + r * ldk;
      const typename V::T sr = V::set1(sub[r]);
      for (int k = 0; k < nc; k += L) V::store(s + k, exp_neg<V>(V::sub(V::load(s + k), sr)));
      const auto [ka, ke] = bl.visible(b0, nk, t.pos0 + r / G);
      std::fill(s, s + ka, 0.0f);
      std::fill(s + ke, s + nk, 0.0f);
      w0[r] = s[0];
    }
    // sums: fma(l, corr, w_0) on the ISA's vectors, then + w_k in key order, rows interleaved
    for (int r = ra / L * L; r < rb; r += L)
      V::store(mx + r, V::fma(V::load(l + r), V::load(corr + r), V::load(w0 + r)));
    for (int k = 1; k < nk; ++k)
      for (int r = ra; r < rb; ++r) mx[r] += st[r * ldk + k];
    std::copy(mx + ra, mx + rb, l + ra);
    // acc = acc * corr + weights V, for the rows that see the block
    gemm<V>(st, {ldk, 1}, vb, ldd, acc, ldd, nk, d, ra, rb, corr, ahead);
    ahead.per = ahead.lines;
    ahead.step();  // what is left
  }
  finish_rows<V>(t, d, R, m, l, acc, ldd);
}

}  // namespace prefill_impl
}  // namespace ftdense

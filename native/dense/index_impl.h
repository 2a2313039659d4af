// The Lightning Indexer's scoring kernel (sparse_attention.h, IndexFn), one template on an ISA's
// vector type. The including file defines FT_TARGET and FT_INLINE and a struct providing:
//   T, kLanes, kRB (heads of a register tile), kNV (vectors of keys of a register tile);
//   zero, set1, load, store, fma (a * b + c, fused), mul, relu (x > 0 ? x : 0, NaN -> 0);
//   pack(keys, bf16, dim, nk, kt): the nk <= kNV * kLanes keys widened to fp32 and transposed
//   into kt [dim, kNV * kLanes] (key-major columns, the missing keys' columns zero);
// then instantiates `index_keys<ThatStruct>`.
//
// Lanes are keys: a register tile holds kRB heads x kNV * kLanes keys, and every key's score is
// computed in its own lane, with no horizontal operation:
//
//     dot[h] = fma chain over e = 0 .. dim-1 of q[h, e] * key[e]     (from 0)
//     score  = fma chain over h = 0 .. heads-1 of w[h] * relu(dot[h] * scale)   (from 0)
//
// so the score of a key is the same bits whatever the ISA (AVX-512, AVX2, emu512, scalar: all
// fused), the tile, the task split or the thread count. The keys are streamed once: each tile's
// keys are packed (widened, transposed) into an L1-resident block, and every head's q row is read
// from L1 as broadcasts against it; the next tile's rows are prefetched while this one is scored.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace ftdense {
namespace index_impl {

// Tiles of keys prefetched ahead. Measured with GLM-5's paged pool rows (256-byte keys at a
// 1408-byte stride, 16k keys, one Zen 3 core of a shared machine): 0, 1, 2, 4, 8 tiles ahead gave
// 14-21 G multiply-adds/s each, run to run noise (+-30%) larger than any difference; 1 kept.
// The next tile's prefetches spread over this tile's head blocks, not in one burst at its start
// (where perf saw them stall, the miss buffers full): 18-25 against 12-17, alternated runs.
constexpr int kPrefetchTiles = 1;

// scores[j * L + l] (+ nothing: stored) for the tile's keys: heads [h0, h0 + RB) folded into the
// running scores s, in head order.
template <class V, int RB>
FT_INLINE void head_block(const float* q, const float* w, int h0, int dim, float scale,
                          const float* kt, typename V::T* s) {
  constexpr int L = V::kLanes, NV = V::kNV, KW = NV * L;
  typename V::T a[RB][NV];
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < NV; ++j) a[i][j] = V::zero();
  const float* qi[RB];
  for (int i = 0; i < RB; ++i) qi[i] = q + static_cast<int64_t>(h0 + i) * dim;
  const float* kc = kt;
  for (int64_t e = 0; e < dim; ++e, kc += KW) {
    typename V::T b[NV];
    for (int j = 0; j < NV; ++j) b[j] = V::load(kc + j * L);
    for (int i = 0; i < RB; ++i) {
      const typename V::T qa = V::set1(qi[i][e]);
      for (int j = 0; j < NV; ++j) a[i][j] = V::fma(qa, b[j], a[i][j]);
    }
  }
  const typename V::T vs = V::set1(scale);
  for (int i = 0; i < RB; ++i) {
    const typename V::T wi = V::set1(w[h0 + i]);
    for (int j = 0; j < NV; ++j) s[j] = V::fma(wi, V::relu(V::mul(a[i][j], vs)), s[j]);
  }
}

// The last n < RB heads (n == N, or fewer).
template <class V, int N>
FT_INLINE void head_tail(int n, const float* q, const float* w, int h0, int dim, float scale,
                         const float* kt, typename V::T* s) {
  if constexpr (N > 0) {
    if (n == N) head_block<V, N>(q, w, h0, dim, scale, kt, s);
    else head_tail<V, N - 1>(n, q, w, h0, dim, scale, kt, s);
  }
}

template <class V>
FT_TARGET void prefetch_rows(const char* const* keys, int nk, int64_t bytes) {
  for (int t = 0; t < nk; ++t)
    for (int64_t b = 0; b < bytes; b += 64) V::prefetch(keys[t] + b);
}

template <class V>
FT_TARGET void index_keys(const float* q, const float* w, int heads, int dim, float scale,
                          const char* const* keys, bool bf16, int n, float* scores) {
  constexpr int L = V::kLanes, NV = V::kNV, RB = V::kRB, KW = NV * L;
  thread_local std::vector<float> buf;  // the packed tile kt [dim, KW]
  buf.resize(static_cast<size_t>(dim) * KW);
  float* kt = buf.data();
  const int64_t row_bytes = static_cast<int64_t>(dim) * (bf16 ? 2 : 4);
  constexpr int ahead = kPrefetchTiles * KW;
  prefetch_rows<V>(keys, std::min(n, ahead), row_bytes);
  for (int t0 = 0; t0 < n; t0 += KW) {
    const int nk = std::min(KW, n - t0);
    V::pack(keys + t0, bf16, dim, nk, kt);
    // the tile `ahead` keys on, its keys' prefetches spread over this tile's head blocks
    const char* const* next = keys + t0 + ahead;
    int pending = t0 + ahead < n ? std::min(KW, n - t0 - ahead) : 0;
    const int per = (pending * RB + heads - 1) / heads;  // keys a head block
    typename V::T s[NV];
    for (int j = 0; j < NV; ++j) s[j] = V::zero();
    int h = 0;
    for (; h + RB <= heads; h += RB) {
      const int p = std::min(per, pending);
      prefetch_rows<V>(next, p, row_bytes);
      next += p, pending -= p;
      head_block<V, RB>(q, w, h, dim, scale, kt, s);
    }
    prefetch_rows<V>(next, pending, row_bytes);
    head_tail<V, RB - 1>(heads - h, q, w, h, dim, scale, kt, s);
    if (nk == KW) {
      for (int j = 0; j < NV; ++j) V::store(scores + t0 + j * L, s[j]);
    } else {
      alignas(64) float tmp[KW];
      for (int j = 0; j < NV; ++j) V::store(tmp + j * L, s[j]);
      std::copy(tmp, tmp + nk, scores + t0);
    }
  }
}

// Generic pack (one element at a time): kt[e * KW + t] = key t's element e, zero past nk.
template <int KW, class Widen>
inline void pack_generic(const char* const* keys, bool bf16, int dim, int nk, float* kt,
                         Widen widen) {
  for (int t = 0; t < KW; ++t)
    for (int e = 0; e < dim; ++e) kt[e * KW + t] = t < nk ? widen(keys[t], e, bf16) : 0.0f;
}

}  // namespace index_impl
}  // namespace ftdense

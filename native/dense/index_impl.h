// The Lightning Indexer's scoring kernel (sparse_attention.h, IndexFn), one template on an ISA's
// vector type: `IndexVec` over the prefill attention's (prefill_attention_impl.h: T, kLanes,
// zero, set1, load, store, fma, mul, max) with this kernel's register tile (kRB heads x kNV
// vectors of keys) and its key packing: `pack(keys, bf16, dim, nk, kt)` widens the nk <= kNV *
// kLanes keys to fp32 and transposes them into kt [dim, kNV * kLanes] (key-major columns, the
// missing keys' columns zero). The prefill attention's files instantiate `index_keys` with it.
//
// Lanes are keys: a register tile holds kRB heads x kNV * kLanes keys, and every key's score is
// computed in its own lane, with no horizontal operation:
//
//     dot[h] = fma chain over e = 0 .. dim-1 of q[h, e] * key[e]     (from 0)
//     score  = fma chain over h = 0 .. heads-1 of w[h] * relu(dot[h] * scale)   (from 0)
//
// so the score of a key is the same bits whatever the ISA (AVX-512, AVX2, emu512, scalar: all
// fused; NaN scores aside), the tile, the task split or the thread count. The keys are streamed
// once: each tile's keys are packed (widened, transposed) into an L1-resident block, and every
// head's q row is read from L1 as broadcasts against it; the next tile's rows are prefetched
// while this one is scored.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "prefill_attention_impl.h"

namespace ftdense {
namespace index_impl {

// Tiles of keys prefetched ahead. Measured with GLM-5's paged pool rows (256-byte keys at a
// 1408-byte stride, 16k keys, one Zen 3 core of a shared machine): 0, 1, 2, 4, 8 tiles ahead gave
// 14-21 G multiply-adds/s each, run to run noise (+-30%) larger than any difference; 1 kept.
// The next tile's prefetches spread over this tile's head blocks, not in one burst at its start
// (where perf saw them stall, the miss buffers full): 18-25 against 12-17, alternated runs.
constexpr int kPrefetchTiles = 1;

// Folds heads [h0, h0 + RB) into the running scores s of the tile's keys (lane l of s[j]: key
// j * L + l), in head order.
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

// Packing one element at a time: kt[e * KW + t] = key t's element e, zero past nk.
struct PackGeneric {
  template <int KW>
  static void run(const char* const* keys, bool bf16, int dim, int nk, float* kt) {
    for (int t = 0; t < KW; ++t)
      for (int e = 0; e < dim; ++e)
        kt[e * KW + t] = t < nk ? prefill_impl::widen1(keys[t], e, bf16) : 0.0f;
  }
};

// The kernel's vector type: the prefill attention's P with a register tile of RB heads x NV
// vectors of keys and packing Pack. One lane (P::kLanes == 1, the plain-C++ "scalar") fuses its
// multiply-adds with std::fma, as the SIMD and emulated ones do.
template <class P, int RB, int NV, class Pack>
struct IndexVec : P {
  using T = typename P::T;
  static constexpr int kRB = RB, kNV = NV;
  FT_INLINE static T fma(const T& a, const T& b, const T& c) {
    if constexpr (P::kLanes == 1) return std::fma(a, b, c);
    else return P::fma(a, b, c);
  }
  FT_INLINE static T relu(const T& a) { return P::max(a, P::zero()); }
  FT_INLINE static void prefetch(const char* p) { __builtin_prefetch(p); }
  FT_INLINE static void pack(const char* const* keys, bool bf16, int dim, int nk, float* kt) {
    Pack::template run<NV * P::kLanes>(keys, bf16, dim, nk, kt);
  }
};

}  // namespace index_impl
}  // namespace ftdense

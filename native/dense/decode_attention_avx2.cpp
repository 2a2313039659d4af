// AVX2 + FMA range kernel of decode attention (decode_attention.h); d % 8 == 0. Also the sparse
// attention's kernel (sparse_attention.h), on the same tile functions (the indexer's is in
// prefill_attention_avx2.cpp, on index_impl.h).
//
// Keys go in tiles of kT: (1) the G heads' logits of the tile, each K row widened once and
// dotted with every head of the group; (2) per head the tile maximum, the correction of the
// running state and the exponentials (vectorised exp); (3) acc = acc * corr + p V, each V row
// widened once per 8 columns and used by every head. Every inner loop keeps 8 independent
// accumulators (heads x keys or heads x columns), enough to hide the FMA latency whatever G is.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "decode_attention.h"
#include "sparse_attention.h"

#define FT_TARGET __attribute__((target("avx2,fma")))
#define FT_INLINE FT_TARGET __attribute__((always_inline)) inline

namespace ftdense {

namespace {

constexpr int kT = 32;  // keys per tile: the tile's V slices (kT x d bf16) stay in L1
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <bool BF16>
FT_INLINE __m256 load8(const void* p, int64_t i) {
  if constexpr (BF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
        static_cast<const uint16_t*>(p) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  }
}

FT_INLINE float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lane i = horizontal sum of a[i].
FT_INLINE __m256 hsum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// e^x for x <= 0 (Cody-Waite range reduction, degree-6 polynomial on [-ln2/2, ln2/2]; within
// 2 ulp of expf). Below -87.3 the result is clamped to ~1e-38 instead of flushing to 0: such a
// term is negligible against the tile maximum's e^0 = 1.
FT_INLINE __m256 exp_neg(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// Logits of GB heads (q [GB, d]) for keys [t, t + KB) of the tile: s[i * kT + t + k].
template <bool BF16, int GB, int KB>
FT_INLINE void logits(const float* q, int d, const char* const* kp, int t, float scale,
                      float* s) {
  __m256 a[GB * KB];
  for (int i = 0; i < GB * KB; ++i) a[i] = _mm256_setzero_ps();
  for (int c = 0; c < d; c += 8) {
    for (int k = 0; k < KB; ++k) {
      const __m256 kv = load8<BF16>(kp[t + k], c);
      for (int i = 0; i < GB; ++i)
        a[i * KB + k] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * d + c), kv, a[i * KB + k]);
    }
  }
  if constexpr (GB * KB == 8) {
    alignas(32) float r[8];
    _mm256_store_ps(r, _mm256_mul_ps(hsum8(a), _mm256_set1_ps(scale)));
    for (int i = 0; i < GB; ++i)
      for (int k = 0; k < KB; ++k) s[i * kT + t + k] = r[i * KB + k];
  } else {
    for (int i = 0; i < GB; ++i)
      for (int k = 0; k < KB; ++k) s[i * kT + t + k] = hsum(a[i * KB + k]) * scale;
  }
}

// A tile's K and V slices of this KV head. The next tile's are prefetched a key at a time as
// the logits loop walks the current tile. Before, the whole tile's prefetches went out in one
// burst at the tile's start, and only up to the end of the range (a 64-key block), so every
// second tile had none. Measured with the KV pages out of cache (32 query / 4 KV heads, d 128,
// bf16, 2 threads, alternated in one process): 1.14x, 1.09x, 1.39x, 1.39x faster at 80, 464,
// 3000 and 12000 keys; spreading the burst alone, still stopping at the block's end, gave 1.06x
// to 1.23x, and prefetching 2 or 3 tiles ahead was slower than 1. Into L2 (T1), not L1: a
// tile's K and V slices and the next tile's are more than L1 holds with q and acc, and T0
// prefetches pushed out lines still in use; T1 over T0, the same setting: 1.32x to 1.38x at 464
// and 3000 keys cold, 1.04x to 1.10x at 12000 (and 1.27x there with the pages in L3); a whole
// Q4_K_M decode step after a 3000-token prompt, alternated in one process: 1.029x.
struct TileSlices {
  const char* k[kT];
  const char* v[kT];
  int n;  // keys
  int64_t slice;  // bytes of a key's slice
};

FT_INLINE void prefetch_key(const TileSlices* a, int t) {
  if (a == nullptr || t >= a->n) return;
  for (int64_t b = 0; b < a->slice; b += 64) {
    _mm_prefetch(a->k[t] + b, _MM_HINT_T1);
    _mm_prefetch(a->v[t] + b, _MM_HINT_T1);
  }
}

// Logits of GB heads (8 / GB keys at a time, the tile's tail one at a time); prefetches `ahead`
// (when given) alongside, key t of the next tile beside key t of this one.
template <bool BF16, int GB>
FT_TARGET void logits_heads(const float* q, int d, const char* const* kp, int nt, float scale,
                            float* s, const TileSlices* ahead) {
  constexpr int KB = 8 / GB;
  int t = 0;
  for (; t + KB <= nt; t += KB) {
    for (int k = 0; k < KB; ++k) prefetch_key(ahead, t + k);
    logits<BF16, GB, KB>(q, d, kp, t, scale, s);
  }
  for (; t < nt; ++t) {
    prefetch_key(ahead, t);
    logits<BF16, GB, 1>(q, d, kp, t, scale, s);
  }
  for (; ahead != nullptr && t < ahead->n; ++t) prefetch_key(ahead, t);
}

// acc[i, c:c+8*CB] = acc * corr[i] + sum_t p[i * kT + t] * V[t, c:c+8*CB] for GB heads.
template <bool BF16, int GB, int CB>
FT_INLINE void accumulate(float* acc, int d, const char* const* vp, int nt, const float* p,
                          const float* corr, int c) {
  __m256 a[GB * CB];
  for (int i = 0; i < GB; ++i)
    for (int b = 0; b < CB; ++b)
      a[i * CB + b] = _mm256_mul_ps(_mm256_loadu_ps(acc + i * d + c + 8 * b),
                                    _mm256_set1_ps(corr[i]));
  for (int t = 0; t < nt; ++t) {
    __m256 v[CB];
    for (int b = 0; b < CB; ++b) v[b] = load8<BF16>(vp[t], c + 8 * b);
    for (int i = 0; i < GB; ++i) {
      const __m256 w = _mm256_broadcast_ss(p + i * kT + t);
      for (int b = 0; b < CB; ++b) a[i * CB + b] = _mm256_fmadd_ps(w, v[b], a[i * CB + b]);
    }
  }
  for (int i = 0; i < GB; ++i)
    for (int b = 0; b < CB; ++b) _mm256_storeu_ps(acc + i * d + c + 8 * b, a[i * CB + b]);
}

template <bool BF16, int GB>
FT_TARGET void accumulate_heads(float* acc, int d, const char* const* vp, int nt, const float* p,
                                const float* corr) {
  constexpr int CB = 8 / GB;
  int c = 0;
  for (; c + 8 * CB <= d; c += 8 * CB) accumulate<BF16, GB, CB>(acc, d, vp, nt, p, corr, c);
  for (; c < d; c += 8) accumulate<BF16, GB, 1>(acc, d, vp, nt, p, corr, c);
}

// Folds the tile's logits s [G, kT] of head g into its running state; s becomes e^(s - m).
FT_TARGET void softmax_tile(float* s, int nt, float& m, float& l, float& corr) {
  float mt = kNegInf;
  int t = 0;
  if (nt >= 8) {  // vector max, not a scalar chain over the tile
    __m256 vmax = _mm256_loadu_ps(s);
    for (t = 8; t + 8 <= nt; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + t));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    mt = _mm_cvtss_f32(h);
  }
  for (; t < nt; ++t) mt = std::max(mt, s[t]);
  const float mn = std::max(m, mt);
  corr = m == kNegInf ? 0.0f : std::exp(m - mn);
  const __m256 vm = _mm256_set1_ps(mn);
  __m256 vs = _mm256_setzero_ps();
  t = 0;
  for (; t + 8 <= nt; t += 8) {
    const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
    _mm256_storeu_ps(s + t, e);
    vs = _mm256_add_ps(vs, e);
  }
  float sum = hsum(vs);
  for (; t < nt; ++t) sum += (s[t] = std::exp(s[t] - mn));
  l = l * corr + sum;
  m = mn;
}

// Calls F<GB>(g0) over the G heads in blocks of 8, then 4, 2, 1.
template <typename F>
inline void head_blocks(int G, F&& f) {
  int g = 0;
  for (; g + 8 <= G; g += 8) f(std::integral_constant<int, 8>{}, g);
  if (g + 4 <= G) f(std::integral_constant<int, 4>{}, g), g += 4;
  if (g + 2 <= G) f(std::integral_constant<int, 2>{}, g), g += 2;
  if (g < G) f(std::integral_constant<int, 1>{}, g);
}

template <bool BF16>
FT_TARGET void range(const KvPages& kv, const KeyRange& r) {
  const int d = kv.d, G = r.G;
  const int64_t esize = BF16 ? 2 : 4;
  const int64_t row_bytes = static_cast<int64_t>(kv.kv_heads) * d * esize;
  const int64_t head_bytes = static_cast<int64_t>(r.kv_head) * d * esize;
  thread_local std::vector<float> buf;  // logits / weights [G, kT], then corrections [G]
  buf.resize(static_cast<size_t>(G) * (kT + 1));
  float* s = buf.data();
  float* corr = s + G * kT;
  // This tile's slices and the next tile's: the next becomes this at the tile's end (ahead_end
  // >= k1, so the next tile's keys are the first of those looked ahead at).
  TileSlices tiles[2];
  TileSlices *cur = &tiles[0], *ahead = &tiles[1];
  tiles[0].slice = tiles[1].slice = static_cast<int64_t>(d) * esize;
  // Pointers to the slices of keys [p0, p0 + n) of this KV head, walking the page table (one
  // division per call, not two per key).
  const auto slices = [&](int64_t p0, int n, TileSlices& a) {
    a.n = n;
    int64_t pg = p0 / kv.page_size;
    int row = static_cast<int>(p0 % kv.page_size);
    for (int i = 0; i < n; ++i) {
      const int64_t off =
          (static_cast<int64_t>(r.table[pg]) * kv.page_size + row) * row_bytes + head_bytes;
      a.k[i] = static_cast<const char*>(kv.k) + off;
      a.v[i] = static_cast<const char*>(kv.v) + off;
      if (++row == kv.page_size) row = 0, ++pg;
    }
  };
  slices(r.k0, static_cast<int>(std::min<int64_t>(kT, r.k1 - r.k0)), *cur);
  for (int64_t t0 = r.k0; t0 < r.k1; t0 += kT, std::swap(cur, ahead)) {
    const int nt = static_cast<int>(std::min<int64_t>(kT, r.k1 - t0));
    // The next tile's slices (past k1 too, up to ahead_end: this head's next range in the task):
    // a KV head's slice is a quarter or less of a pool row and pages are scattered, so the
    // hardware prefetchers (which stop at 4 KiB boundaries) miss most of them.
    const int64_t t1 = std::min<int64_t>(std::max(r.k1, r.ahead_end), t0 + 2 * kT);
    slices(t0 + kT, static_cast<int>(std::max<int64_t>(0, t1 - t0 - kT)), *ahead);
    head_blocks(G, [&](auto gb, int g0) {
      logits_heads<BF16, decltype(gb)::value>(r.q + g0 * d, d, cur->k, nt, r.scale, s + g0 * kT,
                                              g0 == 0 ? ahead : nullptr);
    });
    for (int g = 0; g < G; ++g) softmax_tile(s + g * kT, nt, r.m[g], r.l[g], corr[g]);
    head_blocks(G, [&](auto gb, int g0) {
      accumulate_heads<BF16, decltype(gb)::value>(r.acc + g0 * d, d, cur->v, nt, s + g0 * kT,
                                                   corr + g0);
    });
  }
}


// Row pointers of the keys [t0 + kT, t0 + 2 kT) (clipped to n) for the prefetches of the tile
// after [t0, t0 + kT); a sparse row is one slice (K and V the same row).
inline void next_tile(const char* const* rows, int64_t t0, int64_t n, TileSlices& a) {
  a.n = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(kT, n - t0 - kT)));
  for (int i = 0; i < a.n; ++i) a.k[i] = a.v[i] = rows[t0 + kT + i];
}

// Sparse attention (sparse_attention.h): the decode range kernel's tile steps on a list of rows,
// keys dk and values dv columns of the same row, for heads [h0, h1).
template <bool BF16>
FT_TARGET void sparse_range(const SparseQuery& sq, const char* const* rows, int64_t k0,
                            int64_t k1, int h0, int h1, float* m, float* l, float* acc) {
  const int G = h1 - h0, dk = sq.dk, dv = sq.dv;
  thread_local std::vector<float> buf;  // logits / weights [G, kT], then corrections [G]
  buf.resize(static_cast<size_t>(G) * (kT + 1));
  float* s = buf.data();
  float* corr = s + G * kT;
  TileSlices ahead;
  ahead.slice = static_cast<int64_t>(dk) * (BF16 ? 2 : 4);
  const float* q = sq.q + static_cast<int64_t>(h0) * dk;
  for (int64_t t0 = k0; t0 < k1; t0 += kT) {
    const int nt = static_cast<int>(std::min<int64_t>(kT, k1 - t0));
    const char* const* kp = rows + t0;
    next_tile(rows, t0, k1, ahead);
    head_blocks(G, [&](auto gb, int g0) {
      logits_heads<BF16, decltype(gb)::value>(q + g0 * dk, dk, kp, nt, sq.scale, s + g0 * kT,
                                              g0 == 0 ? &ahead : nullptr);
    });
    for (int g = 0; g < G; ++g) softmax_tile(s + g * kT, nt, m[g], l[g], corr[g]);
    head_blocks(G, [&](auto gb, int g0) {
      accumulate_heads<BF16, decltype(gb)::value>(acc + g0 * dv, dv, kp, nt, s + g0 * kT,
                                                   corr + g0);
    });
  }
}

}  // namespace

void range_avx2(const KvPages& kv, const KeyRange& r) {
  if (kv.bf16) range<true>(kv, r);
  else range<false>(kv, r);
}

void sparse_avx2(const SparseQuery& sq, const char* const* rows, bool bf16, int64_t k0,
                 int64_t k1, int h0, int h1, float* m, float* l, float* acc) {
  if (bf16) sparse_range<true>(sq, rows, k0, k1, h0, h1, m, l, acc);
  else sparse_range<false>(sq, rows, k0, k1, h0, h1, m, l, acc);
}

}  // namespace ftdense

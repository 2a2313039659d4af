// The body of the prefill attention tile kernel (prefill_attention.h), one template on an ISA's
// vector type. The including file defines FT_TARGET, FT_INLINE and, before including, a struct
// providing:
//   T, kLanes, kRB (rows of a register tile), kNV (vectors of columns of a register tile);
//   zero, set1, load, store, fma (a * b + c), mul, add, sub, max, round (to nearest),
//   pow2 (2^n for integral n in [-126, 127]), widen (L bf16 values -> fp32), transpose (an L x L
//   block of floats, for the few-row kernel of prefill_small_impl.h);
// then calls `prefill_tile<ThatStruct>`. Every lane is computed alone (no horizontal operation),
// so the kernels whose fma is fused (AVX2, AVX-512, emu512) give the same bits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "prefill_attention.h"

namespace ftdense {
namespace prefill_impl {

constexpr int KB = kPrefillKeyBlock;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// e^x for x <= 0: Cody-Waite reduction by ln 2, degree-6 polynomial; below -87.3 it returns
// ~1e-38, not 0 (masked keys are zeroed by the caller).
template <class V>
FT_INLINE typename V::T exp_neg(typename V::T x) {
  x = V::max(x, V::set1(-87.3f));
  const typename V::T n = V::round(V::mul(x, V::set1(1.44269504088896341f)));
  typename V::T r = V::fma(n, V::set1(-0.693359375f), x);
  r = V::fma(n, V::set1(2.12194440e-4f), r);
  typename V::T y = V::set1(1.9875691500e-4f);
  y = V::fma(y, r, V::set1(1.3981999507e-3f));
  y = V::fma(y, r, V::set1(8.3334519073e-3f));
  y = V::fma(y, r, V::set1(4.1665795894e-2f));
  y = V::fma(y, r, V::set1(1.6666665459e-1f));
  y = V::fma(y, r, V::set1(5.0000001201e-1f));
  y = V::fma(y, V::mul(r, r), V::add(r, V::set1(1.0f)));
  return V::mul(y, V::pow2(n));
}

// C[RB, NV * L] = (C * rowscale[i], or 0 without rowscale) + A[RB, K] B[K, NV * L], A(i, k) at
// A[i * ai + k * ak]: every element one fma chain over k = 0 .. K-1 in order, whatever RB and NV.
struct AStride {
  int64_t i, k;
};

// The next key block's pool lines (K and V of one KV head), fetched towards the cache a few at a
// time between the register tiles of the current block's GEMMs: the pool's pages are scattered,
// so the hardware prefetchers do not follow them, and a burst of software prefetches would
// overflow the miss buffers (most of it dropped). No effect on results.
struct Ahead {
  const char* k = nullptr;
  const char* v = nullptr;
  const int64_t* offs = nullptr;  // the rows' offsets (elements)
  int64_t esize = 0;
  int row_lines = 0;  // 64-byte lines a row
  int lines = 0;      // rows * row_lines
  int per = 0;        // lines (of each of K and V) a step
  int next = 0;

  FT_INLINE void step() {
    for (int e = std::min(lines, next + per); next < e; ++next) {
      const int64_t at = offs[next / row_lines] * esize + (next % row_lines) * 64;
      __builtin_prefetch(k + at);
      __builtin_prefetch(v + at);
    }
  }
};

template <class V, int RB, int NV>
FT_INLINE void gemm_block(const float* A, AStride as, const float* B, int64_t ldb, float* C,
                          int64_t ldc, int K, const float* rowscale) {
  constexpr int L = V::kLanes;
  typename V::T c[RB][NV];
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < NV; ++j)
      c[i][j] = rowscale ? V::mul(V::load(C + i * ldc + j * L), V::set1(rowscale[i])) : V::zero();
  for (int k = 0; k < K; ++k) {
    typename V::T b[NV];
    for (int j = 0; j < NV; ++j) b[j] = V::load(B + k * ldb + j * L);
    for (int i = 0; i < RB; ++i) {
      const typename V::T a = V::set1(A[i * as.i + k * as.k]);
      for (int j = 0; j < NV; ++j) c[i][j] = V::fma(a, b[j], c[i][j]);
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < NV; ++j) V::store(C + i * ldc + j * L, c[i][j]);
}

// The last n < RB rows (n == N, or fewer).
template <class V, int NV, int N>
FT_INLINE void gemm_tail(int n, const float* A, AStride as, const float* B, int64_t ldb,
                         float* C, int64_t ldc, int K, const float* rowscale) {
  if constexpr (N > 0) {
    if (n == N) gemm_block<V, N, NV>(A, as, B, ldb, C, ldc, K, rowscale);
    else gemm_tail<V, NV, N - 1>(n, A, as, B, ldb, C, ldc, K, rowscale);
  }
}

// Rows [r0, r1) of C = (C * rowscale or 0) + A B on one slab of NV vectors of columns.
template <class V, int NV>
FT_INLINE void gemm_rows(const float* A, AStride as, const float* B, int64_t ldb, float* C,
                         int64_t ldc, int K, int r0, int r1, const float* rowscale,
                         Ahead& ahead) {
  constexpr int RB = V::kRB;
  // a short ragged end (half a tile's rows or fewer keep too few fma chains in flight) is taken
  // with the last full tile as two tiles of about equal height
  const int n = r1 - r0, full = n / RB - (n % RB && n % RB <= RB / 2 && n > RB ? 1 : 0);
  int r = r0;
  for (const int e = r0 + full * RB; r < e; r += RB) {
    ahead.step();
    gemm_block<V, RB, NV>(A + r * as.i, as, B, ldb, C + r * ldc, ldc, K,
                          rowscale ? rowscale + r : nullptr);
  }
  while (r < r1) {
    const int h = r1 - r >= RB ? (r1 - r + 1) / 2 : r1 - r;
    ahead.step();
    gemm_tail<V, NV, RB - 1>(h, A + r * as.i, as, B, ldb, C + r * ldc, ldc, K,
                             rowscale ? rowscale + r : nullptr);
    r += h;
  }
}

// Rows [r0, r1) of C = (C * rowscale or 0) + A B over `cols` columns (a multiple of L), column
// slabs outside so a slab of B stays in L1 while every row tile passes over it.
// Steps `ahead` before each register tile.
template <class V>
FT_INLINE void gemm(const float* A, AStride as, const float* B, int64_t ldb, float* C,
                    int64_t ldc, int K, int cols, int r0, int r1, const float* rowscale,
                    Ahead& ahead) {
  constexpr int L = V::kLanes, W = V::kNV * L;
  int c = 0;
  for (; c + W <= cols; c += W)
    gemm_rows<V, V::kNV>(A, as, B + c, ldb, C + c, ldc, K, r0, r1, rowscale, ahead);
  for (; c < cols; c += L)
    gemm_rows<V, 1>(A, as, B + c, ldb, C + c, ldc, K, r0, r1, rowscale, ahead);
}

// Register tiles of gemm over rows [r0, r1) and `cols` columns.
template <class V>
constexpr int gemm_tiles(int cols, int r0, int r1) {
  constexpr int W = V::kNV * V::kLanes;
  const int slabs = cols / W + (cols % W) / V::kLanes;
  return slabs * ((r1 - r0) / V::kRB + 1);
}

// A row stride of at least n floats (n a multiple of 16) that is an odd number of 64-byte lines.
constexpr int padded_stride(int n) {
  n = (n + 15) / 16 * 16;
  return (n / 16) % 2 ? n : n + 16;
}

inline float widen1(const void* base, int64_t i, bool bf16) {
  if (!bf16) return static_cast<const float*>(base)[i];
  const uint32_t u = static_cast<uint32_t>(static_cast<const uint16_t*>(base)[i]) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Widens n values (a multiple of L) of a pool row into dst.
template <class V>
FT_INLINE void widen_row(const void* base, int64_t off, bool bf16, int n, float* dst) {
  if (bf16) {
    const uint16_t* src = static_cast<const uint16_t*>(base) + off;
    for (int e = 0; e < n; e += V::kLanes) V::store(dst + e, V::widen(src + e));
  } else {
    std::memcpy(dst, static_cast<const float*>(base) + off, sizeof(float) * n);
  }
}

// The key blocks of a tile (aligned to position 0, ascending) and which rows and keys see them.
struct Blocks {
  const KvPages& kv;
  const PrefillTile& t;
  int64_t last;  // the tile's last position: no key past it is read

  Blocks(const KvPages& kv_, const PrefillTile& t_) : kv(kv_), t(t_), last(t_.pos0 + t_.nq - 1) {}
  int64_t lo(int64_t p) const {
    return t.window > 0 ? std::max<int64_t>(0, p - t.window + 1) : int64_t{0};
  }
  int64_t first() const { return lo(t.pos0) / KB * KB; }
  int keys(int64_t b0) const { return static_cast<int>(std::min<int64_t>(KB, last + 1 - b0)); }
  // queries [qa, qb) see a key of the block: positions >= b0, and (window) lo <= its last
  int qa(int64_t b0) const { return static_cast<int>(std::max<int64_t>(0, b0 - t.pos0)); }
  int qb(int64_t b0, int nk) const {
    return t.window > 0
               ? static_cast<int>(std::min<int64_t>(t.nq, b0 + nk - 1 + t.window - t.pos0))
               : t.nq;
  }
  // the keys [ka, ke) of the block that position p sees (p among the rows that see it)
  std::pair<int, int> visible(int64_t b0, int nk, int64_t p) const {
    return {static_cast<int>(std::max<int64_t>(lo(p), b0) - b0),
            static_cast<int>(std::min<int64_t>(p + 1, b0 + nk) - b0)};
  }
  // pool offsets (elements) of the block's rows of this KV head
  void offsets(int64_t b0, int nk, int64_t* o) const {
    const int64_t rs = static_cast<int64_t>(kv.kv_heads) * kv.d;
    int64_t pg = b0 / kv.page_size;
    int row = static_cast<int>(b0 % kv.page_size);
    for (int k = 0; k < nk; ++k) {
      o[k] = (static_cast<int64_t>(t.table[pg]) * kv.page_size + row) * rs +
             int64_t{t.kv_head} * kv.d;
      if (++row == kv.page_size) row = 0, ++pg;
    }
  }
  // once block b0 is widened: the next block's offsets into offs, and its prefetcher
  Ahead ahead(int64_t b0, int64_t* offs, int64_t& offs_at) const {
    const int64_t esize = kv.bf16 ? 2 : 4;
    const int row_lines = static_cast<int>((kv.d * esize + 63) / 64);
    const int nn = static_cast<int>(std::clamp<int64_t>(last + 1 - b0 - KB, 0, KB));
    if (nn > 0) offsets(b0 + KB, nn, offs), offs_at = b0 + KB;
    return Ahead{static_cast<const char*>(kv.k), static_cast<const char*>(kv.v), offs, esize,
                 row_lines, nn * row_lines, 0, 0};
  }
};

// out = acc / (l, plus the sink's share), rows r = query i * G + head g of acc [R, ldd].
template <class V>
FT_INLINE void finish_rows(const PrefillTile& t, int d, int R, const float* m, const float* l,
                           const float* acc, int ldd) {
  for (int r = 0; r < R; ++r) {
    const int i = r / t.G, g = r % t.G;
    float f;
    if (t.sinks) {
      const float mx = std::max(m[r], t.sinks[g]);
      const float w = std::exp(m[r] - mx);
      f = w / std::fma(l[r], w, std::exp(t.sinks[g] - mx));  // fused on every path
    } else {
      f = 1.0f / l[r];
    }
    float* dst = t.out + i * t.row_stride + static_cast<int64_t>(t.kv_head * t.G + g) * d;
    const float* a = acc + static_cast<int64_t>(r) * ldd;
    for (int e = 0; e < d; e += V::kLanes) V::store(dst + e, V::mul(V::load(a + e), V::set1(f)));
  }
}

// Layout: query rows r = query i * G + head g sit in the lanes (Rp = R rounded up to L), keys
// in the rows of the logits st [KB, Rp]: a row's max and sum over a block's keys are lane-wise
// sequences over the keys in order, so they do not depend on the vector width either.
template <class V>
FT_TARGET void prefill_tile(const KvPages& kv, const PrefillTile& t) {
  constexpr int L = V::kLanes;
  const int d = kv.d, G = t.G, R = t.nq * G, Rp = (R + L - 1) / L * L;
  // row strides: an odd number of 64-byte lines, so a column slab of a GEMM operand (rows of
  // 512 bytes apart otherwise) spreads over all the L1 sets instead of an eighth of them
  const int ldr = padded_stride(Rp), ldd = padded_stride(d);
  thread_local std::vector<float> buf;
  const size_t need = static_cast<size_t>(ldr) * (d + KB) + 3 * static_cast<size_t>(Rp) +
                      static_cast<size_t>(R) * ldd + 2 * static_cast<size_t>(ldd) * KB;
  if (buf.size() < need) buf.resize(need);
  float* qt = buf.data();     // [d, ldr] scaled queries, transposed (pad rows 0)
  float* acc = qt + ldr * d;  // [R, ldd] weighted values
  float* st = acc + R * ldd;  // [KB, ldr] logits, then weights
  float* kb = st + KB * ldr;  // [KB, ldd] the block's keys
  float* vb = kb + KB * ldd;  // [KB, ldd] the block's values
  float* m = vb + KB * ldd;   // [Rp] running max
  float* l = m + Rp;          // [Rp] running sum
  float* corr = l + Rp;       // [Rp] this block's rescale of acc
  for (int r = 0; r < Rp; ++r) {
    const float* src = r < R ? t.q + (r / G) * t.row_stride +
                                   static_cast<int64_t>(t.kv_head * G + r % G) * d
                             : nullptr;
    for (int e = 0; e < d; ++e) qt[e * ldr + r] = src ? src[e] * t.scale : 0.0f;
  }
  for (int r = 0; r < R; ++r) std::fill(acc + r * ldd, acc + r * ldd + d, 0.0f);
  std::fill(m, m + Rp, kNegInf);
  std::fill(l, l + Rp, 0.0f);

  const Blocks bl(kv, t);
  const typename V::T lowest = V::set1(std::numeric_limits<float>::lowest());
  int64_t offs[KB];      // pool offsets (elements) of a block's rows
  int64_t offs_at = -1;  // the block whose offsets `offs` holds
  for (int64_t b0 = bl.first(); b0 <= bl.last; b0 += KB) {
    const int nk = bl.keys(b0), qa = bl.qa(b0), qb = bl.qb(b0, nk);
    if (qa >= qb) continue;
    const int ra = qa * G, rb = qb * G;             // the rows that see the block
    const int rA = ra / L * L, rB = (rb + L - 1) / L * L;  // their lanes' vectors
    // the block's K and V, widened; and the next block's offsets
    if (offs_at != b0) bl.offsets(b0, nk, offs);
    for (int k = 0; k < nk; ++k) {
      widen_row<V>(kv.k, offs[k], kv.bf16, d, kb + k * ldd);
      widen_row<V>(kv.v, offs[k], kv.bf16, d, vb + k * ldd);
    }
    Ahead ahead = bl.ahead(b0, offs, offs_at);
    {
      const int tiles = gemm_tiles<V>(rB - rA, 0, nk) + gemm_tiles<V>(d, ra, rb);
      ahead.per = (ahead.lines + tiles - 1) / tiles;
    }
    // logits st[k, rA:rB] of the block's keys
    gemm<V>(kb, {ldd, 1}, qt + rA, ldr, st + rA, ldr, d, rB - rA, 0, nk, nullptr, ahead);
    // masks: a lane outside [ra, rb) or past R sees no key of the block; row r sees [ka, kb)
    const bool full = rA == ra && rB == rb && rb <= R && t.pos0 + qa >= b0 + nk - 1 &&
                      bl.lo(t.pos0 + qb - 1) <= b0;
    const auto masked = [&](auto&& set) {
      for (int r = rA; r < rB; ++r) {
        const auto [ka, kbnd] = r >= ra && r < rb ? bl.visible(b0, nk, t.pos0 + r / G)
                                                  : std::pair<int, int>{0, 0};  // empty
        for (int k = 0; k < ka; ++k) set(st + k * ldr + r);
        for (int k = kbnd; k < nk; ++k) set(st + k * ldr + r);  // all of them when empty
      }
    };
    if (!full) masked([](float* x) { *x = kNegInf; });
    // online softmax, lanes = rows
    for (int r = rA; r < rB; r += L) {
      typename V::T mx = V::load(st + r);
      for (int k = 1; k < nk; ++k) mx = V::max(mx, V::load(st + k * ldr + r));
      const typename V::T mo = V::load(m + r), mn = V::max(mo, mx);
      const typename V::T sub = V::max(mn, lowest);  // not -inf: no inf - inf
      V::store(m + r, mn);
      const typename V::T c = exp_neg<V>(V::sub(mo, sub));  // m = -inf: ~1e-38 times 0
      V::store(corr + r, c);
      if (full) {  // the weights' sum as below, in the same order
        typename V::T w = exp_neg<V>(V::sub(V::load(st + r), sub));
        V::store(st + r, w);
        typename V::T sum = V::fma(V::load(l + r), c, w);
        for (int k = 1; k < nk; ++k) {
          w = exp_neg<V>(V::sub(V::load(st + k * ldr + r), sub));
          V::store(st + k * ldr + r, w);
          sum = V::add(sum, w);
        }
        V::store(l + r, sum);
      } else {
        for (int k = 0; k < nk; ++k)
          V::store(st + k * ldr + r, exp_neg<V>(V::sub(V::load(st + k * ldr + r), sub)));
      }
    }
    if (!full) {
      masked([](float* x) { *x = 0.0f; });
      for (int r = rA; r < rB; r += L) {
        // an explicit fma: a compiler may fuse a separate multiply and add on one path only
        typename V::T sum = V::fma(V::load(l + r), V::load(corr + r), V::load(st + r));
        for (int k = 1; k < nk; ++k) sum = V::add(sum, V::load(st + k * ldr + r));
        V::store(l + r, sum);
      }
    }
    // acc = acc * corr + weights V, for the rows that see the block
    gemm<V>(st, {1, ldr}, vb, ldd, acc, ldd, nk, d, ra, rb, corr, ahead);
    ahead.per = ahead.lines;
    ahead.step();  // what is left
  }
  finish_rows<V>(t, d, R, m, l, acc, ldd);
}

}  // namespace prefill_impl
}  // namespace ftdense

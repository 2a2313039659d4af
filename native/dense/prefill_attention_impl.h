// The body of the prefill attention tile kernel (prefill_attention.h), one template on an ISA's
// vector type. The including file defines FT_TARGET, FT_INLINE and, before including, a struct
// providing:
//   T, kLanes, kRB (rows of a register tile), kNV (vectors of columns of a register tile);
//   zero, set1, load, store, fma (a * b + c), mul, add, sub, max, round (to nearest),
//   pow2 (2^n for integral n in [-126, 127]), widen (L bf16 values -> fp32), transpose (an L x L
//   block of floats, for the few-row kernel of prefill_small_impl.h);
// then calls `prefill_tile<ThatStruct>`. Every lane is computed alone (no horizontal operation),
// so the kernels whose fma is fused (AVX2, AVX-512, emu512) give the same bits.
//
// A struct with kDot = true (the bf16-dot kernels, "avx512bf16" on vdpbf16ps and its plain-C++
// emulation "emubf16"; a bf16 KV pool only) also provides I (L 32-bit words), loadi, dp (c plus a
// broadcast pair of bf16 times each lane's pair, as vdpbf16ps: the odd product added first, then
// the even one, each sum rounded to nearest, denormal inputs and results flushed to zero), bf16r
// (rounds to bf16, nearest even, denormals to zero; the value kept as fp32), pack (two vectors
// of bf16 values -> L pairs, the first in the low half) and interleave (L bf16 of two rows -> L
// pairs). Then both products run on bf16 pairs (prefill_tile below says how); the other structs
// keep the fp32 kernel.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
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
// overflow the miss buffers (most of it dropped). Into L2 (T1), as the decode kernel's: with
// the tiles of one row that decode rows run as (decode_attention.h) a block's compute is short
// and L1 prefetches (T0) evicted lines still in use. Measured on Zen 4, 2 threads, bf16 pool of
// 4 KV heads of d 128 out of cache: a decode row at 32k keys 9.4 -> 5.0-5.4 ms (the fp32 decode
// kernel 5.5), 4 rows at 8k 8.3 -> 5.3-5.4 ms (fp32 5.5); a 8k prompt in chunks of 512 the same
// (bf16-dot 1.61 / 1.63 s, fp32 2.82 / 2.80-2.91 s). No effect on results.
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
      __builtin_prefetch(k + at, 0, 2);
      __builtin_prefetch(v + at, 0, 2);
    }
  }
};

// A of the fp32 gemm: A(i, k) at A[i * as.i + k * as.k].
struct FloatA {
  const float* A;
  AStride as;
  FT_INLINE float at(int i, int k) const { return A[i * as.i + k * as.k]; }
  FT_INLINE FloatA at_row(int r) const { return {A + r * as.i, as}; }
};

// A 32-bit word of bf16 storage (a pair), read through a type that may alias it.
typedef uint32_t __attribute__((may_alias)) PairWord;

// A of the bf16-dot logits: row i is a key's pool row (pairs along the head dim), read in place.
struct KeyRows {
  const PairWord* const* rows;
  FT_INLINE uint32_t at(int i, int k) const { return rows[i][k]; }
  FT_INLINE KeyRows at_row(int r) const { return {rows + r}; }
};

// A of the bf16-dot weighted values: w2 [pairs, ld], row i's pair k at w2[k * ld + i].
struct WeightPairs {
  const uint32_t* w2;
  int64_t ld;
  FT_INLINE uint32_t at(int i, int k) const { return w2[k * ld + i]; }
  FT_INLINE WeightPairs at_row(int r) const { return {w2 + r, ld}; }
};

// One register tile: C = (C * rowscale or 0) + A B. fp32 (B float): fma over k; bf16-dot (B
// 32-bit pairs, A(i, k) a pair): dp over the K pairs. Either way every element is one chain over
// k = 0 .. K-1 in order.
template <class V, int RB, int NV, class A, class BT>
FT_INLINE void gemm_block(const A& a, const BT* B, int64_t ldb, float* C, int64_t ldc, int K,
                          const float* rowscale) {
  constexpr int L = V::kLanes;
  typename V::T c[RB][NV];
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < NV; ++j)
      c[i][j] = rowscale ? V::mul(V::load(C + i * ldc + j * L), V::set1(rowscale[i])) : V::zero();
  for (int k = 0; k < K; ++k) {
    if constexpr (std::is_same_v<BT, float>) {
      typename V::T b[NV];
      for (int j = 0; j < NV; ++j) b[j] = V::load(B + k * ldb + j * L);
      for (int i = 0; i < RB; ++i) {
        const typename V::T x = V::set1(a.at(i, k));
        for (int j = 0; j < NV; ++j) c[i][j] = V::fma(x, b[j], c[i][j]);
      }
    } else {
      typename V::I b[NV];
      for (int j = 0; j < NV; ++j) b[j] = V::loadi(B + k * ldb + j * L);
      for (int i = 0; i < RB; ++i) {
        const uint32_t w = a.at(i, k);
        for (int j = 0; j < NV; ++j) c[i][j] = V::dp(c[i][j], w, b[j]);
      }
    }
  }
  for (int i = 0; i < RB; ++i)
    for (int j = 0; j < NV; ++j) V::store(C + i * ldc + j * L, c[i][j]);
}

// One slab of NV vectors of columns of a gemm: a register tile of N rows at row r.
template <class V, int NV, class A, class BT>
struct SlabOp {
  A a;
  const BT* B;
  int64_t ldb;
  float* C;
  int64_t ldc;
  int K;
  const float* rowscale;
  template <int N>
  FT_INLINE void run(int r) const {
    gemm_block<V, N, NV>(a.at_row(r), B, ldb, C + r * ldc, ldc, K,
                         rowscale ? rowscale + r : nullptr);
  }
};

// The last n < RB rows (n == N, or fewer).
template <class Op, int N>
FT_INLINE void gemm_tail(int n, const Op& op, int r) {
  if constexpr (N > 0) {
    if (n == N) op.template run<N>(r);
    else gemm_tail<Op, N - 1>(n, op, r);
  }
}

// Rows [r0, r1) of one slab of columns.
template <class V, class Op>
FT_INLINE void gemm_rows(const Op& op, int r0, int r1, Ahead& ahead) {
  constexpr int RB = V::kRB;
  // a short ragged end (half a tile's rows or fewer keep too few fma chains in flight) is taken
  // with the last full tile as two tiles of about equal height
  const int n = r1 - r0, full = n / RB - (n % RB && n % RB <= RB / 2 && n > RB ? 1 : 0);
  int r = r0;
  for (const int e = r0 + full * RB; r < e; r += RB) {
    ahead.step();
    op.template run<RB>(r);
  }
  while (r < r1) {
    const int h = r1 - r >= RB ? (r1 - r + 1) / 2 : r1 - r;
    ahead.step();
    gemm_tail<Op, RB - 1>(h, op, r);
    r += h;
  }
}

// Rows [r0, r1) of C = (C * rowscale or 0) + A B over `cols` columns (a multiple of L), column
// slabs outside so a slab of B stays in L1 while every row tile passes over it.
// Steps `ahead` before each register tile.
template <class V, class A, class BT>
FT_INLINE void gemm_any(const A& a, const BT* B, int64_t ldb, float* C, int64_t ldc, int K,
                        int cols, int r0, int r1, const float* rowscale, Ahead& ahead) {
  constexpr int L = V::kLanes, W = V::kNV * L;
  int c = 0;
  for (; c + W <= cols; c += W)
    gemm_rows<V>(SlabOp<V, V::kNV, A, BT>{a, B + c, ldb, C + c, ldc, K, rowscale}, r0, r1, ahead);
  for (; c < cols; c += L)
    gemm_rows<V>(SlabOp<V, 1, A, BT>{a, B + c, ldb, C + c, ldc, K, rowscale}, r0, r1, ahead);
}

// The fp32 gemm: A(i, k) at A[i * as.i + k * as.k], B [K, ldb].
template <class V>
FT_INLINE void gemm(const float* A, AStride as, const float* B, int64_t ldb, float* C,
                    int64_t ldc, int K, int cols, int r0, int r1, const float* rowscale,
                    Ahead& ahead) {
  gemm_any<V>(FloatA{A, as}, B, ldb, C, ldc, K, cols, r0, r1, rowscale, ahead);
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

// A block's weight e^x (x <= 0); rounded to bf16 on the bf16-dot kernels (prefill_tile).
template <class V>
FT_INLINE typename V::T weight(typename V::T x) {
  if constexpr (V::kDot) return V::bf16r(exp_neg<V>(x));
  else return exp_neg<V>(x);
}

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

// bf16 of an fp32 value, rounded to nearest even, denormals (and values that round to one) to a
// signed zero; the bits of the fp32 value with the low half cleared. Finite inputs.
inline uint32_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (u & 0x7f800000u) ? (u & 0xffff0000u) : (u & 0x80000000u);
}

// Layout: query rows r = query i * G + head g sit in the lanes (Rp = R rounded up to L), keys
// in the rows of the logits st [KB, Rp]: a row's max and sum over a block's keys are lane-wise
// sequences over the keys in order, so they do not depend on the vector width either.
//
// The bf16-dot kernels (V::kDot, bf16 pool): the scaled queries are rounded to bf16 once and kept
// as pairs along the head dim (qt2 [d / 2, ldr] words, lanes = rows), and a logit is one chain of
// dp over the pairs in order, each key's pair read as a 32-bit word of its pool row. The weights
// are rounded to bf16 as they are made, and the running sum l adds those rounded weights: the
// output is then acc / l with acc and l sums of the same numbers, a convex combination of the
// values (an unrounded l would scale every row by a bias of up to 2^-9 per weight). The weights
// are packed in pairs of consecutive keys per row (w2 [nk / 2 rounded up, ldr]; an odd block's
// last pair has weight 0 and a zero value row), the block's V rows interleaved in the same pairs
// (vb2 [pairs, ldd]); acc's elements are then one chain of dp over the block's pairs in order.
// Every chain stays a fixed sequence in key / head-dim order, so the batch invariance holds.
template <class V>
FT_TARGET void prefill_tile(const KvPages& kv, const PrefillTile& t) {
  constexpr int L = V::kLanes;
  constexpr bool dot = V::kDot;
  const int d = kv.d, G = t.G, R = t.nq * G, Rp = (R + L - 1) / L * L;
  // row strides: an odd number of 64-byte lines, so a column slab of a GEMM operand (rows of
  // 512 bytes apart otherwise) spreads over all the L1 sets instead of an eighth of them
  const int ldr = padded_stride(Rp), ldd = padded_stride(d);
  thread_local std::vector<float> buf;
  const size_t need = static_cast<size_t>(ldr) * (d + KB) + 3 * static_cast<size_t>(Rp) +
                      static_cast<size_t>(R) * ldd + 2 * static_cast<size_t>(ldd) * KB +
                      (dot ? static_cast<size_t>(ldr) * (KB / 2) : 0);
  if (buf.size() < need) buf.resize(need);
  float* qt = buf.data();     // [d, ldr] scaled queries, transposed (pad rows 0)
  float* acc = qt + ldr * d;  // [R, ldd] weighted values
  float* st = acc + R * ldd;  // [KB, ldr] logits, then weights
  float* kb = st + KB * ldr;  // [KB, ldd] the block's keys
  float* vb = kb + KB * ldd;  // [KB, ldd] the block's values
  float* m = vb + KB * ldd;   // [Rp] running max
  float* l = m + Rp;          // [Rp] running sum
  float* corr = l + Rp;       // [Rp] this block's rescale of acc
  // bf16-dot: qt's space holds qt2, vb's vb2; w2 follows corr
  [[maybe_unused]] uint32_t* qt2 = reinterpret_cast<uint32_t*>(qt);
  [[maybe_unused]] uint32_t* vb2 = reinterpret_cast<uint32_t*>(vb);
  [[maybe_unused]] uint32_t* w2 = reinterpret_cast<uint32_t*>(corr + Rp);
  for (int r = 0; r < Rp; ++r) {
    const float* src = r < R ? t.q + (r / G) * t.row_stride +
                                   static_cast<int64_t>(t.kv_head * G + r % G) * d
                             : nullptr;
    if constexpr (dot) {
      for (int e = 0; e < d; e += 2)
        qt2[e / 2 * ldr + r] = src ? bf16_bits(src[e] * t.scale) >> 16 |
                                         (bf16_bits(src[e + 1] * t.scale) & 0xffff0000u)
                                   : 0u;
    } else {
      for (int e = 0; e < d; ++e) qt[e * ldr + r] = src ? src[e] * t.scale : 0.0f;
    }
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
    // the block's K and V, widened (bf16-dot: K read in place, V interleaved in pairs of keys);
    // and the next block's offsets
    if (offs_at != b0) bl.offsets(b0, nk, offs);
    [[maybe_unused]] const int np = (nk + 1) / 2;  // bf16-dot: pairs of keys
    [[maybe_unused]] const PairWord* krows[KB];
    if constexpr (dot) {
      static const uint16_t zeros[1024] = {};  // d <= 1024 (prefill_supported)
      const uint16_t* kp = static_cast<const uint16_t*>(kv.k);
      const uint16_t* vp = static_cast<const uint16_t*>(kv.v);
      for (int k = 0; k < nk; ++k) krows[k] = reinterpret_cast<const PairWord*>(kp + offs[k]);
      for (int p = 0; p < np; ++p) {
        const uint16_t* v0 = vp + offs[2 * p];
        const uint16_t* v1 = 2 * p + 1 < nk ? vp + offs[2 * p + 1] : zeros;
        for (int e = 0; e < d; e += L) V::interleave(v0 + e, v1 + e, vb2 + p * ldd + e);
      }
    } else {
      for (int k = 0; k < nk; ++k) {
        widen_row<V>(kv.k, offs[k], kv.bf16, d, kb + k * ldd);
        widen_row<V>(kv.v, offs[k], kv.bf16, d, vb + k * ldd);
      }
    }
    Ahead ahead = bl.ahead(b0, offs, offs_at);
    {
      const int tiles = gemm_tiles<V>(rB - rA, 0, nk) + gemm_tiles<V>(d, ra, rb);
      ahead.per = (ahead.lines + tiles - 1) / tiles;
    }
    // logits st[k, rA:rB] of the block's keys
    if constexpr (dot)
      gemm_any<V>(KeyRows{krows}, qt2 + rA, ldr, st + rA, ldr, d / 2, rB - rA, 0, nk, nullptr,
                  ahead);
    else
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
        typename V::T w = weight<V>(V::sub(V::load(st + r), sub));
        V::store(st + r, w);
        typename V::T sum = V::fma(V::load(l + r), c, w);
        for (int k = 1; k < nk; ++k) {
          w = weight<V>(V::sub(V::load(st + k * ldr + r), sub));
          V::store(st + k * ldr + r, w);
          sum = V::add(sum, w);
        }
        V::store(l + r, sum);
      } else {
        for (int k = 0; k < nk; ++k)
          V::store(st + k * ldr + r, weight<V>(V::sub(V::load(st + k * ldr + r), sub)));
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
    if constexpr (dot) {
      for (int p = 0; p < np; ++p)
        for (int r = rA; r < rB; r += L)
          V::pack(V::load(st + 2 * p * ldr + r),
                  2 * p + 1 < nk ? V::load(st + (2 * p + 1) * ldr + r) : V::zero(),
                  w2 + p * ldr + r);
      gemm_any<V>(WeightPairs{w2, ldr}, vb2, ldd, acc, ldd, np, d, ra, rb, corr, ahead);
    } else {
      gemm<V>(st, {1, ldr}, vb, ldd, acc, ldd, nk, d, ra, rb, corr, ahead);
    }
    ahead.per = ahead.lines;
    ahead.step();  // what is left
  }
  finish_rows<V>(t, d, R, m, l, acc, ldd);
}

}  // namespace prefill_impl
}  // namespace ftdense

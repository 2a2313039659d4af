// Sparse decode attention: one query over a chosen set of rows, and the Lightning Indexer's
// scoring and top-k that choose them (DeepSeek Sparse Attention of DeepSeek-V3.2 / GLM-5, and
// DeepSeek-V4's compressed sparse attention; daemon/models/layers/dsa.py, v4_attention.py).
//
// Rows are read in place, bf16 or fp32, from a `RowSource`: a paged pool layer (a position p at
// page table[p / page_size], row p % page_size) or a contiguous tensor (position p at row p),
// starting at a column offset of each row.
//
// Indexer, one query (q [heads, dim], w [heads]) over the keys at positions [0, n):
//
//     score(p) = sum_h w[h] * relu(scale * q[h] . key(p))
//
// then the k best positions, best first; equal scores go to the LOWER position first (the same
// order as compressed.select_topk's stable descending sort).
//
// Attention, one query q [heads, dk] over rows r_0 .. r_{n-1}: keys are the rows' first dk
// columns, values their first dv <= dk columns (one KV head shared by every query head: MLA's
// latent in absorbed form, V4's single K = V head):
//
//     out[h] = sum_j softmax_j(scale * q[h] . r_j[:dk]  (+ the sink logit sinks[h])) r_j[:dv]
//
// the sink's share dropped. All arithmetic in fp32.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pool.h"

namespace ftdense {

struct RowSource {
  const void* base;
  bool bf16;             // else fp32
  int64_t stride;        // elements from one row to the next
  int64_t col;           // the first column used
  const int32_t* table;  // page table, or null: position p is row p
  int page_size;         // with a table
  int64_t num_rows;      // rows the storage holds (pages * page_size with a table)
  int64_t table_len;     // entries of the table (with one)

  // Position p's row at column col, unchecked (`check` first).
  const char* at(int64_t p) const {
    const int64_t r = table ? static_cast<int64_t>(table[p / page_size]) * page_size + p % page_size : p;
    return static_cast<const char*>(base) + (r * stride + col) * (bf16 ? 2 : 4);
  }
  // Throws std::invalid_argument unless positions [p0, p1) are all in the storage.
  void check(int64_t p0, int64_t p1) const;
  // `at` after checking p.
  const char* row(int64_t p) const {
    check(p, p + 1);
    return at(p);
  }
};

// The indexer's scores of n keys: scores[t] = sum_h w[h] * relu(scale * q[h] . keys[t]) for
// t < n, each key's score one fixed chain of fused multiply-adds in its own lane (index_impl.h):
// the same bits on every ISA path and whatever the split of the keys into calls.
using IndexFn = void (*)(const float* q, const float* w, int heads, int dim, float scale,
                         const char* const* keys, bool bf16, int n, float* scores);

// Keys rows[k0, k1) folded into the running softmax states of heads [h0, h1): m [h1 - h0], l
// [h1 - h0], acc [h1 - h0, dv] (fresh: m = -inf, l = 0, acc = 0).
struct SparseQuery {
  const float* q;  // [heads, dk]
  int heads, dk, dv;
  float scale;
};
using SparseFn = void (*)(const SparseQuery& sq, const char* const* rows, bool bf16, int64_t k0,
                          int64_t k1, int h0, int h1, float* m, float* l, float* acc);

struct SparseKernels {
  IndexFn index;
  SparseFn attend;
  const char* name;        // the attention's
  const char* index_name;  // the indexer's
};

// By base ISA name (prefill_kernel_name's: "avx512", "avx2", "emu512", "scalar"). The attention:
// "avx2" / "avx512" the AVX2 + FMA kernel when the CPU has AVX2, as range_kernel picks
// (decode_attention.h), anything else the scalar one; it wants dk / dv % 8 == 0, other shapes
// take the scalar one. The indexer: that ISA's kernel (any dim; "avx512" / "avx2" where the CPU
// runs them, else the scalar one).
const SparseKernels& sparse_kernels(const std::string& isa);

void index_scalar(const float* q, const float* w, int heads, int dim, float scale,
                  const char* const* keys, bool bf16, int n, float* scores);
void index_emu512(const float* q, const float* w, int heads, int dim, float scale,
                  const char* const* keys, bool bf16, int n, float* scores);
void sparse_scalar(const SparseQuery& sq, const char* const* rows, bool bf16, int64_t k0,
                   int64_t k1, int h0, int h1, float* m, float* l, float* acc);
#ifndef FTNATIVE_NO_X86
void index_avx2(const float* q, const float* w, int heads, int dim, float scale,
                const char* const* keys, bool bf16, int n, float* scores);
void index_avx512(const float* q, const float* w, int heads, int dim, float scale,
                  const char* const* keys, bool bf16, int n, float* scores);
// This core's fp32 FMA peak, measured: `iters` rounds of kFmaProbeChains independent 8-lane
// fused multiply-add chains in registers (iters x kFmaProbeChains x 8 multiply-adds; more chains
// than FMA latency x pipes); returns a value that depends on every chain.
constexpr int kFmaProbeChains = 12;
float fma_probe_avx2(int64_t iters);
void sparse_avx2(const SparseQuery& sq, const char* const* rows, bool bf16, int64_t k0,
                 int64_t k1, int h0, int h1, float* m, float* l, float* acc);
#endif

// The indexer over positions [0, n) of `keys` (dim columns from keys.col): the min(k, n) best
// positions into sel, best first (ties: lower position first); scores [n] (or null) gets every
// position's score.
void index_topk(Pool& pool, const SparseKernels& ks, const float* q, const float* w, int heads,
                int dim, float scale, const RowSource& keys, int64_t n, int k, int32_t* sel,
                float* scores);

// Attention of one query over `rows` (pointers to each row's first used column, all bf16 or all
// fp32); out [heads, dv]; sinks [heads] or null.
void sparse_attention(Pool& pool, const SparseKernels& ks, const SparseQuery& sq,
                      const std::vector<const char*>& rows, bool bf16, const float* sinks,
                      float* out);

}  // namespace ftdense

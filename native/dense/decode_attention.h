// Decode attention straight from the paged KV pool: softmax(q K^T * scale) V for single query rows
// (one decode token of each of several sequences), without gathering the pages into a copy.
//
// Pool layout (daemon/kv/pool.py), one layer: K, V [num_pages, page_size, kv_heads, d], bf16 or
// fp32; a sequence's key position p lives in page table[p / page_size], row p % page_size.
// Query row r attends to keys [lo, len_r) with lo = max(0, len_r - window) (window 0: lo = 0),
// i.e. it sits at position len_r - 1 and its own K/V are already in the pool.
//
// GQA: query head h uses KV head h / G (G = heads / kv_heads); the G heads of a group are
// handled together, so every K/V row is read once per KV head. Work is split over the pool as
// (row, kv heads, key range) tasks; each produces an unnormalised partial softmax state (running
// max m, sum l, weighted sum acc over its keys) that the caller merges, adding the optional
// per-head sink logit to the denominator (GPT-OSS). All arithmetic is fp32.
#pragma once

#include <cstdint>
#include <string>

#include "pool.h"

namespace ftdense {

struct KvPages {
  const void* k;  // [num_pages, page_size, kv_heads, d]
  const void* v;
  bool bf16;      // else fp32
  int64_t num_pages;
  int page_size;
  int kv_heads;
  int d;
};

// Keys [k0, k1) of one row and KV head, folded into the running softmax state (m, l, acc) of
// that head's G query heads (a fresh state is m = -inf, l = 0, acc = 0).
struct KeyRange {
  const float* q;        // [G, d], the group's query heads (contiguous in the row)
  int G;
  float scale;
  const int32_t* table;  // the row's page table
  int kv_head;
  int64_t k0, k1;
  float* m;    // [G] in/out: max logit
  float* l;    // [G] in/out: sum of exp(logit - m)
  float* acc;  // [G, d] in/out: sum of exp(logit - m) * v
  int64_t ahead_end;  // keys [k1, ahead_end) come next (the same head, the same task): a kernel
                      // may prefetch them while it works on [k0, k1)
};

using RangeFn = void (*)(const KvPages& kv, const KeyRange& r);

// Range kernels: plain C++, and AVX2+FMA (compiled with target attributes; only when the CPU has
// AVX2, and d % 8 == 0). `range_kernel` picks by ISA name: "avx2" / "avx512" take the AVX2 one,
// anything else ("scalar", "emu512") the scalar one.
void range_scalar(const KvPages& kv, const KeyRange& r);
#ifndef FTNATIVE_NO_X86
void range_avx2(const KvPages& kv, const KeyRange& r);
#endif
RangeFn range_kernel(const std::string& isa);
const char* range_kernel_name(RangeFn fn);

struct DecodeRows {
  const float* q;       // [*, heads, d]; row rows[i] is query i
  float* out;           // [*, heads, d]; written at the same rows
  int64_t q_rows;       // rows of q and out
  int n;                // queries
  const int32_t* rows;  // [n] row indices into q / out
  const int32_t* lens;  // [n] keys of each query's sequence, >= 1
  const int32_t* tables;  // [n, table_stride] page tables (only the first ceil(len / ps) used)
  int64_t table_stride;
  int heads;
  float scale;
  int window;           // 0: none
  const float* sinks;   // [heads] or null
};

// A prefill attention tile kernel (prefill_attention.h).
struct PrefillTile;
using PrefillFn = void (*)(const KvPages& kv, const PrefillTile& t);

// Throws std::invalid_argument on a bad shape, length or page id (checked before any work).
// `prefill`: the configured prefill tile kernel, or null. When it is a bf16-dot one
// (prefill_kernel_dot: cpu_bf16_attention) and the pool is bf16, every query runs as a prompt
// chunk of one row through it instead of `fn` (consecutive rows of one sequence as one chunk):
// the row then gets the bits it gets in any prompt chunk (prefill_attention.h), so the bf16
// roundings of that kernel do not depend on whether a token came in a prompt chunk or a decode
// step, nor on the chunking. Its tasks are (chunk, KV head): a query's keys are not split over
// threads, so one long sequence keeps at most kv_heads threads busy (on 2 threads, 4 KV heads,
// measured as fast as `fn`: prefill_attention_impl.h, Ahead).
void decode_attention(Pool& pool, RangeFn fn, const KvPages& kv, const DecodeRows& rows,
                      PrefillFn prefill = nullptr);

}  // namespace ftdense

// Causal attention of prompt chunks straight from the paged KV pool (flash-attention style):
// for each chunk, query rows at positions [pos, pos + n) of one sequence attend to its keys
// [lo_i, pos + i] (lo_i = max(0, pos + i - window + 1) with a window, else 0), which the caller
// has already written to the pool (the earlier pages and the chunk's own rows). Layout of the
// pool as in decode_attention.h (KvPages); q and out [*, heads, d] fp32.
//
// Work: a task is (chunk, KV head, query tile). It copies its tile's query rows of the G heads
// of that KV head (scaled) once, then walks the keys in blocks of kPrefillKeyBlock positions
// aligned to position 0, in ascending order: each block's K (transposed) and V are widened to
// fp32 once and used by every query row of the tile, the logits and the weighted values are
// register-tiled GEMMs, and each row keeps an online softmax state (max, sum, acc) in fp32.
//
// Batch invariance: a row's result does not depend on the chunk it came in, the tile it sits in,
// the other rows or the thread count. Every logit is one fma chain over the head dim in order;
// a row's blocks are the same key blocks in the same order whatever the tile; within a block its
// masked keys (outside [lo_i, pos + i]) get weight exactly 0 and the block's sum and weighted
// values run in one fixed order over the block's positions, so the keys a tile reads past a
// row's own (for the tile's later rows) add exact zeros; a block that a row does not see at all
// leaves its state unchanged (it is skipped for that row). Prefilling a prompt in any chunking
// therefore gives the same bits as prefilling it whole. A tile of few rows may run the few-row
// kernel instead (keys in the lanes of its logits, prefill_small_impl.h), which keeps every one of
// these operations and their order, so the same bits. Query rows sit in the vector lanes and
// no operation mixes lanes, so the AVX2, AVX-512 and emu512 kernels (fused multiply-adds) give
// the same bits as one another too; the scalar one (separate multiply and add) does not.
#pragma once

#include <cstdint>
#include <string>

#include "decode_attention.h"
#include "pool.h"

namespace ftdense {

constexpr int kPrefillKeyBlock = 64;

// One task: query rows [0, nq) of a chunk's tile, at positions pos0 + i, KV head kv_head.
struct PrefillTile {
  const float* q;        // row 0 of the tile, [nq, heads, d] with rows `row_stride` apart
  float* out;            // the same layout
  int64_t row_stride;    // heads * d
  int nq;
  int64_t pos0;
  int kv_head;
  int G;                 // query heads per KV head; the tile's heads are kv_head * G + [0, G)
  float scale;
  int window;            // 0: none
  const float* sinks;    // [G] sink logits of those heads, or null
  const int32_t* table;  // the sequence's page table
};

// PrefillFn, a tile kernel: decode_attention.h.

// Tile kernels (one body, prefill_attention_impl.h, on each ISA's vectors): plain C++ ("scalar"),
// AVX2+FMA, AVX-512F, and the AVX-512 geometry on emulated 16-lane vectors ("emu512", any CPU).
// All need d % 16 == 0 (`prefill_supported`).
void prefill_tile_scalar(const KvPages& kv, const PrefillTile& t);
void prefill_tile_emu512(const KvPages& kv, const PrefillTile& t);
#ifndef FTNATIVE_NO_X86
void prefill_tile_avx2(const KvPages& kv, const PrefillTile& t);
void prefill_tile_avx512(const KvPages& kv, const PrefillTile& t);
#endif
// The bf16-dot kernels (cpu_bf16_attention: the dense pool's ISA "avx512bf16" configured with
// bf16_attention, or "emubf16" in tests):
// on a bf16 pool both products on bf16 pairs (vdpbf16ps; emubf16 its plain-C++ emulation, the
// same bits), queries and weights rounded to bf16 (prefill_attention_impl.h); every tile takes
// the tile kernel (the few-row one has no bf16-dot form). On a fp32 pool: the avx512 (scalar)
// kernel. Batch invariance as above, and across to the decode attention: given one of these
// kernels, decode_attention runs its rows as chunks of one row through it (decode_attention.h),
// so a token's attention has the same bits in a decode step as in a prompt chunk of any length.
// (The fp32 decode kernel parts from the fp32 prefill ones by fp32 roundings only, ~1e-6; from
// these by the bf16 roundings, ~5e-3 of an output.)
void prefill_tile_emubf16(const KvPages& kv, const PrefillTile& t);
#ifndef FTNATIVE_NO_X86
void prefill_tile_avx512bf16(const KvPages& kv, const PrefillTile& t);
#endif

// Whether a tile runs the few-row kernel (prefill_small_impl.h: keys in the lanes of the logits)
// rather than the tile kernel (query rows in them) on an ISA of `lanes` lanes; both give the same
// bits. Automatic: when the tile's R = nq * G rows fill at most half a vector of the tile kernel
// (measured on Zen 4: the few-row kernel wins there and loses from a full vector on, where it
// does the same arithmetic plus K's transpose and the per-row sums). prefill_small_rows(n >= 0)
// overrides it: tiles of at most n query rows (tests, benchmarks).
void prefill_small_rows(int n);
bool prefill_small_tile(const PrefillTile& t, int lanes);

// The kernel of an ISA name ("avx512bf16", "avx512", "avx2", "emu512", "emubf16", anything else
// scalar), falling back to the best the CPU runs below it; and its name.
PrefillFn prefill_kernel(const std::string& isa);
const char* prefill_kernel_name(PrefillFn fn);
// Whether fn is a bf16-dot kernel (avx512bf16, emubf16).
bool prefill_kernel_dot(PrefillFn fn);

// Head dims the kernels take.
inline bool prefill_supported(int d) { return d > 0 && d % 16 == 0 && d <= 1024; }

struct PrefillChunks {
  const float* q;            // [q_rows, heads, d]
  float* out;                // [q_rows, heads, d]; the chunks' rows are written
  int64_t q_rows;
  int n;                     // chunks
  const int32_t* rows;       // [n] first row of each chunk in q / out
  const int32_t* lens;       // [n] query rows of each chunk, >= 1
  const int32_t* pos;        // [n] position of each chunk's first row (keys before it)
  const int32_t* tables;     // [n, table_stride] page tables covering [0, pos + len)
  int64_t table_stride;
  int heads;
  float scale;
  int window;                // 0: none
  const float* sinks;        // [heads] or null
};

// Throws std::invalid_argument on a bad shape, length, row or page id (before any work).
void prefill_attention(Pool& pool, PrefillFn fn, const KvPages& kv, const PrefillChunks& c);

}  // namespace ftdense

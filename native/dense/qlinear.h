// Dense projections y_i = x W_i^T with block-quantised weights (qdot.h formats): the input rows
// are quantised to int8 once per call (once per activation group the outputs read, qdot.h),
// shared by every weight of the call (q/k/v, gate/up), then integer dot products run over a Pool split by output rows.
//
// Decode (few tokens): each task streams a block of weight rows once. Prefill (many tokens): a
// task walks its rows for one chunk of tokens at a time, so each weight row is read from memory
// once per chunk and reused from L1 by every token of the chunk, and the chunk's quantised
// activations stay in L2.
#pragma once

#include <cstdint>
#include <vector>

#include "pool.h"
#include "qdot.h"

namespace ftdense {

struct QOutput {
  const uint8_t* w;  // [N] rows of qrow_bytes(type, K) bytes
  int N;
  QType type;
  float* y;  // [T, N]
};

// x [T, K] fp32 (K a multiple of every output's block size; checked by the caller).
void qlinear(Pool& pool, const QDotSet& ks, const float* x, int T, int K,
             const std::vector<QOutput>& outs);

// The activation quantisation of qdot.h on T rows (q [T*K], d and s [T*K/32]) in groups of
// `group` inputs (32 or 256, K a multiple of it).
void quantize_rows(Pool& pool, const QDotSet& ks, const float* x, int T, int K, int group,
                   int8_t* q, float* d, int16_t* s);

// Rows [rows, qrow_bytes(base, K)] of Q4_K or Q6_K (base) in the interleaved layout of qdot.h
// (whole groups of 8, the last rows % 8 copied as they are) from the plain rows, or back with
// undo; src and dst do not overlap. simd: AVX2 transposes where the CPU has them (the same
// bytes), else the scalar moves.
void qinterleave(QType base, const uint8_t* src, uint8_t* dst, int64_t rows, int K, bool undo,
                 bool simd = true);

}  // namespace ftdense

// How the integer-dot callers (qlinear.cpp, qmoe.cpp) cut weight rows into pool tasks and start
// each task's weight stream: one prefetch distance for the kernels and their callers, the task
// sizing rule, and the prefetch of a stream's first lines.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace ftdense {

// Weight bytes requested ahead of what a kernel reads (qdot_simd_x8.h's kernels, qlinear.cpp's
// plain rows), into L2 (prefetcht1), not L1: an L1 prefetch holds one of the core's few L1 miss
// slots until its line lands, an L2 one lets more lines be in flight. AMD EPYC (Zen 4) VM, 2
// threads, T = 1 from DRAM (bench_qlinear.py, 4096 x 4096), time over the bf16 gemv's in the
// same run, two builds alternated twice: into L1 4 KiB ahead q4_k 0.45/0.50x, q6_k 0.59/0.69x,
// q8_0 1.06/1.10x; into L2 8 KiB ahead 0.36/0.35x, 0.44/0.46x, 0.61/0.66x; decode of the Q4_K_M
// benchmark file in the same runs 14.2/11.2 -> 12.2/10.7 ms/token. Into L2, 4 and 8 KiB ahead
// measured alike. (Sapphire Rapids, into L1: 2.3, 4 and 8 KiB alike.)
constexpr int64_t kStreamAheadBytes = 8192;

// The line at p of a weight stream, requested ahead into L2 (kStreamAheadBytes says why).
inline void prefetch_ahead(const void* p) { __builtin_prefetch(p, 0, 2); }

// The lines from ``ahead`` up to ``want`` requested (prefetch_ahead), ``ahead`` moved past them:
// a stream kept kStreamAheadBytes ahead of what is computed as the caller sets ``want``.
inline void prefetch_until(const uint8_t*& ahead, const uint8_t* want) {
  for (; ahead < want; ahead += 64) prefetch_ahead(ahead);
}

// Tasks a pool thread should get at least: enough to even out threads that start late.
constexpr int kTasksPerThread = 4;

// The first of ``sizes`` (largest first) for which ``tasks(size)`` >= ``want``; the last one
// when none reaches it. A task's rows are one sequential stream whose start costs memory
// latency, so the fewest tasks that still keep every thread busy read fastest.
template <size_t N, class TasksFn>
int task_rows(const int (&sizes)[N], int64_t want, TasksFn tasks) {
  for (const int r : sizes)
    if (tasks(r) >= want) return r;
  return sizes[N - 1];
}

// The lines of [p, min(end, p + kStreamAheadBytes)): a stream's start, which the kernels'
// own prefetch (kStreamAheadBytes past what they read) never covers. Locality 3 for a stream
// read next, 2 (into L2) for one read after another.
template <int Locality>
inline void prefetch_stream_start(const uint8_t* p, const uint8_t* end) {
  for (const uint8_t* q = p; q < std::min(end, p + kStreamAheadBytes); q += 64)
    __builtin_prefetch(q, 0, Locality);
}

// Fewest plain rows a task splits into two streams (two_streams).
constexpr int kTwoStreamRows = 16;

// Plain rows [0, rows) (``rb`` bytes each from ``w``) for one token as two streams: row i of
// each half in turn, each half's lines requested kStreamAheadBytes ahead (into L2); ``row(r)``
// computes row r. A core reads two sequential streams faster than one (the interleaved
// kernels' pair calls, qdot_simd_x8.h). Decode of the Q8_0 benchmark file, 2 threads, Sapphire
// Rapids: 27.0 -> 20.7 ms/token, the block MoE's plain rows (no prefetch before) 14.8 -> 9.0 ms,
// lm_head 6.3 -> 5.5 ms.
template <class RowFn>
inline void two_streams(int rows, const uint8_t* w, int64_t rb, RowFn&& row) {
  const int h = rows / 2;
  const int start[2] = {0, h}, stop[2] = {h, rows};
  const uint8_t* ahead[2] = {w, w + h * rb};
  for (int i = 0; i < rows - h; ++i)
    for (int s = 0; s < 2; ++s) {
      const int r = start[s] + i;
      if (r >= stop[s]) continue;
      const uint8_t* want = std::min(w + stop[s] * rb, w + (r + 1) * rb + kStreamAheadBytes);
      prefetch_until(ahead[s], want);
      row(r);
    }
}

}  // namespace ftdense

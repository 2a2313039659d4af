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

// How far ahead the interleaved kernels (qdot_simd_x8.h's x8_run) request their weight bytes,
// the G groups of a call read side by side taken as one region requested linearly. Farther than
// the plain rows' distance: a call of two groups reads 18-27 KiB (K = 2048) as two streams, and
// at 8 KiB ahead the requests did not keep the reads from stalling. AMD EPYC (Zen 4) VM, the
// pair kernels alone over 400 MB of groups (K = 2048), two processes at once (one per core),
// GB/s per process, two passes: 8 KiB ahead Q4_K 12.0-12.9, Q6_K 12.1-13.4; 16 KiB 14.1-17.3,
// 13.6-16.9; 24 KiB 13.4-18.3, 10.2-21.0; 32 KiB 15.1-20.0, 15.6-22.5; 48 and 64 KiB no better
// and less steady. (Each group's stream 16 KiB ahead in its own order, group g of the next
// call following group g of this one: Q4_K 13.9-14.8, Q6_K 11.8-15.4, below the linear
// request at 16 KiB.)
constexpr int64_t kX8AheadBytes = 32768;

// The weight stream the interleaved kernels are reading, as their caller names it: x8_run's
// requests that would pass ``end`` go as far past the start of ``next`` (the stream the caller
// reads after this one) while they stay inside it, and nowhere after that, instead of into
// bytes nobody reads next (another task's rows, an expert not routed). Per thread, set for a
// span of calls by X8StreamScope; with none set (end null) requests go where they point.
// ``none``: the kernels request nothing (x8_single_stream below).
struct X8Stream {
  uintptr_t end = 0, next = 0, next_end = 0;
  bool none = false;
};
inline thread_local X8Stream tl_x8_stream;

class X8StreamScope {
 public:
  X8StreamScope(const uint8_t* end, const uint8_t* next, const uint8_t* next_end,
                bool none = false)
      : saved_(tl_x8_stream) {
    tl_x8_stream = {reinterpret_cast<uintptr_t>(end), reinterpret_cast<uintptr_t>(next),
                    reinterpret_cast<uintptr_t>(next_end), none};
  }
  ~X8StreamScope() { tl_x8_stream = saved_; }
  X8StreamScope(const X8StreamScope&) = delete;
  X8StreamScope& operator=(const X8StreamScope&) = delete;

 private:
  X8Stream saved_;
};

// Where the request for the line at address p goes under stream ``s`` (see X8Stream): p, its
// place in the next stream, or 0 (no request).
inline uintptr_t x8_request(const X8Stream& s, uintptr_t p) {
  if (s.none) return 0;
  if (s.end == 0 || p < s.end) return p;
  const uintptr_t q = s.next + (p - s.end);
  return s.next != 0 && q < s.next_end ? q : 0;
}

// How the callers read interleaved weights for one token (qlinear.cpp, qmoe.cpp). Single: one
// group a call, nothing requested by the kernels or their callers, the hardware prefetchers
// following one sequential stream. Otherwise: two groups side by side (the pair kernels) with
// the requests above. AMD EPYC (Zen 4) VM, T = 1 from DRAM, the modes alternated in one process
// over 400 MB of weights (K = 2048), single over pair, 2 threads: Q4_K 1.08-1.10x, Q6_K
// 1.16-1.17x, Q8_0 1.07-1.10x, MXFP4 1.12x; 1 thread: Q4_K 1.34x, Q6_K 1.40x (pair without the
// requests: 0.55-0.82x, single with them: 1.00-1.25x); decode of the benchmark's GGUF files,
// alternated per 48 tokens, same tokens: Q4_K_M 1.09x, Q5_K_M 1.08x, Q8_0 1.06x, MXFP4 1.05x.
// The AVX2 kernels (no pair kernels: the requests alone) on the same VM, 2 threads: Q4_K 1.05x,
// Q6_K 1.08x without them.
// Pairs were measured 1.13x over single groups (both with requests, 1 thread) on a Sapphire
// Rapids VM, where one core read one stream at about 10 GB/s. On an AVX2-only AMD EPYC (Zen 3)
// VM the requests won instead (the AVX2 kernels, 2 threads, modes alternated in one process over
// the Q4_K_M benchmark file's real routes, medians of 16, machine shared): routed experts at 1
// token 1.06x, at 4 tokens 1.12x, its Q6_K lm_head 1.12x / 1.05x. So "auto" takes single on AMD
// CPUs with AVX-512 (Zen 4 and later) and the requests elsewhere; set_x8_streams chooses
// (ftdense.x8_streams).
enum class X8Streams { kAuto, kPair, kSingle };
void set_x8_streams(X8Streams mode);
bool x8_single_stream();  // the mode in force ("auto" resolved by the CPU's vendor)

// Whether a caller starts a weight stream of rows read ``rows_per_call`` a kernel call with
// prefetch_stream_start (below): plain rows (1) always, interleaved ones (8) unless single.
inline bool starts_stream(int rows_per_call) {
  return rows_per_call == 1 || !x8_single_stream();
}

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

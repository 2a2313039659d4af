// How the integer-dot callers (qlinear.cpp, qmoe.cpp) cut weight rows into pool tasks and start
// each task's weight stream: one prefetch distance for the kernels and their callers, the task
// sizing rule, and the prefetch of a stream's first lines.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace ftdense {

// Weight bytes requested ahead of what a kernel reads (qdot_simd_x8.h's kernels, qlinear.cpp's
// plain rows): 2.3, 4 and 8 KiB measured alike on 2 threads from DRAM, 12 KiB the same as 4.
constexpr int64_t kStreamAheadBytes = 4096;

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

}  // namespace ftdense

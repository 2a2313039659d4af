// The pool tasks of the dense projections (dense_linear.h), shared by the fp32-FMA kernels
// (dense_linear.cpp) and the bf16-dot ones (dense_linear_bf16.cpp): each output's rows are split
// into tasks; few tokens stream weight rows against every token (gemv), many take 16-token
// panels (tile) in chunks of blocks that stay in L2. A file prepares its inputs (`xbuf`, `xs`,
// `block`, `chunk_blocks`) in its own layout, then calls `run`.
#pragma once

#include <cstdint>
#include <vector>

#include "dense_linear.h"

namespace ftdense::tasks {

constexpr int kGemvRows = 256;     // rows per gemv task
constexpr int kTileRowsTask = 64;  // rows per tile task; stay in L2 across chunks

// KS: the kernel set (gemv, tile); X: the prepared input's element; W: what a weight row
// pointer is to the kernels (char for raw bytes, uint16_t for bf16).
template <class KS, class X, class W>
struct Job {
  const KS* ks = nullptr;
  Input in{};
  const std::vector<Output>* outs = nullptr;
  std::vector<int64_t> first_task;  // per output, then the total
  int rows_per_task = 0;
  int64_t row_bytes = 0;  // one weight row
  std::vector<X> xbuf;    // gemv: the token rows; tile: [nb] panel blocks of `block` elements
  std::vector<const X*> xs;  // gemv: each token's row
  int nb = 0;                // tile: 16-token blocks
  int chunk_blocks = 1;      // tile: blocks per token chunk
  int64_t block = 0;         // tile: elements per panel block
};

// Output index and its first row for task t.
template <class J>
void locate(const J& j, int64_t t, size_t& o, int& r0) {
  o = 0;
  while (t >= j.first_task[o + 1]) ++o;
  r0 = static_cast<int>(t - j.first_task[o]) * j.rows_per_task;
}

template <class W, class J>
const W* wrow(const J& j, const Output& out, int64_t r) {
  return reinterpret_cast<const W*>(static_cast<const char*>(out.w) + r * j.row_bytes);
}

template <class J, class W>
void gemv_task(void* ctx, int64_t t) {
  const J& j = *static_cast<const J*>(ctx);
  size_t o;
  int r0;
  locate(j, t, o, r0);
  const Output& out = (*j.outs)[o];
  const int rows = out.N - r0 < kGemvRows ? out.N - r0 : kGemvRows;
  j.ks->gemv(wrow<W>(j, out, r0), j.in.K, rows, j.in.K, j.xs.data(), j.in.T, out.y + r0, out.N);
}

template <class J, class W>
void tile_task(void* ctx, int64_t t) {
  const J& j = *static_cast<const J*>(ctx);
  size_t o;
  int r0;
  locate(j, t, o, r0);
  const Output& out = (*j.outs)[o];
  const int K = j.in.K, N = out.N, T = j.in.T;
  const int rows = N - r0 < kTileRowsTask ? N - r0 : kTileRowsTask;
  thread_local std::vector<float> tmp;  // [chunk blocks][rows][16]
  tmp.resize(static_cast<size_t>(j.chunk_blocks) * kTileRowsTask * ftnative::kTileLanes);
  for (int b0 = 0; b0 < j.nb; b0 += j.chunk_blocks) {
    const int nbc = j.nb - b0 < j.chunk_blocks ? j.nb - b0 : j.chunk_blocks;
    j.ks->tile(wrow<W>(j, out, r0), K, rows, K, j.xbuf.data() + b0 * j.block, nbc, tmp.data());
    for (int b = 0; b < nbc; ++b)
      for (int lane = 0; lane < ftnative::kTileLanes; ++lane) {
        const int tok = (b0 + b) * ftnative::kTileLanes + lane;
        if (tok >= T) break;
        float* yr = out.y + static_cast<int64_t>(tok) * N + r0;
        const float* src =
            tmp.data() + static_cast<int64_t>(b) * rows * ftnative::kTileLanes + lane;
        for (int r = 0; r < rows; ++r) yr[r] = src[r * ftnative::kTileLanes];
      }
  }
}

// The tasks over every output's rows, on the pool (inputs prepared: gemv below
// kTileMinTokens tokens, tile from there).
template <class J, class W>
void run(Pool& pool, J& j) {
  j.first_task.assign(1, 0);
  for (const Output& o : *j.outs)
    j.first_task.push_back(j.first_task.back() + (o.N + j.rows_per_task - 1) / j.rows_per_task);
  pool.run(j.in.T < kTileMinTokens ? gemv_task<J, W> : tile_task<J, W>, &j, j.first_task.back());
}

}  // namespace ftdense::tasks

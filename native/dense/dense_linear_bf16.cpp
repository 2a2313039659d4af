#include "dense_linear_bf16.h"

#include "cpu_features.h"

namespace ftdense {

using ftnative::Bf16DotSet;
using ftnative::kTileLanes;

namespace {

// As dense_linear.cpp: few tokens stream rows (gemv), many take 16-token panels (tile).
constexpr int kGemvRows = 256;
constexpr int kTileRowsTask = 64;
constexpr int64_t kPanelBytes = 256 << 10;  // bf16 panel chunk (half the bytes of fp32's)

struct Job {
  const Bf16DotSet* ks;
  Input in;
  const std::vector<Output>* outs;
  std::vector<int64_t> first_task;
  int rows_per_task = 0;
  std::vector<uint16_t> xbuf;       // gemv: [T][K] bf16; tile: [nb][Kp / 2][16][2] pairs
  std::vector<const uint16_t*> xs;  // gemv rows
  int nb = 0;
  int chunk_blocks = 1;
  int64_t block = 0;  // tile: elements per panel block
};

void locate(const Job& j, int64_t t, size_t& o, int& r0) {
  o = 0;
  while (t >= j.first_task[o + 1]) ++o;
  r0 = static_cast<int>(t - j.first_task[o]) * j.rows_per_task;
}

const uint16_t* wrow(const Job& j, const Output& out, int64_t r) {
  return static_cast<const uint16_t*>(out.w) + r * j.in.K;
}

void gemv_task(void* ctx, int64_t t) {
  const Job& j = *static_cast<const Job*>(ctx);
  size_t o;
  int r0;
  locate(j, t, o, r0);
  const Output& out = (*j.outs)[o];
  const int rows = out.N - r0 < kGemvRows ? out.N - r0 : kGemvRows;
  j.ks->gemv(wrow(j, out, r0), j.in.K, rows, j.in.K, j.xs.data(), j.in.T, out.y + r0, out.N);
}

void tile_task(void* ctx, int64_t t) {
  const Job& j = *static_cast<const Job*>(ctx);
  size_t o;
  int r0;
  locate(j, t, o, r0);
  const Output& out = (*j.outs)[o];
  const int K = j.in.K, N = out.N, T = j.in.T;
  const int rows = N - r0 < kTileRowsTask ? N - r0 : kTileRowsTask;
  thread_local std::vector<float> tmp;  // [chunk blocks][rows][16]
  tmp.resize(static_cast<size_t>(j.chunk_blocks) * kTileRowsTask * kTileLanes);
  for (int b0 = 0; b0 < j.nb; b0 += j.chunk_blocks) {
    const int nbc = j.nb - b0 < j.chunk_blocks ? j.nb - b0 : j.chunk_blocks;
    j.ks->tile(wrow(j, out, r0), K, rows, K, j.xbuf.data() + b0 * j.block, nbc, tmp.data());
    for (int b = 0; b < nbc; ++b)
      for (int lane = 0; lane < kTileLanes; ++lane) {
        const int tok = (b0 + b) * kTileLanes + lane;
        if (tok >= T) break;
        float* yr = out.y + static_cast<int64_t>(tok) * N + r0;
        const float* src = tmp.data() + static_cast<int64_t>(b) * rows * kTileLanes + lane;
        for (int r = 0; r < rows; ++r) yr[r] = src[r * kTileLanes];
      }
  }
}

void prepare_gemv(Job& j) {
  const Input& in = j.in;
  j.xbuf.resize(static_cast<size_t>(in.T) * in.K);
  ftnative::to_bf16(in.x, j.xbuf.data(), static_cast<int64_t>(in.T) * in.K);
  j.xs.resize(in.T);
  for (int t = 0; t < in.T; ++t) j.xs[t] = j.xbuf.data() + static_cast<int64_t>(t) * in.K;
  j.rows_per_task = kGemvRows;
}

void prepare_tile(Job& j) {
  const Input& in = j.in;
  const int64_t kp = in.K + (in.K & 1);
  j.nb = (in.T + kTileLanes - 1) / kTileLanes;
  j.block = kp * kTileLanes;
  j.xbuf.assign(static_cast<size_t>(j.nb) * j.block, 0);  // padding tokens and the odd pad: 0
  for (int t = 0; t < in.T; ++t) {
    uint16_t* blk = j.xbuf.data() + (t / kTileLanes) * j.block;
    const float* xr = in.x + static_cast<int64_t>(t) * in.K;
    for (int k = 0; k < in.K; ++k)
      blk[ftnative::pair_panel_index(k, t % kTileLanes)] = ftnative::to_bf16(xr[k]);
  }
  const int64_t chunk = kPanelBytes / (j.block * static_cast<int64_t>(sizeof(uint16_t)));
  j.chunk_blocks = chunk > 1 ? static_cast<int>(chunk) : 1;
  j.rows_per_task = kTileRowsTask;
}

}  // namespace

const Bf16DotSet* bf16dot_set(const std::string& isa) {
  const std::string pick = isa == "auto" ? ftnative::supported_isas().front() : isa;
  if (pick == "emubf16") return &ftnative::kScalarBf16Dot;
#ifndef FTNATIVE_NO_X86
  if (pick == "avx512bf16" && ftnative::isa_supported(pick)) return &ftnative::kAvx512Bf16Dot;
#endif
  return nullptr;
}

void linear_bf16dot(Pool& pool, const Bf16DotSet& ks, const Input& in,
                    const std::vector<Output>& outs) {
  if (in.T <= 0 || outs.empty()) return;
  Job j;
  j.ks = &ks;
  j.in = in;
  j.outs = &outs;
  if (in.T < kTileMinTokens) prepare_gemv(j);
  else prepare_tile(j);
  j.first_task.push_back(0);
  for (const Output& o : outs)
    j.first_task.push_back(j.first_task.back() + (o.N + j.rows_per_task - 1) / j.rows_per_task);
  pool.run(in.T < kTileMinTokens ? gemv_task : tile_task, &j, j.first_task.back());
}

}  // namespace ftdense

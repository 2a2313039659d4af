#include "dense_linear_bf16.h"

#include "cpu_features.h"
#include "dense_tasks.h"

namespace ftdense {

using ftnative::Bf16DotSet;
using ftnative::kTileLanes;

namespace {

// The tasks of dense_tasks.h; the inputs in bf16 (gemv: [T][K]; tile: [nb][Kp / 2][16][2]
// pairs), the weight rows bf16.
constexpr int64_t kPanelBytes = 256 << 10;  // bf16 panel chunk (half the bytes of fp32's)

using Job = tasks::Job<Bf16DotSet, uint16_t, uint16_t>;

void prepare_gemv(Job& j) {
  const Input& in = j.in;
  j.xbuf.resize(static_cast<size_t>(in.T) * in.K);
  ftnative::to_bf16(in.x, j.xbuf.data(), static_cast<int64_t>(in.T) * in.K);
  j.xs.resize(in.T);
  for (int t = 0; t < in.T; ++t) j.xs[t] = j.xbuf.data() + static_cast<int64_t>(t) * in.K;
  j.rows_per_task = tasks::kGemvRows;
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
  j.rows_per_task = tasks::kTileRowsTask;
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
  j.row_bytes = static_cast<int64_t>(in.K) * 2;
  if (in.T < kTileMinTokens) prepare_gemv(j);
  else prepare_tile(j);
  tasks::run<Job, uint16_t>(pool, j);
}

void linear_any(Pool& pool, const ftnative::KernelSet& ks, const Bf16DotSet* dot,
                const Input& in, const std::vector<Output>& outs) {
  if (dot && in.bf16 && in.round_input) linear_bf16dot(pool, *dot, in, outs);
  else linear(pool, ks, in, outs);
}

}  // namespace ftdense

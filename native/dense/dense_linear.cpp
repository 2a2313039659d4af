#include "dense_linear.h"

#include <cstring>
#include <stdexcept>

#include "cpu_features.h"

namespace ftdense {

using ftnative::KernelSet;
using ftnative::kTileLanes;

namespace {

constexpr int kGemvRows = 256;               // rows per gemv task: 8 streams x 32 rows
constexpr int kTileRowsTask = 64;            // rows per tile task; stay in L2 across chunks
constexpr int64_t kPanelBytes = 512 << 10;   // a token chunk's panel is sized to stay in L2

inline float round_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  if ((b & 0x7F800000u) != 0x7F800000u) b += 0x7FFFu + ((b >> 16) & 1u);  // nearest even
  b &= 0xFFFF0000u;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

struct Job {
  const KernelSet* ks;
  Input in;
  const std::vector<Output>* outs;
  std::vector<int64_t> first_task;  // per output, then the total
  int rows_per_task = 0;
  int64_t esize = 0;                // weight element bytes
  std::vector<float> xbuf;          // gemv: de-interleaved inputs; tile: [nb][K][16] panel
  std::vector<const float*> xs;     // gemv input pointers
  int nb = 0;                       // tile: 16-token blocks
  int chunk_blocks = 1;             // tile: blocks per token chunk
};

// Output index and its first row for task t.
void locate(const Job& j, int64_t t, size_t& o, int& r0) {
  o = 0;
  while (t >= j.first_task[o + 1]) ++o;
  r0 = static_cast<int>(t - j.first_task[o]) * j.rows_per_task;
}

const char* wrow(const Job& j, const Output& out, int64_t r) {
  return static_cast<const char*>(out.w) + r * j.in.K * j.esize;
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
    j.ks->tile(wrow(j, out, r0), K, rows, K,
               j.xbuf.data() + static_cast<int64_t>(b0) * K * kTileLanes, nbc, tmp.data());
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

float load_x(const Input& in, int64_t t, int64_t k) {
  const float v = in.x[t * in.K + k];
  return in.round_input ? round_bf16(v) : v;
}

void prepare_gemv(Job& j) {
  const Input& in = j.in;
  j.xbuf.resize(static_cast<size_t>(in.T) * in.K);
  j.xs.resize(in.T);
  for (int t = 0; t < in.T; ++t) {
    float* dst = j.xbuf.data() + static_cast<int64_t>(t) * in.K;
    for (int k = 0; k < in.K; ++k)
      dst[ftnative::shuffle_index(k, in.K, j.ks->chunk)] = load_x(in, t, k);
    j.xs[t] = dst;
  }
  j.rows_per_task = kGemvRows;
}

void prepare_tile(Job& j) {
  const Input& in = j.in;
  j.nb = (in.T + kTileLanes - 1) / kTileLanes;
  j.xbuf.assign(static_cast<size_t>(j.nb) * in.K * kTileLanes, 0.0f);
  for (int t = 0; t < in.T; ++t) {
    float* blk =
        j.xbuf.data() + static_cast<int64_t>(t / kTileLanes) * in.K * kTileLanes + t % kTileLanes;
    for (int k = 0; k < in.K; ++k) blk[static_cast<int64_t>(k) * kTileLanes] = load_x(in, t, k);
  }
  const int64_t chunk = kPanelBytes / (static_cast<int64_t>(in.K) * kTileLanes * sizeof(float));
  j.chunk_blocks = chunk > 1 ? static_cast<int>(chunk) : 1;
  j.rows_per_task = kTileRowsTask;
}

}  // namespace

const KernelSet& kernel_set(const std::string& isa, bool bf16) {
  std::string pick = isa == "auto" ? ftnative::supported_isas().front() : isa;
  // the fp32-FMA kernels of the bf16-dot ISAs (dense_linear_bf16.h takes their bf16 weights)
  if (pick == "emubf16") pick = "scalar";
  if (pick == "avx512bf16" && ftnative::isa_supported(pick)) pick = "avx512";
  if (pick == "emu512") return bf16 ? ftnative::kEmu512Bf16 : ftnative::kEmu512F32;
  if (pick != "scalar" && !ftnative::isa_supported(pick))
    throw std::invalid_argument("this CPU cannot run the '" + pick + "' kernels");
#ifndef FTNATIVE_NO_X86
  if (pick == "avx512") return bf16 ? ftnative::kAvx512Bf16 : ftnative::kAvx512F32;
  if (pick == "avx2") return bf16 ? ftnative::kAvx2Bf16 : ftnative::kAvx2F32;
#endif
  if (pick != "scalar") throw std::invalid_argument("unknown ISA '" + pick + "'");
  return bf16 ? ftnative::kScalarBf16 : ftnative::kScalarF32;
}

void linear(Pool& pool, const KernelSet& ks, const Input& in, const std::vector<Output>& outs) {
  if (in.T <= 0 || outs.empty()) return;
  Job j;
  j.ks = &ks;
  j.in = in;
  j.outs = &outs;
  j.esize = in.bf16 ? 2 : 4;
  if (in.T < kTileMinTokens) prepare_gemv(j);
  else prepare_tile(j);
  j.first_task.push_back(0);
  for (const Output& o : outs)
    j.first_task.push_back(j.first_task.back() + (o.N + j.rows_per_task - 1) / j.rows_per_task);
  pool.run(in.T < kTileMinTokens ? gemv_task : tile_task, &j, j.first_task.back());
}

}  // namespace ftdense

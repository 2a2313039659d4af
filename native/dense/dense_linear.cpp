#include "dense_linear.h"

#include <cstring>
#include <stdexcept>
#include <vector>

#include "cpu_features.h"

namespace ftdense {

using ftnative::KernelSet;
using ftnative::kTileLanes;

namespace {

constexpr int kGemvRows = 256;    // rows per gemv task: 8 streams x 32 rows (kernels_simd.h)
constexpr int kTileRowsTask = 64;  // rows per tile task; their weights stay in L2 across chunks
constexpr int64_t kPanelBytes = 512 << 10;  // a token chunk's panel is sized to stay in L2

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
  LinearArgs a;
  int64_t esize;                   // weight element bytes
  std::vector<float> xbuf;         // gemv: de-interleaved inputs; tile: [nb][K][16] panel
  std::vector<const float*> xs;    // gemv input pointers
  int nb = 0;                      // tile: 16-token blocks
  int chunk_blocks = 1;            // tile: blocks per token chunk
  int64_t tasks = 0;
};

const char* wrow(const Job& j, int64_t r) {
  return static_cast<const char*>(j.a.w) + r * j.a.K * j.esize;
}

void gemv_task(void* ctx, int64_t t) {
  const Job& j = *static_cast<const Job*>(ctx);
  const int r0 = static_cast<int>(t) * kGemvRows;
  const int rows = j.a.N - r0 < kGemvRows ? j.a.N - r0 : kGemvRows;
  j.ks->gemv(wrow(j, r0), j.a.K, rows, j.a.K, j.xs.data(), j.a.T, j.a.y + r0, j.a.N);
}

void tile_task(void* ctx, int64_t t) {
  const Job& j = *static_cast<const Job*>(ctx);
  const int K = j.a.K, N = j.a.N, T = j.a.T;
  const int r0 = static_cast<int>(t) * kTileRowsTask;
  const int rows = N - r0 < kTileRowsTask ? N - r0 : kTileRowsTask;
  thread_local std::vector<float> out;  // [chunk blocks][rows][16]
  out.resize(static_cast<size_t>(j.chunk_blocks) * kTileRowsTask * kTileLanes);
  for (int b0 = 0; b0 < j.nb; b0 += j.chunk_blocks) {
    const int nbc = j.nb - b0 < j.chunk_blocks ? j.nb - b0 : j.chunk_blocks;
    j.ks->tile(wrow(j, r0), K, rows, K, j.xbuf.data() + static_cast<int64_t>(b0) * K * kTileLanes,
               nbc, out.data());
    for (int b = 0; b < nbc; ++b)
      for (int lane = 0; lane < kTileLanes; ++lane) {
        const int tok = (b0 + b) * kTileLanes + lane;
        if (tok >= T) break;
        float* yr = j.a.y + static_cast<int64_t>(tok) * N + r0;
        const float* src = out.data() + static_cast<int64_t>(b) * rows * kTileLanes + lane;
        for (int r = 0; r < rows; ++r) yr[r] = src[r * kTileLanes];
      }
  }
}

float load_x(const LinearArgs& a, int64_t t, int64_t k) {
  const float v = a.x[t * a.K + k];
  return a.round_input ? round_bf16(v) : v;
}

void prepare_gemv(Job& j) {
  const LinearArgs& a = j.a;
  j.xbuf.resize(static_cast<size_t>(a.T) * a.K);
  j.xs.resize(a.T);
  for (int t = 0; t < a.T; ++t) {
    float* dst = j.xbuf.data() + static_cast<int64_t>(t) * a.K;
    for (int k = 0; k < a.K; ++k) dst[ftnative::shuffle_index(k, a.K, j.ks->chunk)] = load_x(a, t, k);
    j.xs[t] = dst;
  }
  j.tasks = (a.N + kGemvRows - 1) / kGemvRows;
}

void prepare_tile(Job& j) {
  const LinearArgs& a = j.a;
  j.nb = (a.T + kTileLanes - 1) / kTileLanes;
  j.xbuf.assign(static_cast<size_t>(j.nb) * a.K * kTileLanes, 0.0f);
  for (int t = 0; t < a.T; ++t) {
    float* blk = j.xbuf.data() + static_cast<int64_t>(t / kTileLanes) * a.K * kTileLanes + t % kTileLanes;
    for (int k = 0; k < a.K; ++k) blk[static_cast<int64_t>(k) * kTileLanes] = load_x(a, t, k);
  }
  const int64_t block_bytes = static_cast<int64_t>(a.K) * kTileLanes * sizeof(float);
  j.chunk_blocks = static_cast<int>(kPanelBytes / block_bytes) > 1 ? static_cast<int>(kPanelBytes / block_bytes) : 1;
  j.tasks = (a.N + kTileRowsTask - 1) / kTileRowsTask;
}

}  // namespace

const KernelSet& kernel_set(const std::string& isa, bool bf16) {
  const std::string pick = isa == "auto" ? ftnative::supported_isas().front() : isa;
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

void linear(Pool& pool, const KernelSet& ks, const LinearArgs& a) {
  if (a.T <= 0 || a.N <= 0) return;
  Job j;
  j.ks = &ks;
  j.a = a;
  j.esize = a.bf16 ? 2 : 4;
  if (a.T < kTileMinTokens) {
    prepare_gemv(j);
    pool.run(gemv_task, &j, j.tasks);
  } else {
    prepare_tile(j);
    pool.run(tile_task, &j, j.tasks);
  }
}

}  // namespace ftdense

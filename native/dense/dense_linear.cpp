#include "dense_linear.h"

#include <cstring>
#include <stdexcept>

#include "cpu_features.h"
#include "dense_tasks.h"

namespace ftdense {

using ftnative::KernelSet;
using ftnative::kTileLanes;

namespace {

constexpr int64_t kPanelBytes = 512 << 10;  // a token chunk's panel is sized to stay in L2

inline float round_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  if ((b & 0x7F800000u) != 0x7F800000u) b += 0x7FFFu + ((b >> 16) & 1u);  // nearest even
  b &= 0xFFFF0000u;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// weight rows as raw bytes (fp32 or bf16: the kernel set's dtype)
using Job = tasks::Job<KernelSet, float, char>;

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
  j.rows_per_task = tasks::kGemvRows;
}

void prepare_tile(Job& j) {
  const Input& in = j.in;
  j.nb = (in.T + kTileLanes - 1) / kTileLanes;
  j.block = static_cast<int64_t>(in.K) * kTileLanes;
  j.xbuf.assign(static_cast<size_t>(j.nb * j.block), 0.0f);
  for (int t = 0; t < in.T; ++t) {
    float* blk =
        j.xbuf.data() + static_cast<int64_t>(t / kTileLanes) * in.K * kTileLanes + t % kTileLanes;
    for (int k = 0; k < in.K; ++k) blk[static_cast<int64_t>(k) * kTileLanes] = load_x(in, t, k);
  }
  const int64_t chunk = kPanelBytes / (static_cast<int64_t>(in.K) * kTileLanes * sizeof(float));
  j.chunk_blocks = chunk > 1 ? static_cast<int>(chunk) : 1;
  j.rows_per_task = tasks::kTileRowsTask;
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
  j.row_bytes = static_cast<int64_t>(in.K) * (in.bf16 ? 2 : 4);
  if (in.T < kTileMinTokens) prepare_gemv(j);
  else prepare_tile(j);
  tasks::run<Job, char>(pool, j);
}

}  // namespace ftdense

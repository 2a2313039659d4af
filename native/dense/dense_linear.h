// Dense projection y = x W^T for small-batch CPU inference, on the expert executor's SIMD kernels
// (native/src/kernels.h): bf16 or fp32 weights, fp32 inputs and outputs, fp32 accumulation.
//
// torch's CPU bf16 matmul widens and reorders per call and runs at ~1 GB/s for one token; decode
// is a pure weight stream, so this runs the bandwidth-bound gemv kernel for few tokens and the
// register-tiled kernel (16-token panels) for many, split over a Pool by output rows.
#pragma once

#include <cstdint>
#include <string>

#include "kernels.h"
#include "pool.h"

namespace ftdense {

struct LinearArgs {
  const float* x;  // [T, K], rows K apart
  int T;
  int K;
  const void* w;  // [N, K] row-major, bf16 or fp32 (the kernel set's dtype)
  bool bf16;
  int N;
  float* y;  // [T, N]
  bool round_input;  // round x to bf16 first (what x.to(bfloat16) does before a bf16 matmul)
};

// The kernel set for `isa` ("auto", "avx512", "avx2", "scalar") and weight dtype; throws
// std::invalid_argument for an ISA this CPU cannot run.
const ftnative::KernelSet& kernel_set(const std::string& isa, bool bf16);

// Fewer tokens than this take the gemv path.
constexpr int kTileMinTokens = 8;

void linear(Pool& pool, const ftnative::KernelSet& ks, const LinearArgs& a);

}  // namespace ftdense

// Dense projections y_i = x W_i^T for small-batch CPU inference, on the expert executor's SIMD
// kernels (native/src/kernels.h): bf16 or fp32 weights, fp32 inputs and outputs, fp32
// accumulation. Several weights may share one input (q/k/v of attention): one pool job then
// covers all of them, the input is prepared once.
//
// Decode is a pure weight stream: few tokens take the bandwidth-bound gemv kernel, many take the
// register-tiled kernel (16-token panels); work is split over a Pool by output rows.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels.h"
#include "pool.h"

namespace ftdense {

struct Input {
  const float* x;  // [T, K], rows K apart
  int T;
  int K;
  bool bf16;         // the weights' dtype (else fp32); the kernel set must match
  bool round_input;  // round x to bf16 first (what x.to(bfloat16) does before a bf16 matmul)
};

struct Output {
  const void* w;  // [N, K] row-major
  int N;
  float* y;  // [T, N]
};

// The kernel set for `isa` ("auto", "avx512bf16", "avx512", "avx2", "scalar", "emu512",
// "emubf16") and weight dtype; throws std::invalid_argument for an ISA this CPU cannot run. The
// bf16-dot ISAs give their fp32-FMA kernels here (avx512, scalar); see dense_linear_bf16.h.
const ftnative::KernelSet& kernel_set(const std::string& isa, bool bf16);

// Fewer tokens than this take the gemv path.
constexpr int kTileMinTokens = 8;

void linear(Pool& pool, const ftnative::KernelSet& ks, const Input& in,
            const std::vector<Output>& outs);

}  // namespace ftdense

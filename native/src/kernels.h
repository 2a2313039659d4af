// Kernel sets of the CPU expert executor: one per (ISA, weight dtype).
//
// Every set provides the two inner loops of an expert projection; everything else (routing,
// bias, activation, scatter) is ISA-independent C++ in executor.cpp.
//
//   gemv  small batches (decode): y[s * ldy + r] = dot(W[r, :k], xs[s][:k])
//         r < rows, s < n; W rows are `ldw` elements apart. Weight bytes are streamed once per
//         pair of tokens. When `chunk` > 0 the kernel reads every full chunk of
//         `chunk` inputs de-interleaved: even-indexed inputs first, then odd-indexed ones (see
//         shuffle_index); this lets bf16 pairs widen to fp32 with one shift and one mask.
//   tile  many tokens per expert (prefill): the inputs come as a panel of nb blocks of 16 tokens,
//         xp[(b * k + kk) * 16 + lane] (token lanes contiguous), and
//         y[(b * rows + r) * 16 + lane] = sum_kk W[r, kk] * xp[(b * k + kk) * 16 + lane]
//         so a row of W is broadcast and reused by 16 tokens from registers.
#pragma once

#include <cstdint>

namespace ftnative {

enum class WDtype : int { F32 = 0, BF16 = 1 };

constexpr int kTileLanes = 16;  // tokens per panel block

using GemvFn = void (*)(const void* w, int64_t ldw, int rows, int k, const float* const* xs,
                        int n, float* y, int ldy);
using TileFn = void (*)(const void* w, int64_t ldw, int rows, int k, const float* xp, int nb,
                        float* y);

struct KernelSet {
  const char* isa;
  int chunk;  // input de-interleave width of gemv (0: natural order)
  GemvFn gemv;
  TileFn tile;
};

// Position of input j inside the de-interleaved layout gemv reads (identity when chunk == 0 and
// for the tail that does not fill a chunk).
inline int64_t shuffle_index(int64_t j, int64_t k, int chunk) {
  if (chunk == 0 || j >= k - k % chunk) return j;
  const int64_t c = j / chunk, i = j % chunk;
  return c * chunk + (i & 1) * (chunk / 2) + i / 2;
}

// Defined in kernels_<isa>.cpp. The AVX2/AVX-512 ones are compiled with per-function target
// attributes, so they may only be called once cpu_features says the CPU has that ISA.
extern const KernelSet kScalarF32, kScalarBf16;
extern const KernelSet kAvx2F32, kAvx2Bf16;
extern const KernelSet kAvx512F32, kAvx512Bf16;
// The AVX-512 bodies on emulated 16-lane vectors, for tests on any CPU (isa "emu512").
extern const KernelSet kEmu512F32, kEmu512Bf16;

}  // namespace ftnative

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

// ---- quantised weights (daemon/experts/formats.py) --------------------------------------------
//
// Weights are bytes, rows along the output dim, the packed/blocked dim is the input dim k:
//   Fp8Block  one e4m3 byte per input; fp32 scale s[(row / 128) * lds + c / 128]
//   Mxfp4     e2m1 nibble pairs (input 2j in the low nibble of byte j); e8m0 s[row * lds + c / 32]
//   Nvfp4     e2m1 nibble pairs; e4m3 s[row * lds + c / 16], times the matrix's global scale
// The kernels decode inside their inner loops and accumulate in fp32: the gemv kernels sum the
// unscaled products of one scale span and apply the span's scales once, the tile kernels decode
// a few rows at a time into a per-thread buffer. Same math as formats.py's dequantisation then a
// matmul, up to fp32 rounding. Values the quantisers never write (e4m3 NaN codes, e8m0 255) get
// no special meaning.
enum class QFormat : int { Fp8Block = 0, Mxfp4 = 1, Nvfp4 = 2 };
constexpr int kNumQFormats = 3;

// Rows of one quantised matrix (a gate, up or down projection of one expert).
struct QMat {
  const uint8_t* w;  // the first row to compute; rows are ldw bytes apart
  int64_t ldw;
  const void* s;     // scale row 0 of the whole matrix (fp32, e8m0 or e4m3 by format)
  int64_t lds;       // scales per scale row
  int64_t row0;      // matrix row that `w` points at (picks the scale rows)
  float glob;        // Nvfp4 global scale; 1 otherwise
};

// Same contracts as GemvFn / TileFn with W given by a QMat, except for the input order: BOTH
// kernels read their inputs (gemv's xs rows, tile's panel rows) in the set's layout. Every full
// chunk of `chunk` inputs is permuted, position p holding input perm[p] of the chunk (perm null:
// even inputs then odd ones, as shuffle_index); inputs past the last full chunk stay in order.
using QGemvFn = void (*)(const QMat& m, int rows, int k, const float* const* xs, int n, float* y,
                         int ldy);
using QTileFn = void (*)(const QMat& m, int rows, int k, const float* xp, int nb, float* y);

struct QKernelSet {
  const char* isa;
  int chunk;            // 0: natural order
  const uint8_t* perm;  // [chunk] or null
  QGemvFn gemv;
  QTileFn tile;
};

// Defined in kernels_<isa>.cpp. The AVX2/AVX-512 ones are compiled with per-function target
// attributes, so they may only be called once cpu_features says the CPU has that ISA.
extern const KernelSet kScalarF32, kScalarBf16;
extern const KernelSet kAvx2F32, kAvx2Bf16;
extern const KernelSet kAvx512F32, kAvx512Bf16;
// The AVX-512 bodies on emulated 16-lane vectors, for tests on any CPU (isa "emu512").
extern const KernelSet kEmu512F32, kEmu512Bf16;
// Quantised kernel sets, indexed by QFormat.
extern const QKernelSet kScalarQ[kNumQFormats], kAvx2Q[kNumQFormats], kAvx512Q[kNumQFormats];
extern const QKernelSet kEmu512Q[kNumQFormats];

}  // namespace ftnative

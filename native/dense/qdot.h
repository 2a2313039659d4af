// Integer dot products of block-quantised weights against int8-quantised activations.
//
// Weight rows are stored in GGUF's block layouts, byte for byte, so a GGUF tensor's raw blocks can
// be used as they are (rows along the output dim, blocks along the input dim K):
//   Q8_0  34 bytes per 32 inputs: fp16 d, int8 q[32];                      w = d * q
//   Q4_K 144 bytes per 256 inputs: fp16 d, fp16 dmin, scales[12], qs[128];
//         8 sub-blocks of 32 inputs with 6-bit scale sc_j and 6-bit min m_j packed in scales[]
//         (j < 4: sc = s[j] & 63, m = s[j+4] & 63; j >= 4: sc = (s[j+4] & 15) | (s[j-4] >> 6) << 4,
//         m = (s[j+4] >> 4) | (s[j] >> 6) << 4); input 64c + i (i < 32) is the low nibble of
//         qs[32c + i], input 64c + 32 + i its high nibble;       w = d * sc_j * q - dmin * m_j
//
// Activations (one format for every weight type, computed once per token per layer input and
// shared by every projection that reads it): per block of 32 inputs an fp32 scale
// d = amax / 127, int8 q = nearest-even(x * (127 / amax)) in [-127, 127] (all zero when amax is
// 0), and the block's sum of q as int16 (Q4_K's mins need it). A row of K inputs is q [K],
// d [K/32], s [K/32]; T rows are stored back to back (row t at q + t*K, d + t*K/32).
//
// A kernel computes y[t * ldy] = sum over blocks of (scales) * (exact integer block dot), for
// n activation rows against one weight row; the weight row stays in L1 across the n rows.
// Products are exact in int32; only the per-block float combination order differs between ISAs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ftdense {

enum class QType : int { Q8_0 = 0, Q4_K = 1 };
constexpr int kNumQTypes = 2;
constexpr int kQActBlock = 32;

// Bytes of one weight row of K inputs (K a multiple of the type's block: 32 or 256).
int64_t qrow_bytes(QType t, int64_t K);
int qblock_inputs(QType t);

using QuantizeFn = void (*)(const float* x, int K, int8_t* q, float* d, int16_t* s);
using QRowFn = void (*)(const uint8_t* w, int K, const int8_t* q, const float* d,
                        const int16_t* s, int n, float* y, int64_t ldy);

struct QDotSet {
  const char* isa;
  QuantizeFn quantize;
  QRowFn row[kNumQTypes];
};

// Defined in qdot_<isa>.cpp; the SIMD sets are compiled with target attributes and may only run
// once qdot_isas() lists them.
extern const QDotSet kQDotScalar;
#ifndef FTNATIVE_NO_X86
extern const QDotSet kQDotAvx2;
extern const QDotSet kQDotVnni;  // AVX512-VNNI + AVX512VL on 256-bit vectors (vpdpbusd)
#endif

// ISA names this CPU runs, best first: "vnni", "avx2", "scalar".
std::vector<std::string> qdot_isas();

// "auto" (the best), "vnni", "avx2", "scalar"; the dense ISA names map too ("avx512" -> the best
// of vnni/avx2, "emu512" -> scalar). Throws std::invalid_argument when this CPU cannot run it.
const QDotSet& qdot_set(const std::string& isa);

}  // namespace ftdense

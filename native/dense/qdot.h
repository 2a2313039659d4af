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
//   Q6_K 210 bytes per 256 inputs: ql[128], qh[64], int8 scales[16] (one per 16 inputs), fp16 d;
//         in each half h of 128 inputs, input 128h + 32k + i (k < 4) has low 4 bits from
//         ql[64h + 32(k & 1) + i] (low nibble for k < 2, high for k >= 2) and top 2 bits from
//         bits 2k, 2k+1 of qh[32h + i];                  w = d * sc_(input / 16) * (q - 32)
//   Q5_K 176 bytes per 256 inputs: fp16 d, fp16 dmin, scales[12] as Q4_K, qh[32], qs[128] as
//         Q4_K; input 32j + i takes bit j of qh[i] as its fifth bit; w = d * sc_j * q - dmin * m_j
//   MXFP4 17 bytes per 32 inputs: e8m0 byte e, qs[16]: input i < 16 is the low nibble of qs[i],
//         16 + i the high one, an e2m1 code whose doubled value v is one of 0 1 2 3 4 6 8 12
//         (codes 8-15: the same negated);                         w = 2^(e - 128) * v
//   Q5_0 22 bytes per 32 inputs: fp16 d, uint32 qh (bit i: input i's fifth bit), qs[16] as
//         MXFP4;                                                  w = d * (q - 16)
//   Q4_0 18 bytes per 32 inputs: fp16 d, qs[16] as MXFP4;         w = d * (q - 8)
//
// Activations (computed once per token per layer input and shared by every projection that
// reads it): int8 q = nearest-even(x * (127 / amax)) in [-127, 127] (all zero when amax is 0)
// with one fp32 scale per group of inputs, amax the group's largest |x|, as llama.cpp's Q8_0 and
// Q8_K: a group is 32 inputs for the 32-input weight types (d = amax / 127) and 256 for the
// K-quants (d = 1 / (127 / amax), llama.cpp's Q8_K rounding), act_group(). The layout does not
// depend on the group: a row of K inputs is q [K], d [K/32], s [K/32], with d the scale of the
// group holding those 32 inputs (so a 256-group's scale appears 8 times) and s the 32 inputs'
// sum of q as int16 (Q4_K's mins need it). T rows are stored back to back (row t at q + t*K,
// d + t*K/32). The K-quant kernels may read one d per 256 inputs.
// llama.cpp stores its Q8_0 activation scale as fp16: with set_fp16_act_scales(true) ours is
// rounded the same way (off by default: fp32 is exact), which makes our results on a GGUF file
// bit-comparable with llama.cpp's (the opt-in oracle tests).
//
// Interleaved rows (Q4_K_X8): the rows of a matrix in groups of 8, each group's super-blocks
// in input order, super-block sb of a group (8 * 144 bytes at group + sb * 1152) holding the 8
// rows' Q4_K super-blocks sb rearranged (qdot_simd_x8.h): d of rows 0..7 (fp16 each), dmin of
// rows 0..7, the 12 scale bytes of each row as three 32-bit words (word w of row r at 32 + 32w +
// 4r), then the 128 nibble bytes: 32 words of 8 rows, word 4 * i4 + c of row r (at 128 + 32 *
// (4 * i4 + c) + 4r) being bytes 32c + 4 * i4 .. 32c + 4 * i4 + 3 of that row's qs. A group
// starts at row 8g's offset of the plain layout (8g * row bytes), so addressing is unchanged.
// Q6_K_X8 likewise (8 * 210 bytes a super-block): d of rows 0..7, the 16 scale bytes of each row
// as four 32-bit words (word v of row r at 16 + 32v + 4r), then for each half h < 2 and i4 < 8
// three 32-byte words at 144 + 96 * (8h + i4), lane r holding bytes 4 * i4 .. 4 * i4 + 3 of row
// r's ql[64h ..], ql[64h + 32 ..] and qh[32h ..]. MXFP4_X8 per block of 32 inputs (8 * 17
// bytes): the 8 rows' e8m0 bytes, then four 32-byte words, lane r of word c holding bytes
// 4c .. 4c + 3 of row r's 16 nibble bytes (low nibbles: inputs 4c .. 4c + 3; high: + 16); its
// unit is the 32-input block, not a super-block (any K a multiple of 32). Q8_0_X8 per block of
// 32 inputs (8 * 34 bytes): the 8 rows' fp16 d, then eight 32-byte words, lane r of word c
// holding row r's int8 q[4c .. 4c + 3] (unit: the block, as MXFP4_X8). Q5_K_X8 per super-block
// (8 * 176 bytes): d, dmin and the scale words as Q4_K_X8's, then eight 32-byte words of qh (lane
// r of word i4 holding row r's qh[4 * i4 .. 4 * i4 + 3]), then the nibbles as Q4_K_X8's at 384
// instead of 128. The last R % 8 rows of a matrix whose row count R is not a multiple of 8 stay
// plain rows (qtype_base), right after the last group.
// An interleaved kernel computes a group's 8 rows per call: y[t * ldy + r], r < 8
// (qdot_x8_layout.h has the byte map; qdot_simd_x8.h the SIMD kernels).
//
// A kernel computes y[t * ldy] = sum over blocks of (scales) * (exact integer block dot), for
// n activation rows against one weight row; the weight row stays in L1 across the n rows.
// Products are exact in int32 (Q6_K's 16-input scales multiply the integer sums before the
// 32-input block is scaled); only the per-block float combination order differs between ISAs.
// Signed weights (Q8_0, Q6_K, MXFP4, Q5_0, Q4_0) use the sign trick: |w| as the unsigned operand.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ftdense {

// The codes are the Python side's (formats/gguf_blocks.QTYPE_CODES) and index QDotSet::row.
// Q4_K_X8, Q6_K_X8, MXFP4_X8, Q8_0_X8, Q5_K_X8: Q4_K, Q6_K, MXFP4, Q8_0 and Q5_K rows
// interleaved by 8 (below); the same bytes per row.
enum class QType : int {
  Q8_0 = 0, Q4_K = 1, Q6_K = 2, Q5_K = 3, MXFP4 = 4, Q5_0 = 5, Q4_0 = 6, Q4_K_X8 = 7, Q6_K_X8 = 8,
  MXFP4_X8 = 9, Q8_0_X8 = 10, Q5_K_X8 = 11
};
constexpr int kNumQTypes = 12;
constexpr int kQActBlock = 32;

// The plain type of each type, indexed by QType: itself for a plain type, for an interleaved
// one the type its rows hold (a matrix of R rows in an interleaved type holds R / 8 whole
// groups, then its last R % 8 rows in the plain type: qlinear.h; the expert banks of qmoe.h
// have whole groups only).
constexpr QType kQTypeBase[kNumQTypes] = {
    QType::Q8_0, QType::Q4_K, QType::Q6_K,  QType::Q5_K, QType::MXFP4, QType::Q5_0,
    QType::Q4_0, QType::Q4_K, QType::Q6_K, QType::MXFP4, QType::Q8_0, QType::Q5_K};
inline QType qtype_base(QType t) { return kQTypeBase[static_cast<int>(t)]; }

// Whether plain type `base` has an interleaved layout (some type's base, not itself).
inline bool qtype_has_x8(QType base) {
  for (int i = 0; i < kNumQTypes; ++i)
    if (kQTypeBase[i] == base && static_cast<QType>(i) != base) return true;
  return false;
}

// The activation group (see above) the kernels of weight type t read: 256 for the K-quants.
inline int act_group(QType t) {
  const QType b = qtype_base(t);
  return b == QType::Q4_K || b == QType::Q5_K || b == QType::Q6_K ? 256 : kQActBlock;
}

// Weight rows one kernel call computes: 8 for the interleaved types (callers step by it over
// the whole groups), else 1.
inline int qtype_rows(QType t) { return qtype_base(t) != t ? 8 : 1; }

// Bytes of one weight row of K inputs (K a multiple of the type's block: 32 or 256).
int64_t qrow_bytes(QType t, int64_t K);
int qblock_inputs(QType t);

// group: 32 or 256 (K a multiple of it).
using QuantizeFn = void (*)(const float* x, int K, int group, int8_t* q, float* d, int16_t* s);
using QRowFn = void (*)(const uint8_t* w, int K, const int8_t* q, const float* d,
                        const int16_t* s, int n, float* y, int64_t ldy);

struct QDotSet {
  const char* isa;
  QuantizeFn quantize;
  QRowFn row[kNumQTypes];
  // Per interleaved type, a kernel of two adjacent groups a call (16 rows, the second group's
  // bytes right after the first's, y[t * ldy + r] for r < 16): two weight streams read side by
  // side, for one token (callers use it for n == 1). Null where the set has none.
  QRowFn pair[kNumQTypes];
};

// The two-group kernel of ``t`` in ``ks`` (null when none).
inline QRowFn pair_kernel(const QDotSet& ks, QType t) { return ks.pair[static_cast<int>(t)]; }

// Defined in qdot_<isa>.cpp; the SIMD sets are compiled with target attributes and may only run
// once qdot_isas() lists them.
extern const QDotSet kQDotScalar;
#ifndef FTNATIVE_NO_X86
extern const QDotSet kQDotAvx2;
extern const QDotSet kQDotVnni;  // AVX512-VNNI + AVX512VL on 256-bit vectors (vpdpbusd)
#endif

// The llama.cpp rounding of 32-input activation scales (above); process-wide.
void set_fp16_act_scales(bool on);

// ISA names this CPU runs, best first: "vnni", "avx2", "scalar".
std::vector<std::string> qdot_isas();

// "auto" (the best), "vnni", "avx2", "scalar"; the dense ISA names map too ("avx512" -> the best
// of vnni/avx2, "emu512" -> scalar). Throws std::invalid_argument when this CPU cannot run it.
const QDotSet& qdot_set(const std::string& isa);

}  // namespace ftdense

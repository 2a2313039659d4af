// The routed-expert sum of one MoE layer with GGUF block-quantised expert weights (qdot.h rows),
// computed with integer dot products against int8-quantised activations:
//
//   out[t, :] = sum_k w[t, k] * (down_e @ act(gate_up_e @ x[t] + gate_up_bias_e) + down_bias_e)
//   e = ids[t, k]; routes with e == -1 are skipped
//
// Banks (flat_id-major, as daemon/experts/banks.py; formats.py's block formats): flat id f is
// expert f % E of layer f / E (E = layer_experts), and each layer has its own gate_up and down
// addresses and types (QMoeLayer), so layers of different types (GGUF Q4_K_M files keep the
// ffn_down of some layers in Q6_K) run in one call. Expert e of a layer: gate_up at
// layer.gate_up + e * 2I * qrow_bytes(gate_up_type, H) (gate rows [0, I), up rows [I, 2I)),
// down at layer.down + e * H * qrow_bytes(down_type, I). One layer with E = N is a single bank
// of one type pair. Biases [N, 2I] and [N, H] (flat_id-major), fp32 or bf16, optional.
// Every weight row is computed through QDotSet::row[type], so a type added to qdot.h's table
// runs here without a change.
//
// A call runs three phases on the Pool (each a Pool::run, so a barrier between them):
//   quant  per token: x[t] quantised once per activation group its routes read (qdot.h),
//          copied to each of its routes' input rows; routes are sorted by expert, so an
//          expert's inputs are contiguous
//   up     per (expert, block of I rows): gate and up rows, bias, activation -> the route's act
//          row in fp32; the task that finishes an expert's last block quantises its act rows
//   down   per block of H rows: for every expert, its down rows against the quantised act rows,
//          bias, gate weight, accumulated into out[:, block] (a block of out has one owner)
// So each expert's weights stream from memory once per call. An expert with many routes
// (prefill) walks them in chunks of tokens whose quantised rows fit L2, each weight row read
// from memory once per chunk and reused from L1 by every token of the chunk (as qlinear.h).
#pragma once

#include <cstdint>
#include <vector>

#include "pool.h"
#include "qdot.h"

namespace ftdense {

// The integer codes of daemon/experts/banks.py's Activation.
enum class MoeAct : int { Silu = 0, GptOss = 1, GeluTanh = 2, SwigluClamp = 3 };

// The experts of one layer: E experts' rows from these addresses, in these types.
struct QMoeLayer {
  const uint8_t* gate_up = nullptr;
  const uint8_t* down = nullptr;
  QType gate_up_type = QType::Q8_0;
  QType down_type = QType::Q8_0;
};

struct QMoeSpec {
  std::vector<QMoeLayer> layers;  // N / layer_experts of them
  int64_t layer_experts = 0;      // E
  const void* gate_up_bias = nullptr;  // nullable
  const void* down_bias = nullptr;     // nullable
  bool bias_bf16 = false;
  int64_t num_flat = 0;  // N
  int hidden = 0;        // H, a multiple of every gate_up type's block
  int inter = 0;         // I, a multiple of every down type's block
  MoeAct act = MoeAct::Silu;
  float alpha = 1.702f;  // GPT-OSS only
  float limit = 7.0f;    // GPT-OSS only
  // Bytes of quantised rows per token chunk (prefill): sized so a chunk stays in L2 while every
  // weight row of a task runs over it (tests shrink it to cross chunk boundaries).
  int64_t chunk_bytes = 256 << 10;
};

// Throws std::invalid_argument on shapes the types cannot hold.
void qmoe_check(const QMoeSpec& spec);

// x [T, H] fp32, ids [T, K] int32, w [T, K] fp32, out [T, H] fp32 (overwritten). Throws
// std::out_of_range on an id outside [-1, N) before any work. Calls may run concurrently.
// ``order`` (optional, [T, K] int32 >= 0 where an id is not -1): the key the routes are taken in
// instead of their ids (a token's terms add up in this order): a cache of expert slots passes
// the experts' own ids, so its sums equal the whole pool's bit for bit.
void qmoe_forward(Pool& pool, const QDotSet& ks, const QMoeSpec& spec, const float* x,
                  const int32_t* ids, const float* w, float* out, int T, int K,
                  const int32_t* order = nullptr);

}  // namespace ftdense

// A run of standard attention + MoE decoder layers decoded on the CPU in one native call
// (models/layers/cpu_decode.py): the same kernels and small steps the Python plan called one by
// one, now back to back with no return to Python between them. At one token a step is some 14
// calls a layer; each call through Python cost microseconds of argument conversion and
// interpreter work on caches cold after the weight streams, while every core but the caller's
// sat idle.
//
// Per layer, for the step's t rows (h [t, hidden] fp32, updated in place):
//   x = norm(h); q, k, v = qkv(x); [q, k = per-head norms]; q, k = rope; store k, v in the pool;
//   a = decode attention; o = o_proj(a); h += o, x = norm(h); logits = router(x);
//   ids, w = top-k; m = experts(x, ids, w); h += m
// A call that runs the whole forward also takes the model's two ends (DecodeEnds): the
// embedding rows into h before the first layer, and after the last the final norm and lm_head
// into the step's logits, so a decode step makes one call from the token ids to the logits.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <vector>

#include "decode_attention.h"
#include "dense_linear.h"
#include "kernels_bf16dot.h"
#include "pool.h"
#include "qdot.h"
#include "qmoe.h"

namespace ftdense {

// Weights read from one input in one call: GGUF block rows (qlinear.h) or bf16 rows
// (dense_linear.h, the input rounded to bf16 as x.to(bfloat16) does).
struct ProjGroup {
  bool quant = false;
  int K = 0;
  std::vector<const void*> w;
  std::vector<int> rows;
  std::vector<QType> types;  // quant only
};

struct DecodeLayerSpec {
  int hidden = 0, q_rows = 0, kv_rows = 0;
  int heads = 0, kv_heads = 0, head_dim = 0;
  float attn_scale = 1.0f;
  int window = 0;
  bool head_norm = false;           // per-head q and k norms (scale[2], scale[3])
  std::array<const float*, 4> scale{};  // input norm, post-attention norm, q norm, k norm
  std::array<float, 4> eps{};
  ProjGroup qkv, o, router;
  int experts = 0, top_k = 0;
  bool softmax_first = true, renorm = false;
  int moe_index = 0;  // flat expert ids are moe_index * num_experts + expert
  int kv_layer = 0;
};

// Where the step's rows and their KV live, shared by every layer.
struct DecodeStepArgs {
  int t = 0;
  const float* cos = nullptr;  // [t, rot / 2]
  const float* sin = nullptr;
  int rot = 0;
  bool interleaved = false;
  const int64_t* slots = nullptr;   // [t] pool rows of this token's K/V
  const int32_t* tables = nullptr;  // [t, width] page tables
  const int32_t* rows = nullptr;    // [t] 0..t-1
  const int32_t* lens = nullptr;    // [t] context lengths including this token
  int64_t width = 0;
  std::vector<KvPages> kv;  // by kv_layer (kv_heads and d filled per layer)
  int num_experts = 0;
};

// The model's ends around the layers (decode_layers' `ends`; null: neither). embed: h's rows
// gathered from the embedding first (bf16 or fp32 [vocab, hidden], ids [t] int64; null: h holds
// them already); logits: [t, lm_head rows] = lm_head(rms_norm(h)) after the last layer, with
// norm_scale (fp32 [hidden]) and norm_eps (null: no head).
struct DecodeEnds {
  const void* embed = nullptr;
  bool embed_bf16 = false;
  int64_t vocab = 0;
  const int64_t* ids = nullptr;
  const float* norm_scale = nullptr;
  float norm_eps = 0.0f;
  ProjGroup lm_head;
  float* logits = nullptr;
};

// What the step's calls run on: the pool and kernels configured in the module.
struct DecodeKernels {
  Pool* pool = nullptr;
  const QDotSet* qdot = nullptr;
  const ftnative::KernelSet* bf16 = nullptr;
  const ftnative::Bf16DotSet* bf16dot = nullptr;  // null: bf16 weights on `bf16`'s FMA kernels
  RangeFn attention = nullptr;
  PrefillFn prefill = nullptr;  // decode_attention's `prefill`
};

// The routed experts of a layer: x [t, H], ids [t, k] int32, w [t, k], out [t, H] (fp32).
using ExpertsFn = std::function<void(const float* x, const int32_t* ids, const float* w,
                                     float* out, int t, int k)>;

// Parts of a step timed when the caller asks (seconds added to timings[part]).
enum DecodePart : int {
  kPartQkv, kPartO, kPartRouter, kPartExperts, kPartAttention, kPartNorms, kPartRope,
  kPartKvStore, kPartTopk, kPartAdd, kPartEmbed, kPartLmHead, kNumDecodeParts
};

// Their names, in DecodePart's order (ftdense.decode_parts()).
inline constexpr std::array<const char*, kNumDecodeParts> kDecodePartNames = {
    "qkv", "o", "router", "experts", "attention", "norms", "rope", "kv_store", "route_topk",
    "add_rows", "embed", "lm_head"};

// Throws std::invalid_argument for a spec the step cannot run (checked before any work).
void decode_layers_check(const std::vector<const DecodeLayerSpec*>& layers,
                         const DecodeStepArgs& step, const DecodeEnds* ends = nullptr);

// Decodes h [t, hidden] through `layers` in order, in place. `experts` computes every layer's
// routed experts; ends: null, or the embedding before and the head after (DecodeEnds); timings:
// null, or kNumDecodeParts doubles.
void decode_layers(const DecodeKernels& ks, const std::vector<const DecodeLayerSpec*>& layers,
                   const DecodeStepArgs& step, float* h, const ExpertsFn& experts,
                   double* timings, const DecodeEnds* ends = nullptr);

}  // namespace ftdense

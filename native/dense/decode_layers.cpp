#include "decode_layers.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>

#include "decode_step.h"
#include "dense_linear_bf16.h"
#include "qlinear.h"
#include "rms_norm.h"
#include "rope.h"

namespace ftdense {
namespace {

// One engine thread's step buffers, grown on demand and reused (two engine threads may decode
// at once: each has its own). 64-byte aligned, as torch's allocations the kernels had before.
struct Scratch {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> mem;
  size_t floats = 0;

  float* get(size_t n) {
    if (n > floats) {
      n = (n + 15) & ~size_t{15};
      void* p = std::aligned_alloc(64, n * sizeof(float));
      if (!p) throw std::bad_alloc();
      mem.reset(static_cast<float*>(p));
      floats = n;
    }
    return mem.get();
  }
};

size_t pad16(size_t n) { return (n + 15) & ~size_t{15}; }

void project(const DecodeKernels& ks, const ProjGroup& g, const float* x, int t,
             const std::vector<float*>& ys) {
  if (g.quant) {
    std::vector<QOutput> outs;
    outs.reserve(g.w.size());
    for (size_t i = 0; i < g.w.size(); ++i)
      outs.push_back({static_cast<const uint8_t*>(g.w[i]), g.rows[i], g.types[i], ys[i]});
    qlinear(*ks.pool, *ks.qdot, x, t, g.K, outs);
    return;
  }
  std::vector<Output> outs;
  outs.reserve(g.w.size());
  for (size_t i = 0; i < g.w.size(); ++i) outs.push_back({g.w[i], g.rows[i], ys[i]});
  linear_any(*ks.pool, *ks.bf16, ks.bf16dot, Input{x, t, g.K, true, true}, outs);
}

class Clock {
 public:
  explicit Clock(double* timings) : timings_(timings) {
    if (timings_) t0_ = std::chrono::steady_clock::now();
  }
  // Adds the time since the last lap to `part`.
  void lap(DecodePart part) {
    if (!timings_) return;
    const auto now = std::chrono::steady_clock::now();
    timings_[part] += std::chrono::duration<double>(now - t0_).count();
    t0_ = now;
  }

 private:
  double* timings_;
  std::chrono::steady_clock::time_point t0_;
};

void check_group(const ProjGroup& g, int K, size_t outputs, const char* what) {
  if (g.K != K || g.w.size() != outputs || g.rows.size() != outputs ||
      (g.quant && g.types.size() != outputs))
    throw std::invalid_argument(std::string("decode layer: bad ") + what + " projection");
  for (size_t i = 0; i < outputs; ++i) {
    if (!g.w[i] || g.rows[i] < 1)
      throw std::invalid_argument(std::string("decode layer: bad ") + what + " weight");
    if (g.quant && (K % qblock_inputs(g.types[i]) || g.rows[i] < qtype_rows(g.types[i])))
      throw std::invalid_argument(std::string("decode layer: ") + what +
                                  " rows do not fit their block type");
  }
}

}  // namespace

void decode_layers_check(const std::vector<const DecodeLayerSpec*>& layers,
                         const DecodeStepArgs& step, const DecodeEnds* ends) {
  if (step.t < 1 || !step.cos || !step.sin || !step.slots || !step.tables || !step.rows ||
      !step.lens || step.width < 1 || step.rot < 2 || step.rot % 2)
    throw std::invalid_argument("decode layers: bad step arguments");
  for (const DecodeLayerSpec* l : layers) {
    if (!l) throw std::invalid_argument("decode layers: null layer");
    if (l->hidden < 1 || l->heads < 1 || l->kv_heads < 1 || l->head_dim < 1 ||
        l->q_rows != l->heads * l->head_dim || l->kv_rows != l->kv_heads * l->head_dim ||
        l->heads % l->kv_heads || step.rot > l->head_dim)
      throw std::invalid_argument("decode layers: bad attention shape");
    if (l->top_k < 1 || l->top_k > l->experts || l->experts > step.num_experts)
      throw std::invalid_argument("decode layers: bad router shape");
    if (l->kv_layer < 0 || l->kv_layer >= static_cast<int>(step.kv.size()))
      throw std::invalid_argument("decode layers: kv_layer out of range");
    for (int i = 0; i < (l->head_norm ? 4 : 2); ++i)
      if (!l->scale[i]) throw std::invalid_argument("decode layers: missing norm scale");
    check_group(l->qkv, l->hidden, 3, "qkv");
    if (l->qkv.rows[0] != l->q_rows || l->qkv.rows[1] != l->kv_rows ||
        l->qkv.rows[2] != l->kv_rows)
      throw std::invalid_argument("decode layers: qkv rows do not match the heads");
    check_group(l->o, l->q_rows, 1, "o");
    if (l->o.rows[0] != l->hidden) throw std::invalid_argument("decode layers: o rows != hidden");
    check_group(l->router, l->hidden, 1, "router");
    if (l->router.rows[0] != l->experts)
      throw std::invalid_argument("decode layers: router rows != experts");
    if (l->hidden != layers[0]->hidden)
      throw std::invalid_argument("decode layers: layers of different widths");
  }
  if (!ends) return;
  if (layers.empty()) throw std::invalid_argument("decode layers: the model's ends need a layer");
  const int hidden = layers[0]->hidden;
  if (ends->embed && (ends->vocab < 1 || !ends->ids))
    throw std::invalid_argument("decode layers: bad embedding");
  if (ends->logits) {
    if (!ends->norm_scale) throw std::invalid_argument("decode layers: missing final norm scale");
    check_group(ends->lm_head, hidden, 1, "lm_head");
  }
}

void decode_layers(const DecodeKernels& ks, const std::vector<const DecodeLayerSpec*>& layers,
                   const DecodeStepArgs& step, float* h, const ExpertsFn& experts,
                   double* timings, const DecodeEnds* ends) {
  decode_layers_check(layers, step, ends);
  const int t = step.t;
  size_t need = 0;
  for (const DecodeLayerSpec* l : layers) {
    const size_t per = 3 * pad16(size_t(t) * l->hidden) + 3 * pad16(size_t(t) * l->q_rows) +
                       3 * pad16(size_t(t) * l->kv_rows) + pad16(size_t(t) * l->experts) +
                       2 * pad16(size_t(t) * l->top_k);
    need = std::max(need, per);
  }
  thread_local Scratch scratch;
  float* base = scratch.get(need);
  Clock clock(timings);
  if (ends && ends->embed) {
    embed_rows(ends->embed, ends->embed_bf16, ends->vocab, layers[0]->hidden, ends->ids, t, h);
    clock.lap(kPartEmbed);
  }
  for (const DecodeLayerSpec* lp : layers) {
    const DecodeLayerSpec& l = *lp;
    float* p = base;
    auto take = [&p](size_t n) {
      float* r = p;
      p += pad16(n);
      return r;
    };
    const size_t T = size_t(t);
    float* x = take(T * l.hidden);
    float* q = take(T * l.q_rows);
    float* k = take(T * l.kv_rows);
    float* v = take(T * l.kv_rows);
    float* qr = take(T * l.q_rows);
    float* kr = take(T * l.kv_rows);
    float* att = take(T * l.q_rows);
    float* o = take(T * l.hidden);
    float* logits = take(T * l.experts);
    int32_t* ids = reinterpret_cast<int32_t*>(take(T * l.top_k));
    float* w = take(T * l.top_k);
    float* moe = take(T * l.hidden);
    const int heads = l.heads, kvh = l.kv_heads, d = l.head_dim;

    rms_norm(h, t, l.hidden, l.scale[0], l.eps[0], x);
    clock.lap(kPartNorms);
    project(ks, l.qkv, x, t, {q, k, v});
    clock.lap(kPartQkv);
    if (l.head_norm) {
      rms_norm(q, T * heads, d, l.scale[2], l.eps[2], q);
      rms_norm(k, T * kvh, d, l.scale[3], l.eps[3], k);
      clock.lap(kPartNorms);
    }
    rope(q, t, heads, d, step.rot, step.interleaved, step.cos, step.sin, qr);
    rope(k, t, kvh, d, step.rot, step.interleaved, step.cos, step.sin, kr);
    clock.lap(kPartRope);
    KvPages kv = step.kv[l.kv_layer];
    kv.kv_heads = kvh;
    kv.d = d;
    kv_store(kr, v, t, int64_t(kvh) * d, step.slots, const_cast<void*>(kv.k),
             const_cast<void*>(kv.v), kv.bf16);
    clock.lap(kPartKvStore);
    const DecodeRows rows{qr,          att,        int64_t(t), t,           step.rows, step.lens,
                          step.tables, step.width, heads,      l.attn_scale, l.window, nullptr};
    decode_attention(*ks.pool, ks.attention, kv, rows, ks.prefill);
    clock.lap(kPartAttention);
    project(ks, l.o, att, t, {o});
    clock.lap(kPartO);
    add_rms_norm(h, o, t, l.hidden, l.scale[1], l.eps[1], x);
    clock.lap(kPartNorms);
    project(ks, l.router, x, t, {logits});
    clock.lap(kPartRouter);
    route_topk(logits, t, l.experts, l.top_k, l.softmax_first, l.renorm,
               l.moe_index * step.num_experts, ids, w);
    clock.lap(kPartTopk);
    experts(x, ids, w, moe, t, l.top_k);
    clock.lap(kPartExperts);
    add_rows(h, moe, int64_t(T) * l.hidden);
    clock.lap(kPartAdd);
  }
  if (ends && ends->logits) {
    const int hidden = layers[0]->hidden;
    float* x = base;  // the layers' scratch is free again
    rms_norm(h, t, hidden, ends->norm_scale, ends->norm_eps, x);
    project(ks, ends->lm_head, x, t, {ends->logits});
    clock.lap(kPartLmHead);
  }
}

}  // namespace ftdense

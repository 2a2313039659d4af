// `ftdense`'s decode_layers (decode_layers.h): a decoder layer's spec as Python builds it, and
// the one call that decodes a run of layers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "bindings_common.h"
#include "decode_layers.h"
#include "executor_bridge.h"
#include "qmoe.h"

namespace py = pybind11;

namespace ftdense_py {
namespace {

// (quant, K, weight addresses, rows, GGUF types) -> a projection group of decode_layers.h.
using ProjArg = std::tuple<bool, int, std::vector<uintptr_t>, std::vector<int>, std::vector<int>>;

ftdense::ProjGroup proj_group(const ProjArg& a) {
  const auto& [quant, K, w, rows, types] = a;
  ftdense::ProjGroup g;
  g.quant = quant;
  g.K = K;
  for (uintptr_t p : w) g.w.push_back(reinterpret_cast<const void*>(p));
  g.rows = rows;
  if (quant)
    for (int c : types) g.types.push_back(qtype_code(c));
  return g;
}

ftdense::DecodeLayerSpec decode_layer_spec(int hidden, int heads, int kv_heads, int head_dim,
                                           float attn_scale, int window,
                                           const std::vector<uintptr_t>& scales,
                                           const std::vector<float>& eps, const ProjArg& qkv,
                                           const ProjArg& o, const ProjArg& router, int experts,
                                           int top_k, bool softmax_first, bool renorm,
                                           int moe_index, int kv_layer) {
  if (scales.size() != eps.size() || (scales.size() != 2 && scales.size() != 4))
    throw py::value_error("scales and eps: 2 norms, or 4 with per-head q and k norms");
  ftdense::DecodeLayerSpec l;
  l.hidden = hidden;
  l.heads = heads;
  l.kv_heads = kv_heads;
  l.head_dim = head_dim;
  l.q_rows = heads * head_dim;
  l.kv_rows = kv_heads * head_dim;
  l.attn_scale = attn_scale;
  l.window = window;
  l.head_norm = scales.size() == 4;
  for (size_t i = 0; i < scales.size(); ++i) {
    l.scale[i] = reinterpret_cast<const float*>(scales[i]);
    l.eps[i] = eps[i];
  }
  l.qkv = proj_group(qkv);
  l.o = proj_group(o);
  l.router = proj_group(router);
  l.experts = experts;
  l.top_k = top_k;
  l.softmax_first = softmax_first;
  l.renorm = renorm;
  l.moe_index = moe_index;
  l.kv_layer = kv_layer;
  return l;
}

// (k address, v address, bf16, pages, page size) of one layer of the KV pool.
using KvArg = std::tuple<uintptr_t, uintptr_t, bool, int64_t, int>;

// The model's ends (decode_layers.h's DecodeEnds): (embedding address or 0, bf16, vocab, token
// ids address, final norm scale address, eps, lm_head projection, logits address or 0).
using EndsArg =
    std::tuple<uintptr_t, bool, int64_t, uintptr_t, uintptr_t, float, ProjArg, uintptr_t>;

ftdense::DecodeEnds decode_ends(const EndsArg& a) {
  const auto& [embed, bf16, vocab, ids, scale, eps, lm_head, logits] = a;
  ftdense::DecodeEnds e;
  e.embed = reinterpret_cast<const void*>(embed);
  e.embed_bf16 = bf16;
  e.vocab = vocab;
  e.ids = reinterpret_cast<const int64_t*>(ids);
  e.norm_scale = reinterpret_cast<const float*>(scale);
  e.norm_eps = eps;
  if (logits) e.lm_head = proj_group(lm_head);
  e.logits = reinterpret_cast<float*>(logits);
  return e;
}

// The disk tier's fast path (experts/disk_tier.py TieredExecutor.native_tier): a layer whose
// routed experts are all in the RAM cache runs on the slot banks here, no call into Python.
// lut [num_flat + 1]: flat id + 1 -> its slot (-1: not resident, or still being read); log
// [1 + cap]: log[0] entries used, then per call made here its ids ([t, k]) and a -2 (the tier
// touches them in its LRU at its next call: no eviction happens between); replay [5] int64,
// read at each call (the tier may change it between steps): the address of [steps, layers, k]
// per-layer expert ids (-1 a skipped route; 0: no replay), steps, layers, k and pos: the
// routes replaced by a recorded model's (benchmarks), row (pos + token) % steps, pos advanced
// by t after the last of `layers` MoE layers. Any other call (a miss, a full log) goes to
// `experts`.
struct TierPath {
  const int32_t* lut = nullptr;
  int32_t* log = nullptr;
  int64_t cap = 0, num_flat = 0;
  int64_t* replay = nullptr;
};

// (lut, log, log capacity, num_flat, replay header address)
using TierArg = std::tuple<uintptr_t, uintptr_t, int64_t, int64_t, uintptr_t>;

TierPath tier_path(const TierArg& a) {
  const auto& [lut, log, cap, num_flat, replay] = a;
  TierPath p;
  p.lut = reinterpret_cast<const int32_t*>(lut);
  p.log = reinterpret_cast<int32_t*>(log);
  p.cap = cap;
  p.num_flat = num_flat;
  p.replay = reinterpret_cast<int64_t*>(replay);
  if (!p.lut || !p.log || !p.replay || cap < 1 || num_flat < 1)
    throw py::value_error("decode_layers: tier needs a lut, a log, a replay header, num_flat");
  return p;
}

// ids [T, K] -> flat [T, K] (the replayed routes when `tp` replays) and slots [T, K]; true
// when every route's expert is resident.
bool tier_lookup(const TierPath& tp, int num_experts, const int32_t* ids, int T, int K,
                 std::vector<int32_t>& flat, std::vector<int32_t>& slots) {
  const size_t n = size_t(T) * K;
  flat.assign(ids, ids + n);
  const auto* routes = reinterpret_cast<const int32_t*>(tp.replay[0]);
  const int64_t steps = tp.replay[1], layers = tp.replay[2], rk = tp.replay[3];
  if (routes && steps > 0 && rk > 0) {
    int64_t layer = -1;
    for (size_t i = 0; i < n && layer < 0; ++i)
      if (ids[i] >= 0) layer = ids[i] / num_experts;
    if (layer >= 0 && layer < layers) {
      int64_t& pos = tp.replay[4];
      for (int r = 0; r < T; ++r) {
        const int32_t* rec = routes + (((pos + r) % steps) * layers + layer) * rk;
        for (int j = 0; j < K; ++j) {
          const int32_t e = j < rk ? rec[j] : -1;
          flat[size_t(r) * K + j] = e < 0 ? -1 : int32_t(layer * num_experts + e);
        }
      }
      if (layer == layers - 1) pos += T;
    }
  }
  slots.resize(n);
  bool all = true;
  for (size_t i = 0; i < n; ++i) {
    const int32_t f = flat[i];
    if (f < 0) {
      slots[i] = -1;
    } else if (f >= tp.num_flat || (slots[i] = tp.lut[f + 1]) < 0) {
      all = false;
    }
  }
  return all;
}

void decode_layers_call(const std::vector<const ftdense::DecodeLayerSpec*>& layers, uintptr_t h,
                        int t, uintptr_t cos, uintptr_t sin, int rot, bool interleaved,
                        uintptr_t slots, uintptr_t tables, uintptr_t rows, uintptr_t lens,
                        int64_t width, const std::vector<KvArg>& kv, int num_experts,
                        const ftdense::QMoeSpec* qmoe,
                        std::optional<std::tuple<uintptr_t, uintptr_t>> float_experts,
                        py::object experts, uintptr_t timings,
                        const std::optional<EndsArg>& ends_arg,
                        const std::optional<TierArg>& tier_arg) {
  if (!qmoe && !float_experts && experts.is_none())
    throw py::value_error("decode_layers: no experts given");
  std::optional<TierPath> tier;
  if (tier_arg) {
    if (!qmoe || experts.is_none())
      throw py::value_error("decode_layers: a tier needs qmoe (its slots) and experts");
    tier = tier_path(*tier_arg);
  }
  std::optional<ftdense::DecodeEnds> ends;
  if (ends_arg) ends = decode_ends(*ends_arg);
  ftdense::DecodeStepArgs step;
  step.t = t;
  step.cos = reinterpret_cast<const float*>(cos);
  step.sin = reinterpret_cast<const float*>(sin);
  step.rot = rot;
  step.interleaved = interleaved;
  step.slots = reinterpret_cast<const int64_t*>(slots);
  step.tables = reinterpret_cast<const int32_t*>(tables);
  step.rows = reinterpret_cast<const int32_t*>(rows);
  step.lens = reinterpret_cast<const int32_t*>(lens);
  step.width = width;
  step.num_experts = num_experts;
  for (const auto& [k, v, bf16, pages, page_size] : kv)
    step.kv.push_back({reinterpret_cast<const void*>(k), reinterpret_cast<const void*>(v), bf16,
                       pages, page_size, 0, 0});
  const Configured c = configured();
  const std::shared_ptr<ftdense::Pool>& pool = c.pool;
  const ftdense::DecodeKernels ks{pool.get(), c.qdot, c.bf16, c.bf16dot, c.attention, c.prefill};
  ftdense::ExpertsFn fn;
  // an ftnative executor's call on this module's pool (executor_bridge.h)
  const ftnative::ExternalPool ext{
      [](void* p, void (*task)(void*, int64_t), void* ctx, int64_t tasks) {
        static_cast<ftdense::Pool*>(p)->run(task, ctx, tasks);
      },
      pool.get(), pool->threads()};
  std::vector<int32_t> flat, slot_ids;
  if (tier) {
    fn = [&ks, qmoe, &tier, &experts, &flat, &slot_ids, num_experts](
             const float* x, const int32_t* ids, const float* w, float* out, int T, int K) {
      const TierPath& tp = *tier;
      const bool hit = tier_lookup(tp, num_experts, ids, T, K, flat, slot_ids);
      const int64_t used = tp.log[0], need = int64_t(T) * K + 1;
      if (hit && used + need <= tp.cap) {
        // the slots' sums taken in flat-id order: the whole pool's bit for bit
        ftdense::qmoe_forward(*ks.pool, *ks.qdot, *qmoe, x, slot_ids.data(), w, out, T, K,
                              flat.data());
        int32_t* at = tp.log + 1 + used;
        std::copy(flat.begin(), flat.end(), at);
        at[T * K] = -2;
        tp.log[0] = int32_t(used + need);
        return;
      }
      py::gil_scoped_acquire gil;
      experts(reinterpret_cast<uintptr_t>(x), reinterpret_cast<uintptr_t>(flat.data()),
              reinterpret_cast<uintptr_t>(w), reinterpret_cast<uintptr_t>(out), T, K);
    };
  } else if (qmoe) {
    fn = [&ks, qmoe](const float* x, const int32_t* ids, const float* w, float* out, int T,
                     int K) {
      ftdense::qmoe_forward(*ks.pool, *ks.qdot, *qmoe, x, ids, w, out, T, K);
    };
  } else if (float_experts) {
    const auto [entry, exec] = *float_experts;
    const auto forward_on = reinterpret_cast<ftnative::ForwardOnFn>(entry);
    void* e = reinterpret_cast<void*>(exec);
    fn = [&ext, forward_on, e](const float* x, const int32_t* ids, const float* w, float* out,
                               int T, int K) { forward_on(e, x, ids, w, out, T, K, &ext); };
  } else {
    fn = [&experts](const float* x, const int32_t* ids, const float* w, float* out, int T,
                    int K) {
      py::gil_scoped_acquire gil;
      experts(reinterpret_cast<uintptr_t>(x), reinterpret_cast<uintptr_t>(ids),
              reinterpret_cast<uintptr_t>(w), reinterpret_cast<uintptr_t>(out), T, K);
    };
  }
  py::gil_scoped_release release;
  const ftdense::Pool::Hold hold(*pool);  // the step's jobs without wake-ups (pool.h)
  ftdense::decode_layers(ks, layers, step, reinterpret_cast<float*>(h), fn,
                         reinterpret_cast<double*>(timings), ends ? &*ends : nullptr);
}

}  // namespace

void bind_decode_layers(py::module_& m) {
  py::class_<ftdense::DecodeLayerSpec>(
      m, "DecodeLayer",
      "One standard attention + MoE decoder layer for decode_layers (decode_layers.h); borrows "
      "the weight and norm-scale addresses.")
      .def(py::init(&decode_layer_spec), py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("attn_scale"), py::arg("window"), py::arg("scales"),
           py::arg("eps"), py::arg("qkv"), py::arg("o"), py::arg("router"), py::arg("experts"),
           py::arg("top_k"), py::arg("softmax_first"), py::arg("renorm"), py::arg("moe_index"),
           py::arg("kv_layer"));
  m.def("decode_layers", &decode_layers_call, py::arg("layers"), py::arg("h"), py::arg("t"),
        py::arg("cos"), py::arg("sin"), py::arg("rot"), py::arg("interleaved"), py::arg("slots"),
        py::arg("tables"), py::arg("rows"), py::arg("lens"), py::arg("width"), py::arg("kv"),
        py::arg("num_experts"), py::arg("qmoe"), py::arg("float_experts"), py::arg("experts"),
        py::arg("timings") = 0, py::arg("ends") = py::none(), py::arg("tier") = py::none(),
        "Decodes h [t, hidden] fp32 (address) through `layers` in place, in one call "
        "(decode_layers.h). kv: per KV layer (k, v, bf16, pages, page size); the experts: a QMoe "
        "(qmoe), an ftnative Executor's forward_on_entry (float_experts; both on this module's "
        "pool) or experts(x, ids, w, out, t, k) on addresses; timings: 0 or the address of "
        "len(decode_parts()) float64 seconds the call adds to; ends: None, or the model's ends "
        "(embedding address or 0, bf16, vocab, token ids address, final norm scale address, "
        "eps, lm_head projection, logits address or 0): the embedding rows gathered into h "
        "first, lm_head(norm(h)) written to the logits after the last layer; tier: None, or the "
        "disk tier's fast path (lut, log, log capacity, num_flat, replay header address; "
        "bindings_decode.cpp TierPath): qmoe is then its slots' and experts its "
        "call for any layer with an expert not resident.");
  m.def(
      "decode_parts",
      [] {
        return std::vector<std::string>(ftdense::kDecodePartNames.begin(),
                                        ftdense::kDecodePartNames.end());
      },
      "The names of decode_layers' timed parts, in order (decode_layers.h's DecodePart).");
}

}  // namespace ftdense_py

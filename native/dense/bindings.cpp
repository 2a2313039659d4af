// Python module `ftdense`: dense projections on the CPU (see dense_linear.h). Tensors cross as raw
// addresses plus shapes; freetokend.models.layers.dense_native checks them first.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "bindings_common.h"
#include "decode_attention.h"
#include "decode_step.h"
#include "dense_linear.h"
#include "dense_linear_bf16.h"
#include "pool.h"
#include "qlinear.h"
#include "qmoe.h"
#include "rms_norm.h"
#include "rope.h"
#include "row_tasks.h"

namespace py = pybind11;
using ftdense_py::configured;
using ftdense_py::Configured;
using ftdense_py::qtype_code;

namespace {

struct State {
  std::mutex mu;  // guards the fields; a call holds its own reference to the pool
  std::shared_ptr<ftdense::Pool> pool;
  std::string isa = "auto";
  const ftnative::KernelSet* bf16 = nullptr;
  const ftnative::KernelSet* f32 = nullptr;
  const ftnative::Bf16DotSet* bf16dot = nullptr;  // bf16 weights take it when set
  ftdense::RangeFn attention = nullptr;
  const ftdense::QDotSet* qdot = nullptr;
  ftdense::PrefillFn prefill = nullptr;
  const ftdense::SparseKernels* sparse = nullptr;
};

State& state() {
  static State* s = new State;  // never destroyed: no pool teardown at exit (or in a fork)
  return *s;
}

void configure(int threads, int spin_us, const std::string& isa, bool bf16_attention) {
  if (threads < 1) throw py::value_error("threads must be >= 1");
  State& s = state();
  const auto* bf16 = &ftdense::kernel_set(isa, true);  // throws before anything changes
  const auto* f32 = &ftdense::kernel_set(isa, false);
  const auto* bf16dot = ftdense::bf16dot_set(isa);
  // attention and the integer dots know no bf16-dot ISAs: they take the base ones
  const std::string base = isa == "avx512bf16" ? "avx512" : isa == "emubf16" ? "scalar" : isa;
  const auto* qdot = &ftdense::qdot_set(base);
  auto pool = std::make_shared<ftdense::Pool>(threads, spin_us);
  std::lock_guard<std::mutex> lock(s.mu);
  s.pool = std::move(pool);  // the old pool ends when its last running call drops it
  s.bf16 = bf16;
  s.f32 = f32;
  s.bf16dot = bf16dot;
  s.isa = bf16dot ? bf16dot->isa : bf16->isa;
  s.attention = ftdense::range_kernel(bf16->isa);
  s.qdot = qdot;
  // the prefill attention on the bf16-dot kernels (a bf16 KV pool) where asked
  // (cpu_bf16_attention), else on the base ISA's fp32 ones
  s.prefill = ftdense::prefill_kernel(bf16dot && bf16_attention ? std::string(bf16dot->isa)
                                                                  : bf16->isa);
  s.sparse = &ftdense::sparse_kernels(bf16->isa);
}

// The pool and the qdot set of a call: `isa` empty for the configured one.
std::shared_ptr<ftdense::Pool> qdot_call(const std::string& isa, const ftdense::QDotSet*& ks) {
  Configured c = configured();
  ks = isa.empty() ? c.qdot : &ftdense::qdot_set(isa);
  return c.pool;
}

// One layer of the KV pool from its addresses (decode_attention.h).
ftdense::KvPages kv_pages(uintptr_t k, uintptr_t v, bool bf16, int64_t num_pages, int page_size,
                          int kv_heads, int d) {
  return {reinterpret_cast<const void*>(k), reinterpret_cast<const void*>(v), bf16, num_pages,
          page_size, kv_heads, d};
}

}  // namespace

namespace ftdense_py {

Configured configured() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.pool) throw std::runtime_error("ftdense.configure() was not called");
  return {s.pool, s.bf16, s.f32, s.bf16dot, s.attention, s.qdot, s.prefill, s.sparse};
}

ftdense::QType qtype_code(int code) {
  if (code < 0 || code >= ftdense::kNumQTypes)
    throw py::value_error(
        "qtype must be 0 (q8_0), 1 (q4_k), 2 (q6_k), 3 (q5_k), 4 (mxfp4), 5 (q5_0), 6 (q4_0), "
        "or 7 (q4_k), 8 (q6_k), 9 (mxfp4), 10 (q8_0), 11 (q5_k) interleaved by 8");
  return static_cast<ftdense::QType>(code);
}

}  // namespace ftdense_py

// One layer's (gate_up address, down address, gate_up qtype, down qtype).
using QMoeLayerArg = std::tuple<uintptr_t, uintptr_t, int, int>;

// ``layers`` empty: one bank pair (gate_up, down) of one type pair holds all num_flat experts;
// otherwise layer l holds flat ids [l * layer_experts, (l + 1) * layer_experts).
ftdense::QMoeSpec qmoe_spec(uintptr_t gate_up, uintptr_t down, int gate_up_type, int down_type,
                            uintptr_t gate_up_bias, uintptr_t down_bias, bool bias_bf16,
                            int64_t num_flat, int hidden, int inter, int act, float alpha,
                            float limit, int64_t chunk_bytes,
                            const std::vector<QMoeLayerArg>& layers, int64_t layer_experts) {
  if (act < 0 || act > 3)
    throw py::value_error(
        "act must be 0 (silu), 1 (gptoss), 2 (gelu_tanh) or 3 (swiglu_clamp)");
  ftdense::QMoeSpec s;
  if (layers.empty()) {
    s.layers.push_back({reinterpret_cast<const uint8_t*>(gate_up),
                        reinterpret_cast<const uint8_t*>(down), qtype_code(gate_up_type),
                        qtype_code(down_type)});
    s.layer_experts = num_flat;
  } else {
    for (const auto& [gu, dn, gut, dnt] : layers)
      s.layers.push_back({reinterpret_cast<const uint8_t*>(gu),
                          reinterpret_cast<const uint8_t*>(dn), qtype_code(gut), qtype_code(dnt)});
    s.layer_experts = layer_experts;
  }
  s.gate_up_bias = reinterpret_cast<const void*>(gate_up_bias);
  s.down_bias = reinterpret_cast<const void*>(down_bias);
  s.bias_bf16 = bias_bf16;
  s.num_flat = num_flat;
  s.hidden = hidden;
  s.inter = inter;
  s.act = static_cast<ftdense::MoeAct>(act);
  s.alpha = alpha;
  s.limit = limit;
  s.chunk_bytes = chunk_bytes;
  ftdense::qmoe_check(s);
  return s;
}

PYBIND11_MODULE(ftdense, m) {
  m.doc() = "freetoken dense CPU projections y = x W^T (bf16/fp32 weights, fp32 in and out)";
  // spin_us has no default here: dense_native.configure passes its SPIN_US_SHARED
  m.def("configure", &configure, py::arg("threads"), py::arg("spin_us"), py::arg("isa") = "auto",
        py::arg("bf16_attention") = false,
        "(Re)creates the thread pool (the caller counts as one thread); bf16_attention: the "
        "prefill and decode attention on the bf16-dot kernels too, where isa is one.");
  m.def(
      "set_spin",
      [](int spin_us) {
        if (spin_us < 0) throw py::value_error("spin_us must be >= 0");
        std::lock_guard<std::mutex> lock(state().mu);
        if (!state().pool) throw std::runtime_error("ftdense.configure() was not called");
        state().pool->set_spin_us(spin_us);
      },
      py::arg("spin_us"), "How long the pool's idle workers spin before sleeping (microseconds).");
  m.def("spin_us", [] {
    std::lock_guard<std::mutex> lock(state().mu);
    return state().pool ? state().pool->spin_us() : -1;
  });
  m.def(
      "pool_jobs",
      [](int jobs, int gap_us, bool hold) {
        const Configured c = configured();
        py::gil_scoped_release release;
        const uint64_t before = c.pool->sleeps();
        std::optional<ftdense::Pool::Hold> held;
        if (hold) held.emplace(*c.pool);
        std::atomic<int64_t> ran{0};
        for (int j = 0; j < jobs; ++j) {
          c.pool->run(
              [](void* ctx, int64_t) { static_cast<std::atomic<int64_t>*>(ctx)->fetch_add(1); },
              &ran, 4 * c.pool->threads());
          const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(gap_us);
          while (std::chrono::steady_clock::now() < end) {
          }
        }
        return std::make_tuple(ran.load(), c.pool->sleeps() - before);
      },
      py::arg("jobs"), py::arg("gap_us"), py::arg("hold"),
      "Tests: runs `jobs` small jobs on the pool, busy for gap_us on the caller between them, "
      "inside a Pool::Hold (a decode step's) or not; returns (tasks run, worker sleeps).");
  m.def("pool_sleeps", [] {
    const Configured c = configured();
    return c.pool->sleeps();
  });
  m.def("configured", [] {
    std::lock_guard<std::mutex> lock(state().mu);
    return static_cast<bool>(state().pool);
  });
  m.def("isa", [] {
    std::lock_guard<std::mutex> lock(state().mu);
    return state().isa;
  });
  m.def("threads", [] {
    std::lock_guard<std::mutex> lock(state().mu);
    return state().pool ? state().pool->threads() : 0;
  });
  m.def(
      "rms_norm",
      [](uintptr_t x, int64_t rows, int dim, uintptr_t scale, float eps, uintptr_t y) {
        ftdense::rms_norm(reinterpret_cast<const float*>(x), rows, dim,
                          reinterpret_cast<const float*>(scale), eps, reinterpret_cast<float*>(y));
      },
      py::arg("x"), py::arg("rows"), py::arg("dim"), py::arg("scale"), py::arg("eps"), py::arg("y"),
      "x, y [rows, dim] fp32, scale [dim] fp32 addresses (small: runs on the caller, GIL held).");
  m.def(
      "rope",
      [](uintptr_t x, int64_t n, int heads, int head_dim, int rot, bool interleaved, uintptr_t cos,
         uintptr_t sin, uintptr_t y) {
        if (rot < 0 || rot % 2 || rot > head_dim) throw py::value_error("bad rotary dims");
        ftdense::rope(reinterpret_cast<const float*>(x), n, heads, head_dim, rot, interleaved,
                      reinterpret_cast<const float*>(cos), reinterpret_cast<const float*>(sin),
                      reinterpret_cast<float*>(y));
      },
      py::arg("x"), py::arg("n"), py::arg("heads"), py::arg("head_dim"), py::arg("rot"),
      py::arg("interleaved"), py::arg("cos"), py::arg("sin"), py::arg("y"),
      "x, y [n, heads, head_dim] fp32, cos/sin [n, rot/2] fp32 addresses (rope.h; GIL held).");
  m.def(
      "add_rms_norm",
      [](uintptr_t h, uintptr_t delta, int64_t rows, int dim, uintptr_t scale, float eps,
         uintptr_t y) {
        ftdense::add_rms_norm(reinterpret_cast<float*>(h), reinterpret_cast<const float*>(delta),
                              rows, dim, reinterpret_cast<const float*>(scale), eps,
                              reinterpret_cast<float*>(y));
      },
      py::arg("h"), py::arg("delta"), py::arg("rows"), py::arg("dim"), py::arg("scale"),
      py::arg("eps"), py::arg("y"),
      "h [rows, dim] += delta; y = rms_norm(h) (fp32 addresses; decode_step.h; GIL held).");
  m.def(
      "add_rows",
      [](uintptr_t h, uintptr_t delta, int64_t n) {
        ftdense::add_rows(reinterpret_cast<float*>(h), reinterpret_cast<const float*>(delta), n);
      },
      py::arg("h"), py::arg("delta"), py::arg("n"), "h [n] += delta [n] (fp32 addresses).");
  m.def(
      "route_topk",
      [](uintptr_t logits, int64_t T, int E, int k, bool softmax_first, bool renorm,
         int32_t id_offset, uintptr_t ids, uintptr_t w) {
        if (k < 1 || k > E) throw py::value_error("k must be in [1, E]");
        ftdense::route_topk(reinterpret_cast<const float*>(logits), T, E, k, softmax_first, renorm,
                            id_offset, reinterpret_cast<int32_t*>(ids), reinterpret_cast<float*>(w));
      },
      py::arg("logits"), py::arg("T"), py::arg("E"), py::arg("k"), py::arg("softmax_first"),
      py::arg("renorm"), py::arg("id_offset"), py::arg("ids"), py::arg("w"),
      "Router logits [T, E] fp32 -> ids [T, k] int32 (+ id_offset), w [T, k] fp32 (decode_step.h).");
  m.def(
      "kv_store",
      [](uintptr_t k, uintptr_t v, int64_t n, int64_t width, uintptr_t slots, uintptr_t k_pool,
         uintptr_t v_pool, bool bf16) {
        ftdense::kv_store(reinterpret_cast<const float*>(k), reinterpret_cast<const float*>(v), n,
                          width, reinterpret_cast<const int64_t*>(slots),
                          reinterpret_cast<void*>(k_pool), reinterpret_cast<void*>(v_pool), bf16);
      },
      py::arg("k"), py::arg("v"), py::arg("n"), py::arg("width"), py::arg("slots"),
      py::arg("k_pool"), py::arg("v_pool"), py::arg("bf16"),
      "k, v [n, width] fp32 (v 0: K alone) -> pool rows slots [n] int64 of k_pool / v_pool "
      "(bf16 or fp32; decode_step.h).");
  m.def(
      "embed_rows",
      [](uintptr_t w, bool bf16, int64_t vocab, int64_t dim, uintptr_t ids, int64_t n,
         uintptr_t y) {
        if (vocab < 1 || dim < 1 || n < 0) throw py::value_error("bad embedding shape");
        ftdense::embed_rows(reinterpret_cast<const void*>(w), bf16, vocab, dim,
                            reinterpret_cast<const int64_t*>(ids), n, reinterpret_cast<float*>(y));
      },
      py::arg("w"), py::arg("bf16"), py::arg("vocab"), py::arg("dim"), py::arg("ids"),
      py::arg("n"), py::arg("y"),
      "y [n, dim] fp32 = rows ids [n] int64 of w [vocab, dim] (bf16 or fp32 addresses; "
      "decode_step.h; IndexError for an id outside the vocabulary).");
  m.def(
      "argmax_rows",
      [](uintptr_t logits, int64_t B, int64_t V, uintptr_t out) {
        if (V < 1) throw py::value_error("V must be >= 1");
        ftdense::argmax_rows(reinterpret_cast<const float*>(logits), B, V,
                             reinterpret_cast<int64_t*>(out));
      },
      py::arg("logits"), py::arg("B"), py::arg("V"), py::arg("out"),
      "out [B] int64 = argmax of each row of logits [B, V] fp32 (first of ties, NaN first).");
  m.def("attention_isa", [] {
    std::lock_guard<std::mutex> lock(state().mu);
    return std::string(state().attention ? ftdense::range_kernel_name(state().attention) : "");
  });
  m.def(
      "decode_attention",
      [](uintptr_t q, int64_t q_rows, uintptr_t out, int heads, int n, uintptr_t rows,
         uintptr_t lens, uintptr_t tables, int64_t table_stride, uintptr_t k, uintptr_t v,
         bool bf16, int64_t num_pages, int page_size, int kv_heads, int d, float scale, int window,
         uintptr_t sinks) {
        const Configured c = configured();
        const ftdense::KvPages kv = kv_pages(k, v, bf16, num_pages, page_size, kv_heads, d);
        const ftdense::DecodeRows r{reinterpret_cast<const float*>(q),
                                    reinterpret_cast<float*>(out),
                                    q_rows,
                                    n,
                                    reinterpret_cast<const int32_t*>(rows),
                                    reinterpret_cast<const int32_t*>(lens),
                                    reinterpret_cast<const int32_t*>(tables),
                                    table_stride,
                                    heads,
                                    scale,
                                    window,
                                    reinterpret_cast<const float*>(sinks)};
        py::gil_scoped_release release;
        ftdense::decode_attention(*c.pool, c.attention, kv, r, c.prefill);
      },
      py::arg("q"), py::arg("q_rows"), py::arg("out"), py::arg("heads"), py::arg("n"),
      py::arg("rows"), py::arg("lens"), py::arg("tables"), py::arg("table_stride"), py::arg("k"),
      py::arg("v"), py::arg("bf16"), py::arg("num_pages"), py::arg("page_size"),
      py::arg("kv_heads"), py::arg("d"), py::arg("scale"), py::arg("window"), py::arg("sinks"),
      "Decode attention over paged K/V (see decode_attention.h); addresses: q, out [q_rows, "
      "heads, d] fp32, rows/lens [n] int32, tables [n, table_stride] int32, k/v [num_pages, "
      "page_size, kv_heads, d] bf16|fp32, sinks [heads] fp32 or 0.");
  m.def("prefill_isa", [] {
    std::lock_guard<std::mutex> lock(state().mu);
    return std::string(state().prefill ? ftdense::prefill_kernel_name(state().prefill) : "");
  });
  m.def(
      "prefill_small_rows", [](int n) { ftdense::prefill_small_rows(n); }, py::arg("n"),
      "Tiles of at most n query rows run the few-row prefill kernel, the others the tile kernel "
      "(the same bits either way); n < 0: the automatic choice. For tests and benchmarks.");
  m.def(
      "prefill_attention",
      [](uintptr_t q, int64_t q_rows, uintptr_t out, int heads, int n, uintptr_t rows,
         uintptr_t lens, uintptr_t pos, uintptr_t tables, int64_t table_stride, uintptr_t k,
         uintptr_t v, bool bf16, int64_t num_pages, int page_size, int kv_heads, int d,
         float scale, int window, uintptr_t sinks) {
        const Configured c = configured();
        const ftdense::KvPages kv = kv_pages(k, v, bf16, num_pages, page_size, kv_heads, d);
        const ftdense::PrefillChunks ch{reinterpret_cast<const float*>(q),
                                        reinterpret_cast<float*>(out),
                                        q_rows,
                                        n,
                                        reinterpret_cast<const int32_t*>(rows),
                                        reinterpret_cast<const int32_t*>(lens),
                                        reinterpret_cast<const int32_t*>(pos),
                                        reinterpret_cast<const int32_t*>(tables),
                                        table_stride,
                                        heads,
                                        scale,
                                        window,
                                        reinterpret_cast<const float*>(sinks)};
        py::gil_scoped_release release;
        ftdense::prefill_attention(*c.pool, c.prefill, kv, ch);
      },
      py::arg("q"), py::arg("q_rows"), py::arg("out"), py::arg("heads"), py::arg("n"),
      py::arg("rows"), py::arg("lens"), py::arg("pos"), py::arg("tables"),
      py::arg("table_stride"), py::arg("k"), py::arg("v"), py::arg("bf16"), py::arg("num_pages"),
      py::arg("page_size"), py::arg("kv_heads"), py::arg("d"), py::arg("scale"),
      py::arg("window"), py::arg("sinks"),
      "Causal prefill attention of n chunks over paged K/V (see prefill_attention.h); addresses: "
      "q, out [q_rows, heads, d] fp32, rows/lens/pos [n] int32, tables [n, table_stride] int32, "
      "k/v [num_pages, page_size, kv_heads, d] bf16|fp32, sinks [heads] fp32 or 0.");
  m.def(
      "linear",
      [](uintptr_t x, int T, int K, const std::vector<uintptr_t>& w, const std::vector<int>& N,
         const std::vector<uintptr_t>& y, bool bf16, bool round_input) {
        if (w.size() != N.size() || w.size() != y.size())
          throw py::value_error("w, N and y must have the same length");
        const Configured c = configured();
        const ftnative::KernelSet* ks = bf16 ? c.bf16 : c.f32;
        const ftdense::Input in{reinterpret_cast<const float*>(x), T, K, bf16, round_input};
        std::vector<ftdense::Output> outs;
        for (size_t i = 0; i < w.size(); ++i)
          outs.push_back({reinterpret_cast<const void*>(w[i]), N[i], reinterpret_cast<float*>(y[i])});
        py::gil_scoped_release release;
        ftdense::linear_any(*c.pool, *ks, c.bf16dot, in, outs);
      },
      py::arg("x"), py::arg("T"), py::arg("K"), py::arg("w"), py::arg("N"), py::arg("y"),
      py::arg("bf16"), py::arg("round_input"),
      "x [T,K] fp32 address; for each i: w[i] [N[i],K] bf16|fp32, y[i] [T,N[i]] fp32 addresses.");
  m.def("set_fp16_act_scales", &ftdense::set_fp16_act_scales, py::arg("on"),
        "Round 32-input activation scales to fp16, as llama.cpp's Q8_0 (qdot.h; process-wide).");
  m.def(
      "x8_streams",
      [](const std::string& mode) {
        if (mode == "auto") ftdense::set_x8_streams(ftdense::X8Streams::kAuto);
        else if (mode == "pair") ftdense::set_x8_streams(ftdense::X8Streams::kPair);
        else if (mode == "single") ftdense::set_x8_streams(ftdense::X8Streams::kSingle);
        else if (!mode.empty())
          throw py::value_error("x8_streams: mode must be auto, pair or single (or empty)");
        return std::string(ftdense::x8_single_stream() ? "single" : "pair");
      },
      py::arg("mode") = "",
      "How one-token calls read interleaved GGUF weights (row_tasks.h): 'single' (one group a "
      "call, no software requests), 'pair' (two groups side by side, requested ahead) or "
      "'auto' (single on AMD CPUs); '' changes nothing. Returns the mode in force.");
  m.def("qdot_isas", &ftdense::qdot_isas, "Integer-dot ISA paths this CPU runs, best first.");
  m.def("qdot_isa", [] {
    std::lock_guard<std::mutex> lock(state().mu);
    return std::string(state().qdot ? state().qdot->isa : "");
  });
  m.def(
      "quantize_act",
      [](uintptr_t x, int T, int K, uintptr_t q, uintptr_t d, uintptr_t s, const std::string& isa,
         int group) {
        if (group != ftdense::kQActBlock && group != 256)
          throw py::value_error("group must be 32 or 256");
        if (K % group) throw py::value_error("K must be a multiple of the group");
        const ftdense::QDotSet* ks;
        auto pool = qdot_call(isa, ks);
        py::gil_scoped_release release;
        ftdense::quantize_rows(*pool, *ks, reinterpret_cast<const float*>(x), T, K, group,
                               reinterpret_cast<int8_t*>(q), reinterpret_cast<float*>(d),
                               reinterpret_cast<int16_t*>(s));
      },
      py::arg("x"), py::arg("T"), py::arg("K"), py::arg("q"), py::arg("d"), py::arg("s"),
      py::arg("isa") = "", py::arg("group") = ftdense::kQActBlock,
      "Activation quantisation (qdot.h) in groups of 32 or 256 inputs: x [T,K] fp32 -> "
      "q [T,K] int8, d [T,K/32] fp32, s [T,K/32] int16 addresses.");
  m.def(
      "qlinear",
      [](uintptr_t x, int T, int K, const std::vector<uintptr_t>& w, const std::vector<int>& N,
         const std::vector<int>& types, const std::vector<uintptr_t>& y, const std::string& isa) {
        if (w.size() != N.size() || w.size() != y.size() || w.size() != types.size())
          throw py::value_error("w, N, types and y must have the same length");
        std::vector<ftdense::QOutput> outs;
        for (size_t i = 0; i < w.size(); ++i) {
          const ftdense::QType t = qtype_code(types[i]);
          if (K % ftdense::qblock_inputs(t))
            throw py::value_error("K is not a multiple of the weight type's block");
          if (N[i] < ftdense::qtype_rows(t))
            throw py::value_error("interleaved rows come in groups of 8: N must be at least 8");
          outs.push_back({reinterpret_cast<const uint8_t*>(w[i]), N[i], t,
                          reinterpret_cast<float*>(y[i])});
        }
        const ftdense::QDotSet* ks;
        auto pool = qdot_call(isa, ks);
        py::gil_scoped_release release;
        ftdense::qlinear(*pool, *ks, reinterpret_cast<const float*>(x), T, K, outs);
      },
      py::arg("x"), py::arg("T"), py::arg("K"), py::arg("w"), py::arg("N"), py::arg("types"),
      py::arg("y"), py::arg("isa") = "",
      "x [T,K] fp32 address; for each i: w[i] [N[i]] rows of GGUF blocks of qtype types[i] "
      "(0 q8_0, 1 q4_k, 2 q6_k, 3 q5_k, 4 mxfp4, 5 q5_0, 6 q4_0; 7 q4_k, 8 q6_k, 9 mxfp4, 10 q8_0, "
      "11 q5_k rows interleaved by 8), y[i] [T,N[i]] fp32. isa '' = the configured one.");
  m.def(
      "qinterleave",
      [](int qtype, uintptr_t src, uintptr_t dst, int64_t rows, int K, bool undo, bool simd) {
        const ftdense::QType t = qtype_code(qtype);
        if (K % ftdense::qblock_inputs(t) || rows < 8)
          throw py::value_error("K must be a multiple of the type's block and rows >= 8");
        py::gil_scoped_release release;
        ftdense::qinterleave(t, reinterpret_cast<const uint8_t*>(src),
                             reinterpret_cast<uint8_t*>(dst), rows, K, undo, simd);
      },
      py::arg("qtype"), py::arg("src"), py::arg("dst"), py::arg("rows"), py::arg("K"),
      py::arg("undo") = false, py::arg("simd") = true,
      "Plain q8_0 (0) / q4_k (1) / q6_k (2) / q5_k (3) / mxfp4 (4) rows [rows, bytes] at src -> "
      "the interleaved layout at dst "
      "(qdot.h), or back with undo. simd False: the scalar moves (AVX2 transposes otherwise, "
      "where the CPU has them; the same bytes).");
  ftdense_py::bind_decode_layers(m);
  ftdense_py::bind_sparse(m);
  ftdense_py::bind_tier_read(m);
  ftdense_py::bind_fill(m);
  py::class_<ftdense::QMoeSpec>(m, "QMoe",
                                "Routed experts with GGUF block-quantised banks (qmoe.h); borrows "
                                "the bank addresses.")
      .def(py::init(&qmoe_spec), py::arg("gate_up"), py::arg("down"), py::arg("gate_up_type"),
           py::arg("down_type"), py::arg("gate_up_bias"), py::arg("down_bias"),
           py::arg("bias_bf16"), py::arg("num_flat"), py::arg("hidden"), py::arg("inter"),
           py::arg("act"), py::arg("alpha"), py::arg("limit"), py::arg("chunk_bytes") = 256 << 10,
           py::arg("layers") = std::vector<QMoeLayerArg>{}, py::arg("layer_experts") = 0)
      .def(
          "forward",
          [](const ftdense::QMoeSpec& s, uintptr_t x, uintptr_t ids, uintptr_t w, uintptr_t out,
             int T, int K, const std::string& isa, uintptr_t order) {
            const ftdense::QDotSet* ks;
            auto pool = qdot_call(isa, ks);
            py::gil_scoped_release release;
            ftdense::qmoe_forward(*pool, *ks, s, reinterpret_cast<const float*>(x),
                                  reinterpret_cast<const int32_t*>(ids),
                                  reinterpret_cast<const float*>(w), reinterpret_cast<float*>(out),
                                  T, K, reinterpret_cast<const int32_t*>(order));
          },
          py::arg("x"), py::arg("ids"), py::arg("w"), py::arg("out"), py::arg("T"), py::arg("K"),
          py::arg("isa") = "", py::arg("order") = 0,
          "x [T,H] fp32, ids [T,K] int32, w [T,K] fp32, out [T,H] fp32 addresses; isa '' = the "
          "configured one; order: 0 or [T,K] int32, the key routes are summed in (qmoe.h).");
}

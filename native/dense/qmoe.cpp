#include "qmoe.h"

#include "kernels_bf16dot.h"
#include "row_tasks.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace ftdense {

namespace {

using ftnative::bf16_to_f32;

// Rows per task (row_tasks.h's rule): up tasks take rows of I (gate and up rows each), down
// tasks rows of H. Measured at T = 1 on 2 threads (Qwen3-30B-A3B geometry, Q4_K_M experts from
// DRAM): 32 / 64 rows ran the up phase at ~16 GB/s, 128 / 256 with the streams read one after
// the other at ~22.
constexpr int kUpRows[] = {128, 64, 32};
constexpr int kDownRows[] = {256, 128, 64};
// Decode (a token or two): half the tasks a thread, up to three times the rows each. Longer
// streams read faster; a phase reads too little for the rule above to need small tasks. Measured
// the same way (Q4_K_M file, layers' experts from DRAM): the MoE call 1.02-1.09x, a decode step
// 1.02x.
constexpr int kDecodeTokens = 2;
constexpr int kDecodeTasksPerThread = kTasksPerThread / 2;
constexpr int kUpRowsDecode[] = {384, 256, 128, 64, 32};
constexpr int kDownRowsDecode[] = {512, 256, 128, 64};

// A route's quantised row of K inputs inside a buffer of many (qdot.h's layout, row r at q + r*K).
struct QRows {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> s;
  int64_t K = 0, nb = 0;

  void resize(int64_t rows, int64_t k) {
    K = k;
    nb = k / kQActBlock;
    q.resize(static_cast<size_t>(rows * K));
    d.resize(static_cast<size_t>(rows * nb));
    s.resize(static_cast<size_t>(rows * nb));
  }
  int8_t* qr(int64_t r) { return q.data() + r * K; }
  float* dr(int64_t r) { return d.data() + r * nb; }
  int16_t* sr(int64_t r) { return s.data() + r * nb; }
};

struct Group {
  int64_t fid;
  int begin, n;  // routes [begin, begin + n) of the sorted order
};

struct Call {
  const QDotSet* ks;
  const QMoeSpec* spec;
  const float* x;
  float* out;
  int T = 0, K = 0, threads = 1;
  int64_t H = 0, I = 0;
  std::vector<int> pos;    // [T*K]: sorted position of route (t, k), -1 when skipped
  std::vector<int> rtok;   // per sorted route: its token
  std::vector<float> rw;   // per sorted route: its gate weight
  std::vector<uint16_t> rgroup;  // per sorted route: the activation group its gate_up reads
  std::vector<Group> groups;
  std::vector<int64_t> up_first;  // first up task of each group, then the total
  std::unique_ptr<std::atomic<int>[]> up_left;  // per group: up tasks not finished yet
  QRows xin;               // per route: its token's quantised input [H]
  std::vector<float> act;  // per route: activation [I] fp32
  QRows ain;               // per route: quantised activation [I]
  int chunk_up = 1, chunk_down = 1;  // tokens per chunk
  int up_rows = 32, down_rows = 64;  // rows per task (kUpRows, kDownRows)
};

inline float bias_at(const QMoeSpec& s, const void* base, int64_t i) {
  if (!base) return 0.f;
  return s.bias_bf16 ? bf16_to_f32(static_cast<const uint16_t*>(base)[i])
                     : static_cast<const float*>(base)[i];
}

// The same math as the float executor (native/src/executor.cpp) and banks.activate.
inline float activate(const QMoeSpec& s, float gate, float up) {
  if (s.act == MoeAct::Silu) return gate / (1.f + std::exp(-gate)) * up;
  if (s.act == MoeAct::GeluTanh) {
    const float z = 0.7978845608028654f * (gate + 0.044715f * gate * gate * gate);
    return gate / (1.f + std::exp(-2.f * z)) * up;
  }
  const float g = std::min(gate, s.limit);
  const float u = std::clamp(up, -s.limit, s.limit);
  if (s.act == MoeAct::SwigluClamp) return g / (1.f + std::exp(-g)) * u;  // DeepSeek-V4
  return (u + 1.f) * (g / (1.f + std::exp(-s.alpha * g)));
}

// Routes sorted by (expert, route index): positions, tokens, weights and expert groups. With
// ``order``, by (order, route index) instead: a caller whose ids are slots of a cache passes the
// experts' own ids there, so the routes' terms add up in the order the whole pool's would.
void plan(Call& c, const int32_t* ids, const float* w, const int32_t* order) {
  const int64_t R = static_cast<int64_t>(c.T) * c.K;
  std::vector<uint64_t> keys;
  keys.reserve(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    const int32_t id = ids[r];
    if (id == -1) continue;
    if (id < -1 || id >= c.spec->num_flat)
      throw std::out_of_range("flat expert id " + std::to_string(id) + " outside [-1, " +
                              std::to_string(c.spec->num_flat) + ")");
    const int32_t key = order ? order[r] : id;
    if (key < 0)
      throw std::out_of_range("route order " + std::to_string(key) + " of expert id " +
                              std::to_string(id) + " is negative");
    keys.push_back(static_cast<uint64_t>(key) << 32 | static_cast<uint64_t>(r));
  }
  std::sort(keys.begin(), keys.end());
  c.pos.assign(static_cast<size_t>(R), -1);
  c.rtok.resize(keys.size());
  c.rw.resize(keys.size());
  c.rgroup.resize(keys.size());
  for (size_t p = 0; p < keys.size(); ++p) {
    const int64_t r = static_cast<int64_t>(keys[p] & 0xFFFFFFFFu);
    const int64_t fid = ids[r];
    c.pos[r] = static_cast<int>(p);
    c.rtok[p] = static_cast<int>(r / c.K);
    c.rw[p] = w[r];
    const QMoeLayer& L = c.spec->layers[static_cast<size_t>(fid / c.spec->layer_experts)];
    c.rgroup[p] = static_cast<uint16_t>(act_group(L.gate_up_type));
    if (c.groups.empty() || c.groups.back().fid != fid)
      c.groups.push_back({fid, static_cast<int>(p), 0});
    ++c.groups.back().n;
  }
  const bool decode = c.T <= kDecodeTokens;
  const int64_t want = int64_t{decode ? kDecodeTasksPerThread : kTasksPerThread} * c.threads;
  const int64_t groups = c.groups.size();
  const auto up_tasks = [&](int r) { return groups * ((c.I + r - 1) / r); };
  const auto down_tasks = [&](int r) { return (c.H + r - 1) / r; };
  c.up_rows = decode ? task_rows(kUpRowsDecode, want, up_tasks)
                     : task_rows(kUpRows, want, up_tasks);
  c.down_rows = decode ? task_rows(kDownRowsDecode, want, down_tasks)
                       : task_rows(kDownRows, want, down_tasks);
  const int64_t blocks = (c.I + c.up_rows - 1) / c.up_rows;
  c.up_first.push_back(0);
  for (size_t g = 0; g < c.groups.size(); ++g) c.up_first.push_back(c.up_first.back() + blocks);
  c.up_left.reset(new std::atomic<int>[c.groups.size()]);
  for (size_t g = 0; g < c.groups.size(); ++g) c.up_left[g].store(static_cast<int>(blocks));
}

// ``rows`` weight rows from ``w`` (row bytes ``rb``, K inputs) against routes [r0, r0 + n) of
// ``in``: y[t * rows + row]. ``step`` rows a call of ``fn``; with one route, two weight streams
// side by side: two interleaved groups a call of ``pair`` where the set has it, plain rows by
// halves (two_streams). ``next`` .. ``next_end``: the stream the caller reads after this one
// (null: none), where the interleaved kernels' requests past this one's end go (X8Stream).
void rows_call(QRowFn fn, QRowFn pair, int step, int rows, const uint8_t* w, int64_t rb, int K,
               QRows& in, int r0, int n, float* y, const uint8_t* next,
               const uint8_t* next_end) {
  const bool single = x8_single_stream();  // (row_tasks.h)
  if (single) pair = nullptr;
  const X8StreamScope stream(w + rows * rb, next, next_end, single);  // (interleaved kernels)
  if (step == 1 && n == 1 && rows >= kTwoStreamRows) {
    two_streams(rows, w, rb, [&](int r) {
      fn(w + r * rb, K, in.qr(r0), in.dr(r0), in.sr(r0), n, y + r, rows);
    });
    return;
  }
  int j = 0;
  if (pair && n == 1)
    for (; j + 2 * step <= rows; j += 2 * step)
      pair(w + j * rb, K, in.qr(r0), in.dr(r0), in.sr(r0), n, y + j, rows);
  for (; j < rows; j += step) fn(w + j * rb, K, in.qr(r0), in.dr(r0), in.sr(r0), n, y + j, rows);
}

// Phase quant, one task per token: quantise x[t] into the first row of its routes that read
// each activation group (qdot.h; layers of different types can read different ones), copy to
// the rest.
void quant_task(void* ctx, int64_t t) {
  Call& c = *static_cast<Call*>(ctx);
  int first32 = -1, first256 = -1;
  for (int k = 0; k < c.K; ++k) {
    const int p = c.pos[t * c.K + k];
    if (p < 0) continue;
    const int group = c.rgroup[static_cast<size_t>(p)];
    int& first = group == kQActBlock ? first32 : first256;
    if (first < 0) {
      first = p;
      c.ks->quantize(c.x + t * c.H, static_cast<int>(c.H), group, c.xin.qr(p), c.xin.dr(p),
                     c.xin.sr(p));
      continue;
    }
    std::memcpy(c.xin.qr(p), c.xin.qr(first), static_cast<size_t>(c.H));
    std::memcpy(c.xin.dr(p), c.xin.dr(first), sizeof(float) * c.xin.nb);
    std::memcpy(c.xin.sr(p), c.xin.sr(first), sizeof(int16_t) * c.xin.nb);
  }
}

// Phase up, one task per (expert, block of up_rows rows of I).
void up_task(void* ctx, int64_t task) {
  Call& c = *static_cast<Call*>(ctx);
  const QMoeSpec& s = *c.spec;
  const size_t gi = static_cast<size_t>(
      std::upper_bound(c.up_first.begin(), c.up_first.end(), task) - c.up_first.begin() - 1);
  const Group& g = c.groups[gi];
  const int64_t j0 = (task - c.up_first[gi]) * c.up_rows, j1 = std::min(c.I, j0 + c.up_rows);
  const int rows = static_cast<int>(j1 - j0);
  const QMoeLayer& L = s.layers[static_cast<size_t>(g.fid / s.layer_experts)];
  const int64_t e = g.fid % s.layer_experts;
  const int64_t rb = qrow_bytes(L.gate_up_type, c.H);
  const QRowFn fn = c.ks->row[static_cast<int>(L.gate_up_type)];
  const QRowFn pair = pair_kernel(*c.ks, L.gate_up_type);
  const int step = qtype_rows(L.gate_up_type);  // I and up_rows are multiples of it
  const uint8_t* wg = L.gate_up + (e * 2 * c.I + j0) * rb;  // gate rows; up rows I later
  const uint8_t* wu = wg + c.I * rb;
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(2 * rows * c.chunk_up));
  float* yg = scratch.data();
  float* yu = yg + rows * c.chunk_up;
  const int64_t bias_row = g.fid * 2 * c.I;
  // the streams' first lines: the gate rows' now, the up rows' (read after them) into L2
  if (starts_stream(step)) {
    prefetch_stream_start<3>(wg, wg + rows * rb);
    prefetch_stream_start<2>(wu, wu + rows * rb);
  }
  for (int t0 = 0; t0 < g.n; t0 += c.chunk_up) {
    const int n = std::min(c.chunk_up, g.n - t0);
    const int r0 = g.begin + t0;
    const bool again = t0 + c.chunk_up < g.n;  // the gate rows are read next, for more routes
    rows_call(fn, pair, step, rows, wg, rb, static_cast<int>(c.H), c.xin, r0, n, yg, wu,
              wu + rows * rb);
    rows_call(fn, pair, step, rows, wu, rb, static_cast<int>(c.H), c.xin, r0, n, yu,
              again ? wg : nullptr, again ? wg + rows * rb : nullptr);
    for (int t = 0; t < n; ++t) {
      float* a = c.act.data() + (r0 + t) * c.I + j0;
      for (int j = 0; j < rows; ++j) {
        const float gv = yg[t * rows + j] + bias_at(s, s.gate_up_bias, bias_row + j0 + j);
        const float uv = yu[t * rows + j] + bias_at(s, s.gate_up_bias, bias_row + c.I + j0 + j);
        a[j] = activate(s, gv, uv);
      }
    }
  }
  // The last block of this expert to finish quantises its act rows for the down phase.
  if (c.up_left[gi].fetch_sub(1, std::memory_order_acq_rel) == 1)
    for (int r = g.begin; r < g.begin + g.n; ++r)
      c.ks->quantize(c.act.data() + r * c.I, static_cast<int>(c.I), act_group(L.down_type),
                     c.ain.qr(r), c.ain.dr(r), c.ain.sr(r));
}

// Phase down, one task per block of down_rows rows of H, over every expert.
void down_task(void* ctx, int64_t task) {
  Call& c = *static_cast<Call*>(ctx);
  const QMoeSpec& s = *c.spec;
  const int64_t h0 = task * c.down_rows, h1 = std::min(c.H, h0 + c.down_rows);
  const int rows = static_cast<int>(h1 - h0);
  for (int t = 0; t < c.T; ++t) std::memset(c.out + t * c.H + h0, 0, sizeof(float) * rows);
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(rows * c.chunk_down));
  float* y = scratch.data();
  // this task's rows of group g's expert: its weight stream
  const auto stream = [&](const Group& g) -> std::pair<const uint8_t*, const uint8_t*> {
    const QMoeLayer& L = s.layers[static_cast<size_t>(g.fid / s.layer_experts)];
    const int64_t rb = qrow_bytes(L.down_type, c.I);
    const uint8_t* first = L.down + ((g.fid % s.layer_experts) * c.H + h0) * rb;
    return {first, first + rows * rb};
  };
  const auto [first, end] = stream(c.groups[0]);
  const auto request = [&](const Group& g) {
    const QMoeLayer& L = s.layers[static_cast<size_t>(g.fid / s.layer_experts)];
    return starts_stream(qtype_rows(L.down_type));
  };
  if (request(c.groups[0])) prefetch_stream_start<3>(first, end);
  for (size_t gi = 0; gi < c.groups.size(); ++gi) {
    const Group& g = c.groups[gi];
    const QMoeLayer& L = s.layers[static_cast<size_t>(g.fid / s.layer_experts)];
    const int64_t rb = qrow_bytes(L.down_type, c.I);
    const QRowFn fn = c.ks->row[static_cast<int>(L.down_type)];
    const QRowFn pair = pair_kernel(*c.ks, L.down_type);
    const int step = qtype_rows(L.down_type);  // H and down_rows are multiples of it
    const uint8_t* wd = stream(g).first;
    if (gi + 1 < c.groups.size()) {  // the next expert's first lines, into L2 (see up_task)
      const auto [next, next_end] = stream(c.groups[gi + 1]);
      if (request(c.groups[gi + 1])) prefetch_stream_start<2>(next, next_end);
    }
    for (int t0 = 0; t0 < g.n; t0 += c.chunk_down) {
      const int n = std::min(c.chunk_down, g.n - t0);
      const int r0 = g.begin + t0;
      // read next: these rows again (more routes), the next expert's, or nothing
      std::pair<const uint8_t*, const uint8_t*> next{nullptr, nullptr};
      if (t0 + c.chunk_down < g.n)
        next = {wd, wd + rows * rb};
      else if (gi + 1 < c.groups.size())
        next = stream(c.groups[gi + 1]);
      rows_call(fn, pair, step, rows, wd, rb, static_cast<int>(c.I), c.ain, r0, n, y,
                next.first, next.second);
      for (int t = 0; t < n; ++t) {
        const int r = r0 + t;
        float* o = c.out + static_cast<int64_t>(c.rtok[r]) * c.H + h0;
        const float wt = c.rw[r];
        for (int h = 0; h < rows; ++h)
          o[h] += wt * (y[t * rows + h] + bias_at(s, s.down_bias, g.fid * c.H + h0 + h));
      }
    }
  }
}

}  // namespace

void qmoe_check(const QMoeSpec& s) {
  if (s.num_flat <= 0 || s.hidden <= 0 || s.inter <= 0)
    throw std::invalid_argument("bank shapes must be positive");
  if (s.layers.empty() || s.layer_experts <= 0 ||
      s.num_flat != static_cast<int64_t>(s.layers.size()) * s.layer_experts)
    throw std::invalid_argument("num_flat must be the number of layers times layer_experts");
  for (const QMoeLayer& L : s.layers) {
    if (!L.gate_up || !L.down) throw std::invalid_argument("gate_up and down are required");
    for (const QType t : {L.gate_up_type, L.down_type})
      if (static_cast<int>(t) < 0 || static_cast<int>(t) >= kNumQTypes)
        throw std::invalid_argument("unknown qtype " + std::to_string(static_cast<int>(t)));
    if (s.inter % qtype_rows(L.gate_up_type) || s.hidden % qtype_rows(L.down_type))
      throw std::invalid_argument("interleaved rows come in groups of 8: a row count is not a multiple");
    if (s.hidden % qblock_inputs(L.gate_up_type))
      throw std::invalid_argument("hidden size is not a multiple of the gate_up type's block");
    if (s.inter % qblock_inputs(L.down_type))
      throw std::invalid_argument(
          "moe intermediate size is not a multiple of the down type's block");
  }
}

void qmoe_forward(Pool& pool, const QDotSet& ks, const QMoeSpec& spec, const float* x,
                  const int32_t* ids, const float* w, float* out, int T, int K,
                  const int32_t* order) {
  if (T <= 0) return;
  Call c;
  c.ks = &ks;
  c.spec = &spec;
  c.x = x;
  c.out = out;
  c.T = T;
  c.K = K;
  c.H = spec.hidden;
  c.I = spec.inter;
  c.threads = pool.threads();
  plan(c, ids, w, order);
  if (c.groups.empty()) {
    std::memset(out, 0, sizeof(float) * T * c.H);
    return;
  }
  const int64_t routes = static_cast<int64_t>(c.rtok.size());
  c.xin.resize(routes, c.H);
  c.act.resize(static_cast<size_t>(routes * c.I));
  c.ain.resize(routes, c.I);
  c.chunk_up = static_cast<int>(std::max<int64_t>(1, spec.chunk_bytes / c.H));
  c.chunk_down = static_cast<int>(std::max<int64_t>(1, spec.chunk_bytes / c.I));
  if (T <= kDecodeTokens)  // a pool job costs more than quantising a row or two
    for (int t = 0; t < T; ++t) quant_task(&c, t);
  else
    pool.run(quant_task, &c, T);
  pool.run(up_task, &c, c.up_first.back());
  pool.run(down_task, &c, (c.H + c.down_rows - 1) / c.down_rows);
}

}  // namespace ftdense

#include "decode_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "cpu_features.h"
#include "kernels_bf16dot.h"
#include "prefill_attention.h"

namespace ftdense {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// A task reads at least this many keys (when there are that many): below it the merge and the
// task hand-out cost more than the second core saves.
constexpr int64_t kMinSplitKeys = 512;
// Tasks wanted per pool thread, so a thread that starts late still finds work.
constexpr int kTasksPerThread = 4;

inline float widen(const void* base, int64_t i, bool bf16) {
  return bf16 ? ftnative::bf16_to_f32(static_cast<const uint16_t*>(base)[i])
              : static_cast<const float*>(base)[i];
}

// Keys of a task that every one of its KV heads folds in before the next block: with all KV
// heads in one task, a block's pool rows (kT keys x kv_heads x d, K and V) are read from DRAM
// once, whole and in order, then the other heads find them in L2.
constexpr int64_t kBlockKeys = 64;

// Keys [k0, k1) of one query for KV heads [h0, h1); split s of the query's keys.
struct Task {
  int query;  // index into rows / lens / tables
  int h0, h1;
  int64_t k0, k1;
  int64_t slot;  // partial state of (query, split, KV head h0)
};

struct Job {
  RangeFn fn;
  const KvPages* kv;
  const DecodeRows* rows;
  int G;
  std::vector<Task> tasks;
  std::vector<int64_t> first_slot;  // per query: its [splits, kv_heads] partial states; then end
  std::vector<float> parts;         // per slot: m [G], l [G], acc [G, d]
};

int64_t part_floats(int G, int d) { return static_cast<int64_t>(G) * (d + 2); }

void run_task(void* ctx, int64_t t) {
  const Job& j = *static_cast<const Job*>(ctx);
  const Task& tk = j.tasks[t];
  const DecodeRows& r = *j.rows;
  const int d = j.kv->d, G = j.G;
  const int64_t pf = part_floats(G, d);
  const float* q = r.q + static_cast<int64_t>(r.rows[tk.query]) * r.heads * d;
  const int32_t* table = r.tables + tk.query * r.table_stride;
  // Tasks own disjoint slots; a fresh state: m = -inf, l = 0, acc = 0.
  float* base = const_cast<float*>(j.parts.data()) + tk.slot * pf;
  for (int h = tk.h0; h < tk.h1; ++h) {
    float* part = base + (h - tk.h0) * pf;
    std::fill(part, part + G, -std::numeric_limits<float>::infinity());
    std::fill(part + G, part + pf, 0.0f);
  }
  for (int64_t b0 = tk.k0; b0 < tk.k1; b0 += kBlockKeys) {
    const int64_t b1 = std::min(tk.k1, b0 + kBlockKeys);
    for (int h = tk.h0; h < tk.h1; ++h) {
      float* part = base + (h - tk.h0) * pf;
      const KeyRange kr{q + static_cast<int64_t>(h) * G * d, G, r.scale, table, h, b0, b1,
                        part, part + G, part + 2 * G, tk.k1};
      j.fn(*j.kv, kr);
    }
  }
}

void validate(const KvPages& kv, const DecodeRows& r) {
  if (r.heads <= 0 || kv.kv_heads <= 0 || r.heads % kv.kv_heads != 0)
    throw std::invalid_argument("heads must be a positive multiple of kv_heads");
  if (kv.d <= 0 || kv.page_size <= 0 || r.window < 0)
    throw std::invalid_argument("bad head_dim, page_size or window");
  for (int i = 0; i < r.n; ++i) {
    const int64_t len = r.lens[i];
    if (len < 1 || len > r.table_stride * kv.page_size)
      throw std::invalid_argument("a context length is < 1 or exceeds its page table");
    if (r.rows[i] < 0 || r.rows[i] >= r.q_rows)
      throw std::invalid_argument("a query row is out of range");
    const int64_t lo = r.window > 0 ? std::max<int64_t>(0, len - r.window) : 0;
    const int32_t* table = r.tables + i * r.table_stride;
    for (int64_t p = lo / kv.page_size; p <= (len - 1) / kv.page_size; ++p)
      if (table[p] < 0 || table[p] >= kv.num_pages)
        throw std::invalid_argument("a page id is outside the pool");
  }
}

// A query's keys are split into up to `want` ranges of at least kMinSplitKeys (long contexts:
// every pool thread streams its own part of the pages); when that gives fewer than `want`
// tasks, its KV heads are spread over tasks as well (short contexts, one sequence).
void plan(Job& j, int threads) {
  const DecodeRows& r = *j.rows;
  const int kvh = j.kv->kv_heads;
  const int64_t want = threads > 1 ? (threads * kTasksPerThread + r.n - 1) / r.n : 1;
  j.first_slot.assign(1, 0);
  for (int i = 0; i < r.n; ++i) {
    const int64_t len = r.lens[i];
    const int64_t lo = r.window > 0 ? std::max<int64_t>(0, len - r.window) : 0;
    const int64_t keys = len - lo;
    const int64_t splits = std::max<int64_t>(1, std::min(want, keys / kMinSplitKeys));
    const int64_t head_tasks = std::max<int64_t>(1, std::min<int64_t>(kvh, want / splits));
    const int hb = static_cast<int>((kvh + head_tasks - 1) / head_tasks);
    for (int64_t s = 0; s < splits; ++s)
      for (int h0 = 0; h0 < kvh; h0 += hb)
        j.tasks.push_back({i, h0, std::min(kvh, h0 + hb), lo + keys * s / splits,
                           lo + keys * (s + 1) / splits, j.first_slot.back() + s * kvh + h0});
    j.first_slot.push_back(j.first_slot.back() + splits * kvh);
  }
  j.parts.resize(j.first_slot.back() * part_floats(j.G, j.kv->d));
}

// out[head] = sum_s acc_s e^(m_s - M) / (sum_s l_s e^(m_s - M) + e^(sink - M)) over the splits s
// of query i's KV head h, M the largest of their maxima and the sink.
void merge(const Job& j, int i, int h) {
  const DecodeRows& r = *j.rows;
  const int d = j.kv->d, G = j.G, kvh = j.kv->kv_heads, h0 = h * G;
  const int64_t pf = part_floats(G, d);
  const int64_t splits = (j.first_slot[i + 1] - j.first_slot[i]) / kvh;
  const float* parts = j.parts.data() + (j.first_slot[i] + h) * pf;  // split s at s * kvh * pf
  float* out = r.out + static_cast<int64_t>(r.rows[i]) * r.heads * d;
  std::vector<float> w(splits);
  for (int g = 0; g < G; ++g) {
    float mx = r.sinks ? r.sinks[h0 + g] : kNegInf;
    for (int64_t s = 0; s < splits; ++s) mx = std::max(mx, parts[s * kvh * pf + g]);
    float den = r.sinks ? std::exp(r.sinks[h0 + g] - mx) : 0.0f;
    for (int64_t s = 0; s < splits; ++s) {
      const float m = parts[s * kvh * pf + g];
      w[s] = m == kNegInf ? 0.0f : std::exp(m - mx);
      den += parts[s * kvh * pf + G + g] * w[s];
    }
    float* o = out + static_cast<int64_t>(h0 + g) * d;
    std::fill(o, o + d, 0.0f);
    for (int64_t s = 0; s < splits; ++s) {
      const float* acc = parts + s * kvh * pf + 2 * G + static_cast<int64_t>(g) * d;
      const float ws = w[s] / den;
      for (int e = 0; e < d; ++e) o[e] += acc[e] * ws;
    }
  }
}

// The queries as prompt chunks through a prefill tile kernel (decode_attention.h): query i a row
// at position lens[i] - 1; consecutive queries of one sequence (rows r, r + 1, .. at positions
// p, p + 1, .. with the same page table: a short prompt chunk the decode step runs as rows) one
// chunk, whose tiles read each key block once for all its rows. The bits are the same either way.
void prefill_rows(Pool& pool, PrefillFn fn, const KvPages& kv, const DecodeRows& r) {
  thread_local std::vector<int32_t> first, len, pos, tables;  // no allocation a layer and step
  first.clear(), len.clear(), pos.clear(), tables.clear();
  const int64_t ts = r.table_stride;
  for (int i = 0; i < r.n; ++i) {
    const int32_t p = r.lens[i] - 1;
    const int32_t* table = r.tables + i * ts;
    if (!first.empty() && r.rows[i] == first.back() + len.back() && p == pos.back() + len.back() &&
        std::equal(table, table + p / kv.page_size + 1, tables.end() - ts)) {
      ++len.back();
      continue;
    }
    first.push_back(r.rows[i]);
    len.push_back(1);
    pos.push_back(p);
    tables.insert(tables.end(), table, table + ts);
  }
  const PrefillChunks c{r.q,          r.out,      r.q_rows,   static_cast<int>(first.size()),
                        first.data(), len.data(), pos.data(), tables.data(),
                        ts,           r.heads,    r.scale,    r.window,
                        r.sinks};
  prefill_attention(pool, fn, kv, c);
}

}  // namespace

void range_scalar(const KvPages& kv, const KeyRange& r) {
  const int d = kv.d, G = r.G;
  const int64_t row_stride = static_cast<int64_t>(kv.kv_heads) * d;
  thread_local std::vector<float> kf, vf;
  kf.resize(d);
  vf.resize(d);
  for (int64_t p = r.k0; p < r.k1; ++p) {
    const int64_t off = (static_cast<int64_t>(r.table[p / kv.page_size]) * kv.page_size +
                         p % kv.page_size) * row_stride + static_cast<int64_t>(r.kv_head) * d;
    for (int e = 0; e < d; ++e) {
      kf[e] = widen(kv.k, off + e, kv.bf16);
      vf[e] = widen(kv.v, off + e, kv.bf16);
    }
    for (int g = 0; g < G; ++g) {
      const float* q = r.q + static_cast<int64_t>(g) * d;
      float dot = 0.0f;
      for (int e = 0; e < d; ++e) dot += q[e] * kf[e];
      const float s = dot * r.scale;
      float* acc = r.acc + static_cast<int64_t>(g) * d;
      if (s > r.m[g]) {  // a new maximum: rescale what was summed so far
        const float corr = r.m[g] == kNegInf ? 0.0f : std::exp(r.m[g] - s);
        r.l[g] *= corr;
        for (int e = 0; e < d; ++e) acc[e] *= corr;
        r.m[g] = s;
      }
      const float w = std::exp(s - r.m[g]);
      r.l[g] += w;
      for (int e = 0; e < d; ++e) acc[e] += w * vf[e];
    }
  }
}

RangeFn range_kernel(const std::string& isa) {
#ifndef FTNATIVE_NO_X86
  if ((isa == "avx2" || isa == "avx512") && ftnative::isa_supported("avx2")) return range_avx2;
#endif
  (void)isa;
  return range_scalar;
}

const char* range_kernel_name(RangeFn fn) {
#ifndef FTNATIVE_NO_X86
  if (fn == range_avx2) return "avx2";
#endif
  (void)fn;
  return "scalar";
}

void decode_attention(Pool& pool, RangeFn fn, const KvPages& kv, const DecodeRows& rows,
                      PrefillFn prefill) {
  validate(kv, rows);
  if (rows.n == 0) return;
  if (prefill && prefill_kernel_dot(prefill) && kv.bf16 && prefill_supported(kv.d)) {
    prefill_rows(pool, prefill, kv, rows);
    return;
  }
  Job j;
  j.fn = fn == range_scalar || kv.d % 8 == 0 ? fn : range_scalar;  // AVX2 needs d % 8 == 0
  j.kv = &kv;
  j.rows = &rows;
  j.G = rows.heads / kv.kv_heads;
  plan(j, pool.threads());
  pool.run(run_task, &j, static_cast<int64_t>(j.tasks.size()));
  for (int i = 0; i < rows.n; ++i)
    for (int h = 0; h < kv.kv_heads; ++h) merge(j, i, h);
}

}  // namespace ftdense

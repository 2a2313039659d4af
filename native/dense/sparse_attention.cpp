#include "sparse_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>

#include "cpu_features.h"
#include "kernels_bf16dot.h"

namespace ftdense {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// A task scores / attends at least this many keys (when there are that many): below it the
// hand-out and the merge cost more than a second core saves.
constexpr int64_t kMinIndexKeys = 512;
constexpr int64_t kMinAttendKeys = 128;
constexpr int kTasksPerThread = 4;
// Keys whose row pointers a scoring task resolves at a time (bounded work buffer).
constexpr int64_t kIndexBlock = 256;

inline float widen(const char* row, int64_t i, bool bf16) {
  return bf16 ? ftnative::bf16_to_f32(reinterpret_cast<const uint16_t*>(row)[i])
              : reinterpret_cast<const float*>(row)[i];
}

void widen_row(const char* row, int d, bool bf16, float* out) {
  for (int e = 0; e < d; ++e) out[e] = widen(row, e, bf16);
}

}  // namespace

void RowSource::check(int64_t p0, int64_t p1) const {
  if (p0 < 0) throw std::invalid_argument("a negative position");
  if (p1 <= p0) return;
  if (table == nullptr) {
    if (p1 > num_rows) throw std::invalid_argument("a position is outside the rows");
    return;
  }
  if (page_size < 1) throw std::invalid_argument("bad page size");
  if ((p1 - 1) / page_size >= table_len)
    throw std::invalid_argument("a position is past its page table");
  for (int64_t pg = p0 / page_size; pg <= (p1 - 1) / page_size; ++pg)
    if (table[pg] < 0 || (static_cast<int64_t>(table[pg]) + 1) * page_size > num_rows)
      throw std::invalid_argument("a page id is outside the pool");
}

void sparse_scalar(const SparseQuery& sq, const char* const* rows, bool bf16, int64_t k0,
                   int64_t k1, int h0, int h1, float* m, float* l, float* acc) {
  const int dk = sq.dk, dv = sq.dv;
  thread_local std::vector<float> kf;
  kf.resize(dk);
  for (int64_t j = k0; j < k1; ++j) {
    widen_row(rows[j], dk, bf16, kf.data());
    for (int h = h0; h < h1; ++h) {
      const float* q = sq.q + static_cast<int64_t>(h) * dk;
      float dot = 0.0f;
      for (int e = 0; e < dk; ++e) dot += q[e] * kf[e];
      const float s = dot * sq.scale;
      const int g = h - h0;
      float* a = acc + static_cast<int64_t>(g) * dv;
      if (s > m[g]) {  // a new maximum: rescale what was summed so far
        const float corr = m[g] == kNegInf ? 0.0f : std::exp(m[g] - s);
        l[g] *= corr;
        for (int e = 0; e < dv; ++e) a[e] *= corr;
        m[g] = s;
      }
      const float p = std::exp(s - m[g]);
      l[g] += p;
      for (int e = 0; e < dv; ++e) a[e] += p * kf[e];
    }
  }
}

const SparseKernels& sparse_kernels(const std::string& isa) {
  static const SparseKernels scalar{index_scalar, sparse_scalar, "scalar", "scalar"};
  static const SparseKernels emu512{index_emu512, sparse_scalar, "scalar", "emu512"};
#ifndef FTNATIVE_NO_X86
  static const SparseKernels avx2{index_avx2, sparse_avx2, "avx2", "avx2"};
  static const SparseKernels avx512{index_avx512, sparse_avx2, "avx2", "avx512"};
  if (isa == "avx512" && ftnative::isa_supported("avx512")) return avx512;
  if ((isa == "avx2" || isa == "avx512") && ftnative::isa_supported("avx2")) return avx2;
#endif
  if (isa == "emu512") return emu512;
  return scalar;
}

namespace {

struct IndexJob {
  IndexFn fn;
  const float* q;
  const float* w;
  int heads, dim;
  float scale;
  const RowSource* keys;
  int64_t n, per_task;
  float* scores;
};

void index_task(void* ctx, int64_t t) {
  const IndexJob& j = *static_cast<const IndexJob*>(ctx);
  thread_local std::vector<const char*> ptrs;
  ptrs.resize(kIndexBlock);
  const int64_t c1 = std::min(j.n, (t + 1) * j.per_task);
  for (int64_t b0 = t * j.per_task; b0 < c1; b0 += kIndexBlock) {
    const int nb = static_cast<int>(std::min(kIndexBlock, c1 - b0));
    for (int i = 0; i < nb; ++i) ptrs[i] = j.keys->at(b0 + i);
    j.fn(j.q, j.w, j.heads, j.dim, j.scale, ptrs.data(), j.keys->bf16, nb, j.scores + b0);
  }
}

// Partial softmax states of a sparse_attention call: split s, head h at index s * heads + h.
struct AttendJob {
  SparseFn fn;
  const SparseQuery* sq;
  const char* const* rows;
  bool bf16;
  int64_t n, splits;
  int hb, head_tasks;
  const float* sinks;
  float* out;
  std::vector<float> m, l, acc;
};

void attend_task(void* ctx, int64_t t) {
  AttendJob& j = *static_cast<AttendJob*>(ctx);
  const int64_t s = t / j.head_tasks;
  const int h0 = static_cast<int>(t % j.head_tasks) * j.hb;
  const int h1 = std::min(j.sq->heads, h0 + j.hb);
  const int64_t k0 = j.n * s / j.splits, k1 = j.n * (s + 1) / j.splits;
  const int64_t slot = s * j.sq->heads + h0;
  const int dv = j.sq->dv;
  float* m = j.m.data() + slot;
  float* l = j.l.data() + slot;
  float* acc = j.acc.data() + slot * dv;
  std::fill(m, m + (h1 - h0), kNegInf);
  std::fill(l, l + (h1 - h0), 0.0f);
  std::fill(acc, acc + static_cast<int64_t>(h1 - h0) * dv, 0.0f);
  j.fn(*j.sq, j.rows, j.bf16, k0, k1, h0, h1, m, l, acc);
}

// out[h] = sum_s acc_s e^(m_s - M) / (sum_s l_s e^(m_s - M) + e^(sink - M)), M the largest of
// the splits' maxima and the sink.
void merge_task(void* ctx, int64_t h) {
  const AttendJob& j = *static_cast<const AttendJob*>(ctx);
  const int heads = j.sq->heads, dv = j.sq->dv;
  float mx = j.sinks ? j.sinks[h] : kNegInf;
  for (int64_t s = 0; s < j.splits; ++s) mx = std::max(mx, j.m[s * heads + h]);
  float den = j.sinks ? std::exp(j.sinks[h] - mx) : 0.0f;
  std::vector<float> ws(j.splits);
  for (int64_t s = 0; s < j.splits; ++s) {
    const float m = j.m[s * heads + h];
    ws[s] = m == kNegInf ? 0.0f : std::exp(m - mx);
    den += j.l[s * heads + h] * ws[s];
  }
  float* o = j.out + h * dv;
  std::fill(o, o + dv, 0.0f);
  for (int64_t s = 0; s < j.splits; ++s) {
    const float* a = j.acc.data() + (s * heads + h) * dv;
    const float f = ws[s] / den;
    for (int e = 0; e < dv; ++e) o[e] += a[e] * f;
  }
}

}  // namespace

void index_topk(Pool& pool, const SparseKernels& ks, const float* q, const float* w, int heads,
                int dim, float scale, const RowSource& keys, int64_t n, int k, int32_t* sel,
                float* scores) {
  if (heads < 1 || dim < 1 || k < 1 || n < 1) throw std::invalid_argument("bad indexer shape");
  keys.check(0, n);
  const int64_t want = static_cast<int64_t>(pool.threads()) * kTasksPerThread;
  const int64_t tasks = std::max<int64_t>(1, std::min(want, n / kMinIndexKeys));
  std::vector<float> own;
  if (scores == nullptr) {
    own.resize(n);
    scores = own.data();
  }
  IndexJob j{ks.index, q, w, heads, dim, scale, &keys, n,
             (n + tasks - 1) / tasks, scores};
  pool.run(index_task, &j, tasks);
  // best first, equal scores lower position first; NaN ranks as -inf (a strict weak order)
  const auto key = [scores](int32_t p) {
    const float s = scores[p];
    return std::isnan(s) ? kNegInf : s;
  };
  const auto better = [&key](int32_t a, int32_t b) {
    const float sa = key(a), sb = key(b);
    return sa > sb || (sa == sb && a < b);
  };
  std::vector<int32_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  const int64_t m = std::min<int64_t>(k, n);
  if (m < n) std::nth_element(idx.begin(), idx.begin() + m, idx.end(), better);
  std::sort(idx.begin(), idx.begin() + m, better);
  std::copy(idx.begin(), idx.begin() + m, sel);
}

void sparse_attention(Pool& pool, const SparseKernels& ks, const SparseQuery& sq,
                      const std::vector<const char*>& rows, bool bf16, const float* sinks,
                      float* out) {
  const int64_t n = static_cast<int64_t>(rows.size());
  if (sq.heads < 1 || sq.dk < 1 || sq.dv < 1 || sq.dv > sq.dk)
    throw std::invalid_argument("bad sparse attention shape (dv must be <= dk)");
  if (n < 1) throw std::invalid_argument("sparse attention needs at least one row");
  AttendJob j;
  j.fn = sq.dk % 8 == 0 && sq.dv % 8 == 0 ? ks.attend : sparse_scalar;
  j.sq = &sq;
  j.rows = rows.data();
  j.bf16 = bf16;
  j.n = n;
  j.sinks = sinks;
  j.out = out;
  const int64_t want = pool.threads() > 1 ? pool.threads() * kTasksPerThread : 1;
  j.splits = std::max<int64_t>(1, std::min(want, n / kMinAttendKeys));
  // the rest of the tasks wanted over head blocks of a multiple of 8 heads (the AVX2 kernel's
  // head block)
  const int64_t blocks = (sq.heads + 7) / 8;
  const int64_t per = std::max<int64_t>(1, blocks / std::max<int64_t>(1, want / j.splits));
  j.hb = std::min<int>(sq.heads, static_cast<int>(per * 8));
  j.head_tasks = (sq.heads + j.hb - 1) / j.hb;
  j.m.resize(j.splits * sq.heads);
  j.l.resize(j.splits * sq.heads);
  j.acc.resize(j.splits * sq.heads * sq.dv);
  pool.run(attend_task, &j, j.splits * j.head_tasks);
  pool.run(merge_task, &j, sq.heads);
}

}  // namespace ftdense

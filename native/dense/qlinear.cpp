#include "qlinear.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <vector>

#ifndef FTNATIVE_NO_X86
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "qdot_common.h"
#include "qdot_x8_layout.h"
#include "row_tasks.h"


namespace ftdense {

namespace {

std::atomic<int> g_x8_streams{static_cast<int>(X8Streams::kAuto)};

bool amd_cpu() {
#ifndef FTNATIVE_NO_X86
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
  char vendor[13];
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  vendor[12] = 0;
  return std::strcmp(vendor, "AuthenticAMD") == 0;
#else
  return false;
#endif
}

// Weight rows per task (row_tasks.h's rule; measured at T = 1, 2 threads, from DRAM, against
// 64-row tasks in alternated runs on a noisy machine: Q4_K 65536 x 2048 at 21-30 GB/s instead
// of 13-24).
constexpr int kRowsPerTask[] = {256, 128, 64};
constexpr int64_t kChunkBytes = 256 << 10;  // a token chunk's quantised input stays in L2
// Plain rows are prefetched kStreamAheadBytes ahead of the row being computed: one task reads
// its rows as one sequential stream, which the hardware prefetchers alone do not keep deep
// enough to reach the memory bandwidth from one core (measured on a busy 2-core VM, one
// thread, T = 1, thread CPU time: Q4_K read 6.5 GB/s from DRAM without and 9 GB/s with it, on
// a core that computes 16 GB/s from cache).

#ifndef FTNATIVE_NO_X86
bool has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}
bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}
#endif

struct QuantJob {
  const QDotSet* ks;
  const float* x;
  int K, group;
  int8_t* q;
  float* d;
  int16_t* s;
};

void quant_task(void* ctx, int64_t t) {
  const QuantJob& j = *static_cast<const QuantJob*>(ctx);
  const int64_t na = j.K / kQActBlock;
  j.ks->quantize(j.x + t * j.K, j.K, j.group, j.q + t * j.K, j.d + t * na, j.s + t * na);
}

// The quantised input rows of one activation group (qdot.h).
struct Acts {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> s;
};

struct Job {
  const QDotSet* ks;
  const std::vector<QOutput>* outs;
  std::vector<int64_t> first_task;  // per output, then the total
  int T = 0, K = 0, chunk = 1, rows_per_task = 64;
  Acts a32, a256;  // the input in each group an output reads (empty when none does)
};

void dot_task(void* ctx, int64_t task) {
  const Job& j = *static_cast<const Job*>(ctx);
  size_t o = 0;
  while (task >= j.first_task[o + 1]) ++o;
  const QOutput& out = (*j.outs)[o];
  const int r0 = static_cast<int>(task - j.first_task[o]) * j.rows_per_task;
  const int r1 = std::min(out.N, r0 + j.rows_per_task);
  const int64_t rb = qrow_bytes(out.type, j.K), na = j.K / kQActBlock;
  const QRowFn fn = j.ks->row[static_cast<int>(out.type)];
  const QRowFn plain = j.ks->row[static_cast<int>(qtype_base(out.type))];
  const bool single = x8_single_stream();  // (row_tasks.h)
  const QRowFn pair = single ? nullptr : pair_kernel(*j.ks, out.type);
  const int step = qtype_rows(out.type);  // r0 is a multiple of it
  const int grouped = out.N / step * step;  // rows past it are plain rows (qdot.h)
  const Acts& a = act_group(out.type) == kQActBlock ? j.a32 : j.a256;
  const uint8_t* end = out.w + r1 * rb;
  if (step > 1 && starts_stream(step))  // (plain rows: below)
    prefetch_stream_start<3>(out.w + r0 * rb, end);
  // the interleaved kernels request nothing past this task's rows (the next task is any
  // thread's), nothing at all in the single-stream mode
  const X8StreamScope stream(end, nullptr, nullptr, single);
  for (int t0 = 0; t0 < j.T; t0 += j.chunk) {
    const int n = std::min(j.chunk, j.T - t0);
    const int8_t* q = a.q.data() + static_cast<int64_t>(t0) * j.K;
    float* y = out.y + static_cast<int64_t>(t0) * out.N;
    if (step == 1 && n == 1 && r1 - r0 >= kTwoStreamRows) {
      two_streams(r1 - r0, out.w + r0 * rb, rb, [&](int i) {
        plain(out.w + (r0 + i) * rb, j.K, q, a.d.data() + t0 * na, a.s.data() + t0 * na, n,
              y + r0 + i, out.N);
      });
      continue;
    }
    const uint8_t* ahead = out.w + r0 * rb;
    for (int r = r0; r < r1;) {
      const bool group = step > 1 && r < grouped;
      const uint8_t* want = std::min(end, out.w + (r + 1) * rb + kStreamAheadBytes);
      if (step == 1) prefetch_until(ahead, want);  // (x8 kernels prefetch their own stream)
      const bool two = pair && n == 1 && r + 2 * step <= std::min(grouped, r1);  // side by side
      (two ? pair : group ? fn : plain)(out.w + r * rb, j.K, q, a.d.data() + t0 * na,
                                        a.s.data() + t0 * na, n, y + r, out.N);
      r += two ? 2 * step : group ? step : 1;
    }
  }
}

}  // namespace

namespace {

struct QTypeSize {
  int inputs, bytes;  // per block
};
// The plain types, indexed by QType (qdot.h); an interleaved type has its plain type's sizes
// (qtype_base): the same bytes, regrouped.
constexpr QTypeSize kPlainSizes[] = {{32, kQ80Bytes},   {256, kQ4KBytes}, {256, kQ6KBytes},
                                     {256, kQ5KBytes},  {32, kMxfp4Bytes}, {32, kQ50Bytes},
                                     {32, kQ40Bytes}};

static_assert(sizeof kPlainSizes / sizeof kPlainSizes[0] == static_cast<int>(QType::Q4_K_X8),
              "the plain types come first, the interleaved ones after them");

const QTypeSize& qtype_size(QType t) { return kPlainSizes[static_cast<int>(qtype_base(t))]; }

}  // namespace

int qblock_inputs(QType t) { return qtype_size(t).inputs; }

int64_t qrow_bytes(QType t, int64_t K) {
  const QTypeSize& z = qtype_size(t);
  return K / z.inputs * z.bytes;
}

std::vector<std::string> qdot_isas() {
  std::vector<std::string> out;
#ifndef FTNATIVE_NO_X86
  if (has_vnni()) out.emplace_back("vnni");
  if (has_avx2()) out.emplace_back("avx2");
#endif
  out.emplace_back("scalar");
  return out;
}

const QDotSet& qdot_set(const std::string& isa) {
  const auto isas = qdot_isas();
  auto have = [&](const char* name) { return std::find(isas.begin(), isas.end(), name) != isas.end(); };
  std::string want = isa;
  if (isa == "auto" || isa == "avx512") want = isas.front();
  if (isa == "emu512") want = "scalar";
  if (want == "scalar") return kQDotScalar;
#ifndef FTNATIVE_NO_X86
  if (want == "vnni" && have("vnni")) return kQDotVnni;
  if (want == "avx2" && have("avx2")) return kQDotAvx2;
#endif
  throw std::invalid_argument("qdot isa '" + isa + "' is not one this CPU runs");
}

void quantize_rows(Pool& pool, const QDotSet& ks, const float* x, int T, int K, int group,
                   int8_t* q, float* d, int16_t* s) {
  QuantJob j{&ks, x, K, group, q, d, s};
  if (T <= 2)
    for (int t = 0; t < T; ++t) quant_task(&j, t);
  else
    pool.run(quant_task, &j, T);
}

void qlinear(Pool& pool, const QDotSet& ks, const float* x, int T, int K,
             const std::vector<QOutput>& outs) {
  if (T <= 0 || outs.empty()) return;
  const int64_t na = static_cast<int64_t>(K) / kQActBlock;
  Job j;
  for (const int group : {kQActBlock, 256}) {
    const bool read = std::any_of(outs.begin(), outs.end(),
                                  [&](const QOutput& o) { return act_group(o.type) == group; });
    if (!read) continue;
    Acts& a = group == kQActBlock ? j.a32 : j.a256;
    a.q.resize(static_cast<size_t>(T) * K);
    a.d.resize(static_cast<size_t>(T * na));
    a.s.resize(static_cast<size_t>(T * na));
    quantize_rows(pool, ks, x, T, K, group, a.q.data(), a.d.data(), a.s.data());
  }
  j.ks = &ks;
  j.outs = &outs;
  j.T = T;
  j.K = K;
  j.chunk = static_cast<int>(std::max<int64_t>(1, kChunkBytes / K));
  j.rows_per_task = task_rows(kRowsPerTask, int64_t{kTasksPerThread} * pool.threads(), [&](int r) {
    int64_t tasks = 0;
    for (const QOutput& o : outs) tasks += (o.N + r - 1) / r;
    return tasks;
  });
  j.first_task.push_back(0);
  for (const QOutput& o : outs)
    j.first_task.push_back(j.first_task.back() + (o.N + j.rows_per_task - 1) / j.rows_per_task);
  pool.run(dot_task, &j, j.first_task.back());
}

void set_x8_streams(X8Streams mode) { g_x8_streams.store(static_cast<int>(mode)); }

bool x8_single_stream() {
  // "auto": single on AMD CPUs with AVX-512 (Zen 4 and later, where it was measured faster);
  // AMD CPUs without it (Zen 3) read faster with the requests (row_tasks.h)
#ifndef FTNATIVE_NO_X86
  static const bool single_auto = amd_cpu() && __builtin_cpu_supports("avx512f");
#else
  static const bool single_auto = false;
#endif
  const auto mode = static_cast<X8Streams>(g_x8_streams.load(std::memory_order_relaxed));
  return mode == X8Streams::kSingle || (mode == X8Streams::kAuto && single_auto);
}

namespace {

// `len` (1, 2 or 4: x8_segments') bytes, as fixed-size copies the compiler inlines (a memcpy
// call per 4-byte word made qinterleave run at ~1 GB/s, the load's largest cost).
inline void copy_bytes(uint8_t* to, const uint8_t* from, int len) {
  switch (len) {
    case 4: std::memcpy(to, from, 4); break;
    case 2: std::memcpy(to, from, 2); break;
    case 1: *to = *from; break;
    default: std::memcpy(to, from, static_cast<size_t>(len));
  }
}

// A type's segments split into runs and the rest. A run: 8 segments of 4-byte words, stride 4,
// at consecutive words of a row (row_at, row_at + 4, ...): each of the 8 rows' 32 bytes there
// become, transposed as an 8 x 8 matrix of words, the 8 segments' 32-byte slots (group[k]).
struct X8Run {
  int row_at;
  int group[8];
};

struct X8Plan {
  std::vector<X8Run> runs;
  std::vector<X8Segment> rest;
};

X8Plan x8_plan(QType base) {
  const std::vector<X8Segment>& segs = x8_segments(base);
  std::vector<size_t> words;  // the 4-byte, stride-4 segments, by their place in a row
  for (size_t i = 0; i < segs.size(); ++i)
    if (segs[i].len == 4 && segs[i].stride == 4) words.push_back(i);
  std::sort(words.begin(), words.end(),
            [&](size_t a, size_t b) { return segs[a].row < segs[b].row; });
  X8Plan plan;
  std::vector<bool> used(segs.size(), false);
  for (size_t i = 0; i + 8 <= words.size();) {
    bool run = true;
    for (int k = 1; run && k < 8; ++k) run = segs[words[i + k]].row == segs[words[i]].row + 4 * k;
    if (!run) {
      ++i;
      continue;
    }
    X8Run r{segs[words[i]].row, {}};
    for (int k = 0; k < 8; ++k) {
      r.group[k] = segs[words[i + k]].group;
      used[words[i + k]] = true;
    }
    plan.runs.push_back(r);
    i += 8;
  }
  for (size_t i = 0; i < segs.size(); ++i)
    if (!used[i]) plan.rest.push_back(segs[i]);
  return plan;
}

const X8Plan& x8_plan_of(QType base) {
  static const X8Plan q4k = x8_plan(QType::Q4_K), q5k = x8_plan(QType::Q5_K),
                      q6k = x8_plan(QType::Q6_K), q8_0 = x8_plan(QType::Q8_0),
                      mxfp4 = x8_plan(QType::MXFP4);
  return base == QType::Q4_K   ? q4k
         : base == QType::Q6_K ? q6k
         : base == QType::Q8_0 ? q8_0
         : base == QType::Q5_K ? q5k
                               : mxfp4;
}

// One unit (super-block or block) of a group of 8 rows: `rows` the plain side (row r at
// rows + r * rb), `group` the interleaved side; scalar moves of every segment.
inline void x8_unit_scalar(const std::vector<X8Segment>& segs, uint8_t* rows, int64_t rb,
                           uint8_t* group, bool undo) {
  for (const X8Segment& s : segs)
    for (int r = 0; r < 8; ++r) {
      uint8_t* plain = rows + r * rb + s.row;
      uint8_t* x8 = group + s.group + s.stride * r;
      if (undo)
        copy_bytes(plain, x8, s.len);
      else
        copy_bytes(x8, plain, s.len);
    }
}

void x8_move_scalar(QType base, const uint8_t* src, uint8_t* dst, int64_t grouped, int64_t rb,
                    int nsb, int bytes, bool undo) {
  const std::vector<X8Segment>& segs = x8_segments(base);
  for (int64_t g = 0; g < grouped; g += 8)
    for (int sb = 0; sb < nsb; ++sb) {
      const int64_t row_at = g * rb + sb * bytes, group_at = g * rb + sb * 8 * bytes;
      if (undo)
        x8_unit_scalar(segs, dst + row_at, rb, const_cast<uint8_t*>(src) + group_at, true);
      else
        x8_unit_scalar(segs, const_cast<uint8_t*>(src) + row_at, rb, dst + group_at, false);
    }
}

#ifndef FTNATIVE_NO_X86
#define FT_AVX2 __attribute__((target("avx2")))

// o[k] = (a[0][k], ..., a[7][k]): the 8 x 8 transpose of 32-bit words.
FT_AVX2 inline void transpose8(__m256i a[8]) {
  const __m256i t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpackhi_epi32(a[0], a[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(a[2], a[3]), t3 = _mm256_unpackhi_epi32(a[2], a[3]);
  const __m256i t4 = _mm256_unpacklo_epi32(a[4], a[5]), t5 = _mm256_unpackhi_epi32(a[4], a[5]);
  const __m256i t6 = _mm256_unpacklo_epi32(a[6], a[7]), t7 = _mm256_unpackhi_epi32(a[6], a[7]);
  const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
  const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
  const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
  const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
  a[0] = _mm256_permute2x128_si256(u0, u4, 0x20);
  a[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
  a[2] = _mm256_permute2x128_si256(u2, u6, 0x20);
  a[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
  a[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
  a[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
  a[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
  a[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

// x8_move_scalar's moves with each run as one transpose (the same bytes end in the same places).
FT_AVX2 void x8_move_avx2(QType base, const uint8_t* src, uint8_t* dst, int64_t grouped,
                          int64_t rb, int nsb, int bytes, bool undo) {
  const X8Plan& plan = x8_plan_of(base);
  __m256i a[8];
  for (int64_t g = 0; g < grouped; g += 8)
    for (int sb = 0; sb < nsb; ++sb) {
      const int64_t row_at = g * rb + sb * bytes, group_at = g * rb + sb * 8 * bytes;
      uint8_t* rows = undo ? dst + row_at : const_cast<uint8_t*>(src) + row_at;
      uint8_t* group = undo ? const_cast<uint8_t*>(src) + group_at : dst + group_at;
      for (const X8Run& run : plan.runs) {
        if (undo) {
          for (int k = 0; k < 8; ++k)
            a[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + run.group[k]));
          transpose8(a);
          for (int r = 0; r < 8; ++r)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows + r * rb + run.row_at), a[r]);
        } else {
          for (int r = 0; r < 8; ++r)
            a[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + r * rb + run.row_at));
          transpose8(a);
          for (int k = 0; k < 8; ++k)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(group + run.group[k]), a[k]);
        }
      }
      x8_unit_scalar(plan.rest, rows, rb, group, undo);
    }
}
#endif

}  // namespace

void qinterleave(QType base, const uint8_t* src, uint8_t* dst, int64_t rows, int K, bool undo,
                 bool simd) {
  if (!qtype_has_x8(base))
    throw std::invalid_argument(
        "only q4_k, q5_k, q6_k, mxfp4 and q8_0 rows have an interleaved layout");
  const int bytes = x8_block_bytes(base), nsb = K / x8_block_inputs(base);
  const int64_t rb = qrow_bytes(base, K), grouped = rows / 8 * 8;
#ifndef FTNATIVE_NO_X86
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (simd && avx2)
    x8_move_avx2(base, src, dst, grouped, rb, nsb, bytes, undo);
  else
    x8_move_scalar(base, src, dst, grouped, rb, nsb, bytes, undo);
#else
  (void)simd;
  x8_move_scalar(base, src, dst, grouped, rb, nsb, bytes, undo);
#endif
  std::memcpy(dst + grouped * rb, src + grouped * rb, static_cast<size_t>((rows - grouped) * rb));
}

}  // namespace ftdense

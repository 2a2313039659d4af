// Prefill attention (prefill_attention.h): the plan and hand-out of tile tasks, the kernel choice,
// and the plain-C++ tile kernels ("scalar": one lane; "emu512": the AVX-512 geometry on 16-lane
// arrays with fused multiply-adds, the same arithmetic as prefill_attention_avx512.cpp); and the
// Lightning Indexer's scoring kernels on the same two (index_impl.h).
#include "prefill_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "cpu_features.h"

#define FT_TARGET
#define FT_INLINE inline

#include "index_impl.h"
#include "prefill_attention_impl.h"
#include "prefill_small_impl.h"
#include "sparse_attention.h"

namespace ftdense {

namespace {

// One lane, plain multiply-add.
struct Scalar {
  using T = float;
  static constexpr int kLanes = 1, kRB = 4, kNV = 4;
  static constexpr bool kDot = false;
  static T zero() { return 0.0f; }
  static T set1(float f) { return f; }
  static T load(const float* p) { return *p; }
  static void store(float* p, T v) { *p = v; }
  static T fma(T a, T b, T c) { return a * b + c; }
  static T mul(T a, T b) { return a * b; }
  static T add(T a, T b) { return a + b; }
  static T sub(T a, T b) { return a - b; }
  static T max(T a, T b) { return std::max(a, b); }
  static T round(T a) { return std::nearbyint(a); }
  static T pow2(T n) {
    const uint32_t u = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  static T widen(const uint16_t* p) { return prefill_impl::widen1(p, 0, true); }
  static void transpose(const float* src, int64_t, float* dst, int64_t) { *dst = *src; }
};

// 16 lanes as AVX-512 has them, fused multiply-adds.
struct Emu512 {
  struct T {
    float v[16];
  };
  static constexpr int kLanes = 16, kRB = 8, kNV = 2;
  static constexpr bool kDot = false;
  template <typename F>
  static T map(F f) {
    T t;
    for (int i = 0; i < 16; ++i) t.v[i] = f(i);
    return t;
  }
  static T zero() { return set1(0.0f); }
  static T set1(float f) { return map([f](int) { return f; }); }
  static T load(const float* p) { return map([p](int i) { return p[i]; }); }
  static void store(float* p, const T& v) { std::memcpy(p, v.v, sizeof v.v); }
  static T fma(const T& a, const T& b, const T& c) {
    return map([&](int i) { return std::fma(a.v[i], b.v[i], c.v[i]); });
  }
  static T mul(const T& a, const T& b) { return map([&](int i) { return a.v[i] * b.v[i]; }); }
  static T add(const T& a, const T& b) { return map([&](int i) { return a.v[i] + b.v[i]; }); }
  static T sub(const T& a, const T& b) { return map([&](int i) { return a.v[i] - b.v[i]; }); }
  static T max(const T& a, const T& b) {
    return map([&](int i) { return std::max(a.v[i], b.v[i]); });
  }
  static T round(const T& a) { return map([&](int i) { return std::nearbyint(a.v[i]); }); }
  static T pow2(const T& n) { return map([&](int i) { return Scalar::pow2(n.v[i]); }); }
  static T widen(const uint16_t* p) {
    return map([p](int i) { return prefill_impl::widen1(p, i, true); });
  }
  static void transpose(const float* src, int64_t lds, float* dst, int64_t ldd) {
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) dst[j * ldd + i] = src[i * lds + j];
  }
};

// The bf16-dot kernel's arithmetic (prefill_attention_avx512bf16.cpp) on Emu512's lanes: dp as
// vdpbf16ps (Intel's pseudo-code; Zen 4 gives the same bits): c with denormals flushed, plus the
// odd pair's product, rounded, flushed, plus the even pair's, rounded, flushed. Products of two
// bf16 values are exact in fp32, so each step is one rounding whether or not it is fused.
struct EmuBf16 : Emu512 {
  struct I {
    uint32_t v[16];
  };
  static constexpr bool kDot = true;
  static float daz(float f) {
    return std::fpclassify(f) == FP_SUBNORMAL ? std::copysign(0.0f, f) : f;
  }
  static float bf(uint32_t h) {  // the bf16 value in h's low half, denormals to zero
    const uint32_t u = (h & 0xffffu) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return daz(f);
  }
  static I loadi(const uint32_t* p) {
    I i;
    std::memcpy(i.v, p, sizeof i.v);
    return i;
  }
  static T dp(const T& c, uint32_t a, const I& b) {
    return map([&](int i) {
      float acc = daz(c.v[i]);
      acc = daz(acc + bf(a >> 16) * bf(b.v[i] >> 16));
      return daz(acc + bf(a) * bf(b.v[i]));
    });
  }
  static T bf16r(const T& x) {
    return map([&](int i) {
      const uint32_t u = prefill_impl::bf16_bits(x.v[i]);
      float f;
      std::memcpy(&f, &u, sizeof f);
      return f;
    });
  }
  static void pack(const T& lo, const T& hi, uint32_t* dst) {
    for (int i = 0; i < 16; ++i) {
      uint32_t a, b;
      std::memcpy(&a, &lo.v[i], sizeof a);
      std::memcpy(&b, &hi.v[i], sizeof b);
      dst[i] = a >> 16 | (b & 0xffff0000u);
    }
  }
  static void interleave(const uint16_t* a, const uint16_t* b, uint32_t* dst) {
    for (int i = 0; i < 16; ++i) dst[i] = a[i] | static_cast<uint32_t>(b[i]) << 16;
  }
};

// Query rows of a tile: about 128 query-head rows (G heads each), so a key block widened once
// serves that many rows, while the tile's queries, logits and weighted values stay in L2.
constexpr int kTileRows = 128;
// Query-head rows a tile keeps at least while every thread has a task: each tile reads and widens
// its KV head's keys, which for a few rows costs more than their arithmetic (a 2-row chunk at
// 16k keys: tiles of one row each read the context twice).
constexpr int kMinTileRows = 16;
// Tasks wanted per pool thread: a long chunk's later tiles see more keys than its first.
constexpr int kTasksPerThread = 4;

struct Job {
  PrefillFn fn;
  const KvPages* kv;
  const PrefillChunks* c;
  int G;
  struct Task {
    int chunk, kv_head, i0, nq;
  };
  std::vector<Task> tasks;
};

void run_task(void* ctx, int64_t i) {
  const Job& j = *static_cast<const Job*>(ctx);
  const Job::Task& tk = j.tasks[i];
  const PrefillChunks& c = *j.c;
  const int d = j.kv->d;
  const int64_t stride = static_cast<int64_t>(c.heads) * d;
  const int64_t row = static_cast<int64_t>(c.rows[tk.chunk]) + tk.i0;
  const PrefillTile t{c.q + row * stride,
                      c.out + row * stride,
                      stride,
                      tk.nq,
                      static_cast<int64_t>(c.pos[tk.chunk]) + tk.i0,
                      tk.kv_head,
                      j.G,
                      c.scale,
                      c.window,
                      c.sinks ? c.sinks + tk.kv_head * j.G : nullptr,
                      c.tables + tk.chunk * c.table_stride};
  j.fn(*j.kv, t);
}

void validate(const KvPages& kv, const PrefillChunks& c) {
  if (c.heads <= 0 || kv.kv_heads <= 0 || c.heads % kv.kv_heads != 0)
    throw std::invalid_argument("heads must be a positive multiple of kv_heads");
  if (!prefill_supported(kv.d)) throw std::invalid_argument("head_dim must be a multiple of 16");
  if (kv.page_size <= 0 || c.window < 0) throw std::invalid_argument("bad page_size or window");
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (int i = 0; i < c.n; ++i) {
    const int64_t len = c.lens[i], pos = c.pos[i], end = pos + len;
    if (len < 1 || pos < 0) throw std::invalid_argument("a chunk is empty or starts before 0");
    if (end > c.table_stride * kv.page_size)
      throw std::invalid_argument("a chunk's keys exceed its page table");
    if (c.rows[i] < 0 || c.rows[i] + len > c.q_rows)
      throw std::invalid_argument("a chunk's rows are out of range");
    spans.emplace_back(c.rows[i], c.rows[i] + len);
    const int64_t lo = c.window > 0 ? std::max<int64_t>(0, pos - c.window + 1) : 0;
    const int32_t* table = c.tables + i * c.table_stride;
    for (int64_t p = lo / kv.page_size; p <= (end - 1) / kv.page_size; ++p)
      if (table[p] < 0 || table[p] >= kv.num_pages)
        throw std::invalid_argument("a page id is outside the pool");
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    if (spans[i].first < spans[i - 1].second)
      throw std::invalid_argument("two chunks share query rows");
}

}  // namespace

void prefill_tile_scalar(const KvPages& kv, const PrefillTile& t) {
  if (prefill_small_tile(t, Scalar::kLanes)) prefill_impl::prefill_tile_small<Scalar>(kv, t);
  else prefill_impl::prefill_tile<Scalar>(kv, t);
}

void prefill_tile_emu512(const KvPages& kv, const PrefillTile& t) {
  if (prefill_small_tile(t, Emu512::kLanes)) prefill_impl::prefill_tile_small<Emu512>(kv, t);
  else prefill_impl::prefill_tile<Emu512>(kv, t);
}

void prefill_tile_emubf16(const KvPages& kv, const PrefillTile& t) {
  if (!kv.bf16) prefill_tile_scalar(kv, t);
  else prefill_impl::prefill_tile<EmuBf16>(kv, t);
}

void index_scalar(const float* q, const float* w, int heads, int dim, float scale,
                  const char* const* keys, bool bf16, int n, float* scores) {
  using V = index_impl::IndexVec<Scalar, 4, 4, index_impl::PackGeneric>;
  index_impl::index_keys<V>(q, w, heads, dim, scale, keys, bf16, n, scores);
}

void index_emu512(const float* q, const float* w, int heads, int dim, float scale,
                  const char* const* keys, bool bf16, int n, float* scores) {
  using V = index_impl::IndexVec<Emu512, 8, 2, index_impl::PackGeneric>;
  index_impl::index_keys<V>(q, w, heads, dim, scale, keys, bf16, n, scores);
}

namespace {
std::atomic<int> small_rows{-1};
}  // namespace

void prefill_small_rows(int n) { small_rows.store(n, std::memory_order_relaxed); }

bool prefill_small_tile(const PrefillTile& t, int lanes) {
  const int n = small_rows.load(std::memory_order_relaxed);
  return n >= 0 ? t.nq <= n : 2 * t.nq * t.G <= lanes;
}

PrefillFn prefill_kernel(const std::string& isa) {
#ifndef FTNATIVE_NO_X86
  if (isa == "avx512bf16" && ftnative::isa_supported("avx512bf16")) return prefill_tile_avx512bf16;
  if ((isa == "avx512" || isa == "avx512bf16") && ftnative::isa_supported("avx512"))
    return prefill_tile_avx512;
  if ((isa == "avx512" || isa == "avx512bf16" || isa == "avx2") && ftnative::isa_supported("avx2"))
    return prefill_tile_avx2;
#endif
  if (isa == "emu512") return prefill_tile_emu512;
  if (isa == "emubf16") return prefill_tile_emubf16;
  return prefill_tile_scalar;
}

const char* prefill_kernel_name(PrefillFn fn) {
#ifndef FTNATIVE_NO_X86
  if (fn == prefill_tile_avx512bf16) return "avx512bf16";
  if (fn == prefill_tile_avx512) return "avx512";
  if (fn == prefill_tile_avx2) return "avx2";
#endif
  if (fn == prefill_tile_emu512) return "emu512";
  if (fn == prefill_tile_emubf16) return "emubf16";
  return "scalar";
}

bool prefill_kernel_dot(PrefillFn fn) {
#ifndef FTNATIVE_NO_X86
  if (fn == prefill_tile_avx512bf16) return true;
#endif
  return fn == prefill_tile_emubf16;
}

void prefill_attention(Pool& pool, PrefillFn fn, const KvPages& kv, const PrefillChunks& c) {
  validate(kv, c);
  Job j{fn, &kv, &c, c.heads / kv.kv_heads, {}};
  // Tiles of up to kTileRows / G queries, smaller down to kMinTileRows / G while that leaves a
  // thread fewer than kTasksPerThread tasks (further while one has none); the results do not
  // depend on the tiling (prefill_attention.h).
  int64_t total = 0;
  for (int i = 0; i < c.n; ++i) total += c.lens[i];
  const int64_t want = static_cast<int64_t>(pool.threads()) * kTasksPerThread;
  const auto tasks = [&](int q) { return ((total + q - 1) / q) * kv.kv_heads; };
  int qt = std::max(1, kTileRows / j.G);
  while (qt > 1 && (tasks(qt) < pool.threads() ||
                    (tasks(qt) < want && (qt / 2) * j.G >= kMinTileRows)))
    qt /= 2;
  // a chunk's tiles of one KV head together, so the threads read that head's keys while the
  // cache still holds them; later (longer) tiles first, so the short ones fill the gaps at the end
  for (int i = 0; i < c.n; ++i)
    for (int h = 0; h < kv.kv_heads; ++h)
      for (int i0 = (c.lens[i] - 1) / qt * qt; i0 >= 0; i0 -= qt)
        j.tasks.push_back({i, h, i0, std::min(qt, c.lens[i] - i0)});
  pool.run(run_task, &j, static_cast<int64_t>(j.tasks.size()));
}

}  // namespace ftdense

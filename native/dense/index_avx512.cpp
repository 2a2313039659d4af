// The Lightning Indexer's scoring kernel (index_impl.h) on AVX-512F: register tiles of 8 heads x
// 32 keys (16 accumulators). Its scores are the AVX2, emu512 and scalar kernels' bits
// (index_impl.h), which test it on CPUs without AVX-512.
#include <immintrin.h>

// GCC 12's AVX-512 intrinsics seed their masked builtins with _mm512_undefined_*() (see
// native/src/kernels_avx512.cpp); the values are never read.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define FT_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))
#define FT_INLINE FT_TARGET __attribute__((always_inline)) inline

#include "index_pack_x86.h"
#include "sparse_attention.h"

namespace ftdense {
namespace {

struct Avx512 {
  using T = __m512;
  static constexpr int kLanes = 16, kRB = 8, kNV = 2;
  FT_INLINE static T zero() { return _mm512_setzero_ps(); }
  FT_INLINE static T set1(float f) { return _mm512_set1_ps(f); }
  FT_INLINE static T load(const float* p) { return _mm512_loadu_ps(p); }
  FT_INLINE static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  FT_INLINE static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  FT_INLINE static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  FT_INLINE static T relu(T a) { return _mm512_max_ps(a, _mm512_setzero_ps()); }
  FT_INLINE static void prefetch(const char* p) { _mm_prefetch(p, _MM_HINT_T0); }
  FT_INLINE static void pack(const char* const* keys, bool bf16, int dim, int nk, float* kt) {
    index_impl::pack_x86<kNV * kLanes>(keys, bf16, dim, nk, kt);
  }
};

}  // namespace

void index_avx512(const float* q, const float* w, int heads, int dim, float scale,
                  const char* const* keys, bool bf16, int n, float* scores) {
  index_impl::index_keys<Avx512>(q, w, heads, dim, scale, keys, bf16, n, scores);
}

}  // namespace ftdense

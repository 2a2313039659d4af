// The prefill attention tile kernel (prefill_attention_impl.h) on AVX-512F: 16 lanes, register
// tiles of 8 rows x 32 columns. Its arithmetic is the "emu512" kernel's and the AVX2 one's
// (prefill_attention_impl.h), which test it on CPUs without AVX-512. Also the Lightning Indexer's
// scoring kernel (index_impl.h) on the same vectors, tiles of 8 heads x 32 keys: its scores are
// the AVX2, emu512 and scalar kernels' bits.
#include <immintrin.h>

// GCC 12's AVX-512 intrinsics seed their masked builtins with _mm512_undefined_*() (see
// native/src/kernels_avx512.cpp); the values are never read.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define FT_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))
#define FT_INLINE FT_TARGET __attribute__((always_inline)) inline

#include "index_pack_x86.h"
#include "prefill_attention_impl.h"
#include "prefill_avx512_vec.h"
#include "prefill_small_impl.h"
#include "sparse_attention.h"

namespace ftdense {

void prefill_tile_avx512(const KvPages& kv, const PrefillTile& t) {
  if (prefill_small_tile(t, Avx512::kLanes)) prefill_impl::prefill_tile_small<Avx512>(kv, t);
  else prefill_impl::prefill_tile<Avx512>(kv, t);
}

void index_avx512(const float* q, const float* w, int heads, int dim, float scale,
                  const char* const* keys, bool bf16, int n, float* scores) {
  using V = index_impl::IndexVec<Avx512, 8, 2, index_impl::PackX86>;
  index_impl::index_keys<V>(q, w, heads, dim, scale, keys, bf16, n, scores);
}

}  // namespace ftdense

#include "decode_step.h"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "kernels_bf16dot.h"
#include "rms_norm.h"

namespace ftdense {

void add_rows(float* h, const float* delta, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] += delta[i];
}

void embed_rows(const void* w, bool bf16, int64_t vocab, int64_t dim, const int64_t* ids,
                int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= vocab)
      throw std::out_of_range("token id " + std::to_string(ids[i]) +
                              " is outside the vocabulary (" + std::to_string(vocab) + " ids)");
  for (int64_t i = 0; i < n; ++i) {
    float* out = y + i * dim;
    if (!bf16) {
      std::memcpy(out, static_cast<const float*>(w) + ids[i] * dim, sizeof(float) * dim);
      continue;
    }
    const uint16_t* row = static_cast<const uint16_t*>(w) + ids[i] * dim;
    for (int64_t j = 0; j < dim; ++j) out[j] = ftnative::bf16_to_f32(row[j]);
  }
}

void add_rms_norm(float* h, const float* delta, int64_t rows, int dim, const float* scale,
                  float eps, float* y) {
  add_rows(h, delta, rows * dim);
  rms_norm(h, rows, dim, scale, eps, y);
}

namespace {

// The k largest of v[0, E) (k <= E), best first; ties keep the lower index.
void top_k(const float* v, int E, int k, int* idx) {
  for (int j = 0; j < k; ++j) idx[j] = -1;
  for (int e = 0; e < E; ++e) {
    int j = k;  // where e goes: after every kept entry at least as large
    while (j > 0 && (idx[j - 1] < 0 || v[e] > v[idx[j - 1]])) --j;
    if (j == k) continue;
    for (int m = k - 1; m > j; --m) idx[m] = idx[m - 1];
    idx[j] = e;
  }
}

}  // namespace

void route_topk(const float* logits, int64_t T, int E, int k, bool softmax_first, bool renorm,
                int32_t id_offset, int32_t* ids, float* w) {
  std::vector<int> idx(static_cast<size_t>(k));
  std::vector<float> p(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits + t * E;
    int32_t* it = ids + t * k;
    float* wt = w + t * k;
    top_k(l, E, k, idx.data());  // exp is monotone: the top logits are the top probabilities
    const float top = l[idx[0]];
    if (softmax_first) {
      float sum = 0.f;
      for (int e = 0; e < E; ++e) sum += p[e] = std::exp(l[e] - top);
      float kept = 0.f;
      for (int j = 0; j < k; ++j) kept += wt[j] = p[idx[j]] / sum;
      if (renorm)
        for (int j = 0; j < k; ++j) wt[j] /= kept;
    } else {
      float sum = 0.f;
      for (int j = 0; j < k; ++j) sum += wt[j] = std::exp(l[idx[j]] - top);
      for (int j = 0; j < k; ++j) wt[j] /= sum;
    }
    for (int j = 0; j < k; ++j) it[j] = idx[j] + id_offset;
  }
}

namespace {

uint16_t bf16_round(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if (std::isnan(f)) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

void store_rows(const float* src, int64_t n, int64_t width, const int64_t* slots, void* pool,
                bool bf16) {
  for (int64_t i = 0; i < n; ++i) {
    const float* s = src + i * width;
    if (bf16) {
      uint16_t* d = static_cast<uint16_t*>(pool) + slots[i] * width;
      for (int64_t j = 0; j < width; ++j) d[j] = bf16_round(s[j]);
    } else {
      std::memcpy(static_cast<float*>(pool) + slots[i] * width, s,
                  sizeof(float) * static_cast<size_t>(width));
    }
  }
}

}  // namespace

void kv_store(const float* k, const float* v, int64_t n, int64_t width, const int64_t* slots,
              void* k_pool, void* v_pool, bool bf16) {
  store_rows(k, n, width, slots, k_pool, bf16);
  if (v != nullptr) store_rows(v, n, width, slots, v_pool, bf16);
}

namespace {

// The largest of x[0, V) and whether any is NaN, in one pass.
void row_max(const float* x, int64_t V, float& m, bool& any_nan) {
  int64_t i = 0;
  m = -INFINITY;
  any_nan = false;
#if defined(__SSE2__)
  // four 4-lane maxima and unordered (NaN) masks: SSE2 is in every x86-64 build
  __m128 mx[4], un[4];
  for (int l = 0; l < 4; ++l) {
    mx[l] = _mm_set1_ps(-INFINITY);
    un[l] = _mm_setzero_ps();
  }
  for (; i + 16 <= V; i += 16)
    for (int l = 0; l < 4; ++l) {
      const __m128 v = _mm_loadu_ps(x + i + 4 * l);
      mx[l] = _mm_max_ps(mx[l], v);  // a NaN v leaves mx (its second operand is returned)
      un[l] = _mm_or_ps(un[l], _mm_cmpunord_ps(v, v));
    }
  alignas(16) float part[16];
  for (int l = 0; l < 4; ++l) _mm_store_ps(part + 4 * l, _mm_max_ps(mx[l], mx[l]));
  for (float p : part) m = p > m ? p : m;
  any_nan = _mm_movemask_ps(_mm_or_ps(_mm_or_ps(un[0], un[1]), _mm_or_ps(un[2], un[3]))) != 0;
#endif
  for (; i < V; ++i) {
    any_nan |= x[i] != x[i];
    m = x[i] > m ? x[i] : m;
  }
}

}  // namespace

void argmax_rows(const float* logits, int64_t B, int64_t V, int64_t* out) {
  for (int64_t b = 0; b < B; ++b) {
    const float* x = logits + b * V;
    float m;
    bool any_nan;
    row_max(x, V, m, any_nan);
    int64_t at = 0;  // the first index holding the maximum, or the first NaN
    for (int64_t j = 0; j < V; ++j)
      if (any_nan ? x[j] != x[j] : x[j] == m) {
        at = j;
        break;
      }
    out[b] = at;
  }
}

}  // namespace ftdense

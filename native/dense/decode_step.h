// The small steps between the projections of a CPU decode step (models/layers/cpu_decode.py):
// each replaces several torch ops whose dispatch, at one token, costs more than their
// arithmetic. All run on the caller's thread (a decode step's rows are few).
#pragma once

#include <cstdint>

namespace ftdense {

// h [rows, dim] += delta [rows, dim]; then y = rms_norm(h) (rms_norm.h; y may alias delta, not h).
void add_rms_norm(float* h, const float* delta, int64_t rows, int dim, const float* scale,
                  float eps, float* y);

// h [n] += delta [n].
void add_rows(float* h, const float* delta, int64_t n);

// Router logits [T, E] -> the top k experts of each row, best first, as flat ids (expert +
// id_offset, int32 [T, k]) and fp32 weights [T, k], as models/layers/moe.py's `route`:
// softmax_first: softmax over the E logits, the top k probabilities, renormalised to sum 1 when
// `renorm`; otherwise the top k logits and a softmax over them. Ties keep the lower expert.
void route_topk(const float* logits, int64_t T, int E, int k, bool softmax_first, bool renorm,
                int32_t id_offset, int32_t* ids, float* w);

// Rows [n, width] of fp32 k and v stored at pool rows ``slots`` [n] of k_pool / v_pool (rows of
// ``width``; bf16 rounded to nearest even, as torch's cast, or fp32). v may be null (K alone).
void kv_store(const float* k, const float* v, int64_t n, int64_t width, const int64_t* slots,
              void* k_pool, void* v_pool, bool bf16);

// y [n, dim] fp32 = rows ids [n] of the embedding w [vocab, dim] (bf16, widened exactly, or fp32),
// as torch's index_select then float(): a decode step's first op. Throws std::out_of_range for an
// id outside [0, vocab) before writing anything.
void embed_rows(const void* w, bool bf16, int64_t vocab, int64_t dim, const int64_t* ids,
                int64_t n, float* y);

// out[b] = the index of the largest of logits [B, V] row b (the first of equal ones; the first
// NaN where a row has one), as torch.argmax: greedy sampling's one op over the vocabulary.
void argmax_rows(const float* logits, int64_t B, int64_t V, int64_t* out);

}  // namespace ftdense

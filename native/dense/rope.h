// Rotary position embedding of one step's rows, as models/layers/rope.Rope.apply computes it in
// torch, bit for bit: x [n, heads, head_dim] fp32; the first `rot` dims of each head rotate by
// cos/sin [n, rot / 2] (half-split pairs (i, i + rot/2), or with `interleaved` the pairs
// (2i, 2i + 1), written back in half-split order), the rest are copied. Each output is two
// rounded products and a rounded sum or difference (no FMA), as torch's elementwise ops.
#pragma once

#include <cstdint>

namespace ftdense {

void rope(const float* x, int64_t n, int heads, int head_dim, int rot, bool interleaved,
          const float* cos, const float* sin, float* y);

}  // namespace ftdense

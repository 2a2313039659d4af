// RMSNorm over the last dimension in fp32: y[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * scale.
//
// torch's CPU rms_norm costs ~17 us even for one 2048-wide row (a composite of several ops);
// a decode step runs 4 per layer, so this plain loop (auto-vectorised) replaces it there.
#pragma once

#include <cstdint>

namespace ftdense {

// x, y [rows, dim] (rows dim apart; y may alias x), scale [dim].
void rms_norm(const float* x, int64_t rows, int dim, const float* scale, float eps, float* y);

}  // namespace ftdense

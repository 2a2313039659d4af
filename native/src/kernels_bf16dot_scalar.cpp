// Plain C++ bf16-dot kernels (kernels_bf16dot.h): the vdpbf16ps contracts without the
// instruction, so the executor's and the dense path's bf16 layouts run in tests on any CPU.

#include "kernels_bf16dot.h"

namespace ftnative {
namespace {

void gemv(const uint16_t* w, int64_t ldw, int rows, int k, const uint16_t* const* xs, int n,
          float* y, int ldy) {
  for (int s = 0; s < n; ++s)
    for (int r = 0; r < rows; ++r) {
      const uint16_t* wr = w + r * ldw;
      float acc = 0.f;
      for (int i = 0; i < k; ++i) acc += bf16_to_f32(wr[i]) * bf16_to_f32(xs[s][i]);
      y[static_cast<int64_t>(s) * ldy + r] = acc;
    }
}

void tile(const uint16_t* w, int64_t ldw, int rows, int k, const uint16_t* xp, int nb, float* y) {
  const int64_t block = static_cast<int64_t>((k + 1) / 2) * 2 * kTileLanes;
  for (int b = 0; b < nb; ++b)
    for (int r = 0; r < rows; ++r)
      for (int lane = 0; lane < kTileLanes; ++lane) {
        float acc = 0.f;
        for (int i = 0; i < k; ++i)
          acc += bf16_to_f32(w[r * ldw + i]) *
                 bf16_to_f32(xp[b * block + pair_panel_index(i, lane)]);
        y[(static_cast<int64_t>(b) * rows + r) * kTileLanes + lane] = acc;
      }
}

}  // namespace

const Bf16DotSet kScalarBf16Dot = {"emubf16", gemv, tile};

}  // namespace ftnative

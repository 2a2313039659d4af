#include "rms_norm.h"

#include <cmath>

namespace ftdense {

void rms_norm(const float* x, int64_t rows, int dim, const float* scale, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    // 8 partial sums: a vectorisable reduction (fp32, like torch's, in a different order).
    float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= dim; i += 8)
      for (int l = 0; l < 8; ++l) part[l] += xr[i + l] * xr[i + l];
    float ss = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
    for (; i < dim; ++i) ss += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
    for (int j = 0; j < dim; ++j) yr[j] = xr[j] * inv * scale[j];
  }
}

}  // namespace ftdense

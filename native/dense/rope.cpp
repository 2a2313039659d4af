#include "rope.h"

#include <cstring>

namespace ftdense {

__attribute__((optimize("fp-contract=off"))) void rope(const float* x, int64_t n, int heads,
                                                       int head_dim, int rot, bool interleaved,
                                                       const float* cos, const float* sin,
                                                       float* y) {
  const int half = rot / 2;
  for (int64_t t = 0; t < n; ++t) {
    const float* c = cos + t * half;
    const float* s = sin + t * half;
    for (int h = 0; h < heads; ++h) {
      const int64_t off = (t * heads + h) * head_dim;
      const float* xr = x + off;
      float* yr = y + off;
      const int stride = interleaved ? 2 : 1;
      const float* a = xr;
      const float* b = interleaved ? xr + 1 : xr + half;
      for (int i = 0; i < half; ++i) {
        const float x1 = a[i * stride], x2 = b[i * stride];
        const float p = x1 * c[i], q = x2 * s[i], u = x2 * c[i], v = x1 * s[i];
        yr[i] = p - q;
        yr[half + i] = u + v;
      }
      if (head_dim > rot)
        std::memcpy(yr + rot, xr + rot, sizeof(float) * static_cast<size_t>(head_dim - rot));
    }
  }
}

}  // namespace ftdense

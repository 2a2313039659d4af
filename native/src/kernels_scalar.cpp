// Portable kernels: plain loops (the compiler may use SSE2), natural input order. Quantised
// weights are dequantised one row at a time (quant_decode.h) into a per-thread row buffer, then
// used by every token.
#include <cstring>
#include <vector>

#include "kernels.h"
#include "quant_decode.h"

namespace ftnative {
namespace {

inline float load_w(const float* w, int64_t i) { return w[i]; }

inline float load_w(const uint16_t* w, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(w[i]) << 16;  // bf16 is the top half of an fp32
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename W>
void gemv(const void* wv, int64_t ldw, int rows, int k, const float* const* xs, int n, float* y,
          int ldy) {
  const W* w = static_cast<const W*>(wv);
  for (int r = 0; r < rows; ++r) {
    const W* row = w + r * ldw;
    for (int s = 0; s < n; ++s) {
      const float* x = xs[s];
      float acc[4] = {0.f, 0.f, 0.f, 0.f};  // four partial sums keep the adds independent
      int i = 0;
      for (; i + 4 <= k; i += 4)
        for (int u = 0; u < 4; ++u) acc[u] += load_w(row, i + u) * x[i + u];
      for (; i < k; ++i) acc[0] += load_w(row, i) * x[i];
      y[s * ldy + r] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    }
  }
}

template <typename W>
void tile(const void* wv, int64_t ldw, int rows, int k, const float* xp, int nb, float* y) {
  const W* w = static_cast<const W*>(wv);
  for (int b = 0; b < nb; ++b) {
    const float* panel = xp + static_cast<int64_t>(b) * k * kTileLanes;
    for (int r = 0; r < rows; ++r) {
      const W* row = w + r * ldw;
      float acc[kTileLanes] = {};
      for (int i = 0; i < k; ++i) {
        const float wi = load_w(row, i);
        for (int l = 0; l < kTileLanes; ++l) acc[l] += wi * panel[i * kTileLanes + l];
      }
      float* out = y + (static_cast<int64_t>(b) * rows + r) * kTileLanes;
      for (int l = 0; l < kTileLanes; ++l) out[l] = acc[l];
    }
  }
}

float* row_buffer(int k) {
  thread_local std::vector<float> buf;
  if (buf.size() < static_cast<size_t>(k)) buf.resize(k);
  return buf.data();
}

template <QFormat F>
void qgemv(const QMat& m, int rows, int k, const float* const* xs, int n, float* y, int ldy) {
  float* row = row_buffer(k);
  for (int r = 0; r < rows; ++r) {
    q_decode_row<F>(m, r, 0, k, row);
    gemv<float>(row, k, 1, k, xs, n, y + r, ldy);
  }
}

template <QFormat F>
void qtile(const QMat& m, int rows, int k, const float* xp, int nb, float* y) {
  float* row = row_buffer(k);
  float yr[kTileLanes];
  for (int r = 0; r < rows; ++r) {
    q_decode_row<F>(m, r, 0, k, row);
    for (int b = 0; b < nb; ++b) {
      tile<float>(row, k, 1, k, xp + static_cast<int64_t>(b) * k * kTileLanes, 1, yr);
      std::memcpy(y + (static_cast<int64_t>(b) * rows + r) * kTileLanes, yr, sizeof yr);
    }
  }
}

}  // namespace

const QKernelSet kScalarQ[kNumQFormats] = {
    {"scalar", 0, nullptr, qgemv<QFormat::Fp8Block>, qtile<QFormat::Fp8Block>},
    {"scalar", 0, nullptr, qgemv<QFormat::Mxfp4>, qtile<QFormat::Mxfp4>},
    {"scalar", 0, nullptr, qgemv<QFormat::Nvfp4>, qtile<QFormat::Nvfp4>},
};

const KernelSet kScalarF32 = {"scalar", 0, gemv<float>, tile<float>};
const KernelSet kScalarBf16 = {"scalar", 0, gemv<uint16_t>, tile<uint16_t>};

}  // namespace ftnative

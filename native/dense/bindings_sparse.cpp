// `ftdense`'s sparse decode attention and Lightning Indexer (sparse_attention.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "bindings_common.h"
#include "cpu_features.h"
#include "sparse_attention.h"

namespace py = pybind11;

namespace ftdense_py {
namespace {

// (address, bf16, row stride, first column, page table address or 0, page size, rows the
// storage holds, table entries) -> a RowSource.
using RowArg = std::tuple<uintptr_t, bool, int64_t, int64_t, uintptr_t, int, int64_t, int64_t>;

ftdense::RowSource row_source(const RowArg& a) {
  const auto& [base, bf16, stride, col, table, page_size, num_rows, table_len] = a;
  if (stride < 1 || col < 0) throw py::value_error("bad row stride or column");
  return {reinterpret_cast<const void*>(base), bf16, stride, col,
          reinterpret_cast<const int32_t*>(table), page_size, num_rows, table_len};
}

// The configured base ISA's (ftdense.configure chose them).
const ftdense::SparseKernels& kernels(const Configured& c) { return *c.sparse; }

// (rows, positions address or 0, first position, count): count rows, at the int32 positions
// given or at first .. first + count - 1.
using SegmentArg = std::tuple<RowArg, uintptr_t, int64_t, int64_t>;

}  // namespace

void bind_sparse(py::module_& m) {
  m.def("sparse_isa", [] { return std::string(kernels(configured()).name); });
  m.def("index_isa", [] { return std::string(kernels(configured()).index_name); });
  m.def(
      "fma_probe",
      [](int64_t iters) {
#ifndef FTNATIVE_NO_X86
        if (iters < 1) throw py::value_error("iters must be >= 1");
        if (!ftnative::isa_supported("avx2")) throw py::value_error("this CPU has no AVX2");
        py::gil_scoped_release release;
        ftdense::fma_probe_avx2(iters);
        return iters * ftdense::kFmaProbeChains * 8;
#else
        (void)iters;
        throw py::value_error("no x86 FMA probe on this architecture");
#endif
      },
      py::arg("iters"),
      "Runs `iters` rounds of independent 8-lane fp32 FMA chains in registers (AVX2 + FMA) and "
      "returns the multiply-adds done: timed by the caller, this core's fp32 FMA peak.");
  m.def(
      "index_topk",
      [](uintptr_t q, uintptr_t w, int heads, int dim, float scale, const RowArg& keys, int64_t n,
         int k, uintptr_t sel, uintptr_t scores) {
        const Configured c = configured();
        const ftdense::RowSource src = row_source(keys);
        if (src.stride < src.col + dim) throw py::value_error("the key columns exceed the row");
        py::gil_scoped_release release;
        ftdense::index_topk(*c.pool, kernels(c), reinterpret_cast<const float*>(q),
                            reinterpret_cast<const float*>(w), heads, dim, scale, src, n, k,
                            reinterpret_cast<int32_t*>(sel), reinterpret_cast<float*>(scores));
      },
      py::arg("q"), py::arg("w"), py::arg("heads"), py::arg("dim"), py::arg("scale"),
      py::arg("keys"), py::arg("n"), py::arg("k"), py::arg("sel"), py::arg("scores") = 0,
      "The Lightning Indexer of one query (sparse_attention.h): q [heads, dim], w [heads] fp32 "
      "addresses; keys (address, bf16, row stride, column, table address or 0, page size, rows, "
      "table entries) at positions [0, n); sel [min(k, n)] int32 <- the best positions, best "
      "first, ties to the lower position; scores [n] fp32 (address or 0) <- every score.");
  m.def(
      "sparse_attention",
      [](uintptr_t q, int heads, int dk, int dv, float scale,
         const std::vector<SegmentArg>& segments, uintptr_t sinks, uintptr_t out) {
        const Configured c = configured();
        std::vector<const char*> rows;
        int bf16 = -1;
        for (const auto& [arg, pos, first, count] : segments) {
          const ftdense::RowSource src = row_source(arg);
          if (src.stride < src.col + dk) throw py::value_error("the key columns exceed the row");
          if (bf16 >= 0 && bf16 != static_cast<int>(src.bf16))
            throw py::value_error("all rows must be bf16 or all fp32");
          bf16 = src.bf16;
          if (count < 0) throw py::value_error("a negative row count");
          const auto* p = reinterpret_cast<const int32_t*>(pos);
          try {
            if (p == nullptr) {
              src.check(first, first + count);
              for (int64_t i = 0; i < count; ++i) rows.push_back(src.at(first + i));
            } else {
              for (int64_t i = 0; i < count; ++i) rows.push_back(src.row(p[i]));
            }
          } catch (const std::invalid_argument& e) {
            throw py::value_error(e.what());
          }
        }
        py::gil_scoped_release release;
        const ftdense::SparseQuery sq{reinterpret_cast<const float*>(q), heads, dk, dv, scale};
        ftdense::sparse_attention(*c.pool, kernels(c), sq, rows, bf16 == 1,
                                  reinterpret_cast<const float*>(sinks),
                                  reinterpret_cast<float*>(out));
      },
      py::arg("q"), py::arg("heads"), py::arg("dk"), py::arg("dv"), py::arg("scale"),
      py::arg("segments"), py::arg("sinks"), py::arg("out"),
      "Attention of one query q [heads, dk] fp32 (address) over the rows of `segments`, each "
      "(rows as index_topk takes them, int32 positions address or 0, first position, count): "
      "keys the rows' dk columns, values their first dv; sinks [heads] fp32 or 0; out [heads, "
      "dv] fp32 (sparse_attention.h).");
}

}  // namespace ftdense_py

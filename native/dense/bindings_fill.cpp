// `ftdense.fill_rows` (row_fill.h): callable before torch is imported, the GIL released for the
// whole call.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "bindings_common.h"
#include "row_fill.h"

namespace py = pybind11;

namespace ftdense_py {
namespace {

// (file offset, bytes, destination address, base qtype code or -1, rows, K)
using JobArg = std::tuple<int64_t, int64_t, uintptr_t, int, int64_t, int>;

ftdense::FillJob job(const JobArg& a) {
  const auto& [offset, nbytes, dest, qtype, rows, K] = a;
  if (offset < 0 || nbytes < 0 || (nbytes > 0 && dest == 0))
    throw py::value_error("a job needs an offset, a size and a destination");
  if (qtype >= 0) {
    const ftdense::QType t = qtype_code(qtype);
    if (ftdense::qtype_base(t) != t || !ftdense::qtype_has_x8(t))
      throw py::value_error("only plain q4_k, q5_k, q6_k, mxfp4 and q8_0 rows are interleaved");
    if (rows < 8 || K <= 0 || K % ftdense::qblock_inputs(t) ||
        nbytes != rows * ftdense::qrow_bytes(t, K))
      throw py::value_error("interleaved rows: rows >= 8, K a multiple of the block, "
                            "nbytes = rows * the row's bytes");
  }
  return {offset, nbytes, reinterpret_cast<uint8_t*>(dest), qtype, rows, K};
}

}  // namespace

void bind_fill(py::module_& m) {
  m.def(
      "fill_rows",
      [](int fd, const std::vector<JobArg>& jobs, int threads, uintptr_t cancel) {
        std::vector<ftdense::FillJob> js;
        js.reserve(jobs.size());
        for (const JobArg& a : jobs) js.push_back(job(a));
        std::string error;
        {
          py::gil_scoped_release release;
          error = ftdense::fill_rows(fd, js, threads,
                                     reinterpret_cast<const volatile uint8_t*>(cancel));
        }
        if (!error.empty()) throw std::runtime_error(error);
      },
      py::arg("fd"), py::arg("jobs"), py::arg("threads"), py::arg("cancel") = 0,
      "Each job (file offset, bytes, destination address, qtype, rows, K) read from fd into "
      "its destination on `threads` threads of the call's own, the destination's pages backed "
      "first; qtype -1: the bytes as they are, a plain code (0 q8_0, 1 q4_k, 2 q6_k, 3 q5_k, "
      "4 mxfp4): the rows [rows, bytes of K inputs] interleaved by 8 into it (qinterleave). "
      "cancel: the address of a byte; once nonzero, jobs not yet started are skipped. "
      "RuntimeError names the first read that failed.");
}

}  // namespace ftdense_py

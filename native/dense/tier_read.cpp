// `ftdense.tier_read`: one piece of an expert read from its file into its RAM cache slot (the disk
// tier, daemon/experts/disk_reads.py and models/gguf_experts.py), the read and the move into the
// slot in one call with the GIL released. Python's own piece (formats/direct_read.read_staged,
// then formats/gguf_interleave.interleave_to) takes the GIL five or six times around its
// syscalls and tensor views; this takes it once, on return.
//
// As read_staged: an O_DIRECT descriptor reads the aligned superset of the wanted bytes into the
// calling thread's page-aligned bounce buffer (reused: a reader thread reads piece after piece);
// a plain descriptor reads the wanted bytes to the buffer's start. The bytes then go to the slot
// interleaved by 8 rows (qinterleave, as a resident pool is left) or copied.
#include <pybind11/pybind11.h>

#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "bindings_common.h"
#include "qlinear.h"
#include "row_fill.h"

namespace py = pybind11;

namespace ftdense_py {
namespace {

constexpr int64_t kAlign = 4096;      // formats/direct_read.ALIGN
constexpr int64_t kBounce = 2 << 20;  // formats/direct_read.BOUNCE

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};

uint8_t* bounce() {
  thread_local std::unique_ptr<uint8_t, FreeDeleter> buf;
  if (!buf) {
    void* p = nullptr;
    if (posix_memalign(&p, kAlign, kBounce)) throw std::bad_alloc();
    buf.reset(static_cast<uint8_t*>(p));
  }
  return buf.get();
}

// Why a read stopped short: 0 none, an errno, or -1 the file's end.
struct ReadEnd {
  int err = 0;
  int64_t at = 0;  // where the file ended (err -1)
};

// The file's bytes [offset, offset + nbytes) -> their address in the bounce buffer.
const uint8_t* read_bytes(int fd, int64_t offset, int64_t nbytes, bool direct, ReadEnd& end) {
  const int64_t start = direct ? offset / kAlign * kAlign : offset;
  const int64_t stop = direct ? (offset + nbytes + kAlign - 1) / kAlign * kAlign : offset + nbytes;
  uint8_t* buf = bounce();
  end.err = ftdense::pread_full(fd, buf, offset + nbytes - start, stop - start, start, &end.at);
  return end.err ? nullptr : buf + (offset - start);
}

int64_t tier_read(int fd, int64_t offset, int64_t nbytes, bool direct, uintptr_t dst, int qtype,
                  int64_t rows, int K, const std::string& name) {
  if (nbytes < 0 || nbytes > kBounce - 2 * kAlign || offset < 0)
    throw py::value_error(name + ": a piece of " + std::to_string(nbytes) + " bytes at " +
                          std::to_string(offset) + " does not fit a read's buffer");
  const bool move = qtype >= 0;
  const ftdense::QType t = move ? qtype_code(qtype) : ftdense::QType{};
  if (move &&
      (rows < 8 || K % ftdense::qblock_inputs(t) || ftdense::qrow_bytes(t, K) * rows != nbytes))
    throw py::value_error(name + ": the piece's rows do not interleave as given");
  ReadEnd end;
  {
    py::gil_scoped_release release;
    const uint8_t* src = read_bytes(fd, offset, nbytes, direct, end);
    if (src != nullptr) {
      uint8_t* out = reinterpret_cast<uint8_t*>(dst);
      if (move)
        ftdense::qinterleave(t, src, out, rows, K, false, true);
      else
        std::memcpy(out, src, static_cast<size_t>(nbytes));
    }
  }
  if (end.err == -1) {
    PyErr_SetString(PyExc_EOFError, (name + ": the file ends at " + std::to_string(end.at) +
                                     ", before " + std::to_string(offset + nbytes))
                                        .c_str());
    throw py::error_already_set();
  }
  if (end.err) {
    errno = end.err;
    PyErr_SetFromErrnoWithFilename(PyExc_OSError, name.c_str());
    throw py::error_already_set();
  }
  return nbytes;
}

}  // namespace

void bind_tier_read(py::module_& m) {
  m.def("tier_read", &tier_read, py::arg("fd"), py::arg("offset"), py::arg("nbytes"),
        py::arg("direct"), py::arg("dst"), py::arg("qtype"), py::arg("rows"), py::arg("K"),
        py::arg("name") = "",
        "The disk tier's piece: the file's bytes [offset, offset + nbytes) read (direct: an "
        "O_DIRECT descriptor, the aligned superset read into the thread's bounce buffer) and "
        "moved to dst, interleaved by 8 rows as qinterleave does (qtype: a code as qinterleave "
        "takes; rows of K inputs, nbytes in all) or copied (qtype -1); -> nbytes, the GIL "
        "released throughout. EOFError where the file ends first, OSError on a failed read.");
}

}  // namespace ftdense_py

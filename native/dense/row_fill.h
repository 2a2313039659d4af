// Rows of a file read into memory that is about to hold them, on threads of the call's own, with
// no Python in between: the GGUF loader's expert fill (freetokend formats/gguf_early.py), which
// runs while the daemon is still importing torch and so must not need the interpreter.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "qdot.h"

namespace ftdense {

// One contiguous piece of the file into one contiguous destination.
struct FillJob {
  int64_t offset;  // in the file
  int64_t nbytes;  // read
  uint8_t* dest;   // nbytes
  int qtype;       // -1: the bytes as they are; a base QType: rows [rows, qrow_bytes(qtype, K)]
  int64_t rows;    //   read into a buffer of the thread's own and interleaved from there into dest
  int K;           //   (qinterleave)
};

// pread into dest until at least `need` bytes from `offset` are in, asking for up to `cap`
// (>= need) each time: 0, an errno, or -1 where the file ends first (*at: where it ended).
int pread_full(int fd, uint8_t* dest, int64_t need, int64_t cap, int64_t offset, int64_t* at);

// Runs every job on `threads` threads (at least 1), each taking the next job not yet taken:
// the destination's whole 4 KiB pages backed in one call first (MADV_POPULATE_WRITE, where the
// kernel has it; the writes fault them in otherwise), then pread until the piece is in. Jobs
// not yet started are skipped once *cancel (may be null) turns nonzero. Returns "" or the first
// error (the others stop at their next job).
std::string fill_rows(int fd, const std::vector<FillJob>& jobs, int threads,
                      const volatile uint8_t* cancel);

}  // namespace ftdense

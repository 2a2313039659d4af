#include "row_fill.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <thread>

#include "qlinear.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14+; EINVAL on older kernels (the writes fault then)
#endif

namespace ftdense {
namespace {

constexpr uintptr_t kPage = 4096;

void populate(uint8_t* p, int64_t n) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t start = (a + kPage - 1) / kPage * kPage, end = (a + n) / kPage * kPage;
  if (end > start) madvise(reinterpret_cast<void*>(start), end - start, MADV_POPULATE_WRITE);
}

// "" or what went wrong.
std::string read_fully(int fd, uint8_t* dest, int64_t nbytes, int64_t offset) {
  int64_t at = 0;
  const int err = pread_full(fd, dest, nbytes, nbytes, offset, &at);
  if (err == -1) return "the file ends early (offset " + std::to_string(at) + ")";
  if (err) return std::string("read failed: ") + std::strerror(err);
  return "";
}

}  // namespace

int pread_full(int fd, uint8_t* dest, int64_t need, int64_t cap, int64_t offset, int64_t* at) {
  int64_t got = 0;
  while (got < need) {  // a short read before the end: read on
    const ssize_t n = pread(fd, dest + got, static_cast<size_t>(cap - got), offset + got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) {
      *at = offset + got;
      return -1;
    }
    got += n;
  }
  return 0;
}

std::string fill_rows(int fd, const std::vector<FillJob>& jobs, int threads,
                      const volatile uint8_t* cancel) {
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::string error;
  int64_t scratch_bytes = 0;
  for (const FillJob& j : jobs)
    if (j.qtype >= 0) scratch_bytes = std::max(scratch_bytes, j.nbytes);
  auto work = [&] {
    std::vector<uint8_t> scratch(static_cast<size_t>(scratch_bytes));  // reused: stays in cache
    for (size_t i; (i = next.fetch_add(1)) < jobs.size();) {
      if (failed.load(std::memory_order_relaxed) || (cancel != nullptr && *cancel)) return;
      const FillJob& j = jobs[i];
      populate(j.dest, j.nbytes);
      uint8_t* to = j.qtype >= 0 ? scratch.data() : j.dest;
      std::string e = read_fully(fd, to, j.nbytes, j.offset);
      if (e.empty() && j.qtype >= 0) {
        try {
          qinterleave(static_cast<QType>(j.qtype), to, j.dest, j.rows, j.K, false, true);
        } catch (const std::exception& x) {
          e = x.what();
        }
      }
      if (!e.empty()) {
        std::lock_guard<std::mutex> lock(mu);
        if (!failed.exchange(true)) error = e;
        return;
      }
    }
  };
  const int n = std::max(1, std::min<int>(threads, static_cast<int>(jobs.size())));
  std::vector<std::thread> pool;
  for (int t = 1; t < n; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  return error;
}

}  // namespace ftdense

#include "thread_pool.h"

#include <algorithm>
#include <chrono>

#include <stdexcept>

#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#endif
#include <unistd.h>

namespace ftnative {

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kCallerSpinUs = 5;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

void pin_current_thread(int cpu) {
#ifdef __linux__
  if (cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);  // best effort: cgroups may refuse
#else
  (void)cpu;
#endif
}

}  // namespace

ThreadPool::ThreadPool(int threads, std::vector<int> cpus, int spin_us)
    : spin_us_(spin_us), owner_pid_(static_cast<long>(getpid())) {
  for (int i = 0; i < threads; ++i) {
    const int cpu = cpus.empty() ? -1 : cpus[i % cpus.size()];
    workers_.emplace_back([this, i, cpu] { worker_main(i, cpu); });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
    generation_.fetch_add(1);
  }
  wake_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run(PoolJob& job) {
  if (static_cast<long>(getpid()) != owner_pid_)
    throw std::runtime_error("CPU executor used in a forked child process (its worker threads "
                             "stayed in the parent); create the executor after forking");
  job_.store(&job);
  open_.store(true);
  {
    std::lock_guard<std::mutex> lock(mu_);  // pairs with the predicate check in wait_for_job
    generation_.fetch_add(1);
  }
  wake_cv_.notify_all();
  wait_done(job);
  // Close the job, then wait out workers that registered just before the close: they see
  // open_ == false and leave at once (both sides use seq_cst, so one of them sees the other).
  open_.store(false);
  while (active_.load() != 0) cpu_relax();
}

void ThreadPool::wait_done(const PoolJob& job) {
  auto done = [&] { return job.finished() && active_.load() == 0; };
  // The caller is not pinned and may share a core with a worker, so it spins only briefly: a
  // long spin there would delay the very work it waits for.
  const auto spin_until = Clock::now() + std::chrono::microseconds(std::min(spin_us_, kCallerSpinUs));
  while (!done()) {
    if (Clock::now() >= spin_until) {
      std::unique_lock<std::mutex> lock(mu_);
      done_cv_.wait(lock, done);
      return;
    }
    cpu_relax();
  }
}

uint64_t ThreadPool::wait_for_job(uint64_t seen) {
  const auto spin_until = Clock::now() + std::chrono::microseconds(spin_us_);
  uint64_t g;
  while ((g = generation_.load(std::memory_order_acquire)) == seen) {
    if (Clock::now() >= spin_until) {
      std::unique_lock<std::mutex> lock(mu_);
      wake_cv_.wait(lock, [&] { return generation_.load() != seen; });
      return generation_.load();
    }
    cpu_relax();
  }
  return g;
}

void ThreadPool::worker_main(int id, int cpu) {
  pin_current_thread(cpu);
  uint64_t seen = 0;
  for (;;) {
    seen = wait_for_job(seen);
    if (stop_.load()) return;
    active_.fetch_add(1);
    if (open_.load()) job_.load()->work(id);
    if (active_.fetch_sub(1) == 1) {
      // Possibly the last one out of a finished job: wake the caller if it sleeps. The lock
      // orders this notify after the caller's predicate check.
      std::lock_guard<std::mutex> lock(mu_);
      done_cv_.notify_one();
    }
  }
}

}  // namespace ftnative

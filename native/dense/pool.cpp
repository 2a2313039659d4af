#include "pool.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include <unistd.h>

namespace ftdense {

namespace {

using Clock = std::chrono::steady_clock;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

}  // namespace

Pool::Pool(int threads, int spin_us) : spin_us_(spin_us), owner_pid_(static_cast<long>(getpid())) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_main(); });
}

Pool::~Pool() {
  if (static_cast<long>(getpid()) != owner_pid_) {
    // A forked child: the workers stayed in the parent, so there is nothing to join. Their
    // handles are leaked on purpose (destroying a joinable std::thread terminates).
    new std::vector<std::thread>(std::move(workers_));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
    generation_.fetch_add(1);
  }
  wake_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void Pool::drain() {
  for (int64_t t = next_.fetch_add(1); t < tasks_; t = next_.fetch_add(1)) {
    fn_(ctx_, t);
    done_.fetch_add(1, std::memory_order_release);
  }
}

void Pool::run(TaskFn fn, void* ctx, int64_t tasks) {
  if (tasks <= 0) return;
  std::unique_lock<std::mutex> owner(run_mu_, std::defer_lock);
  if (workers_.empty() || tasks == 1 || static_cast<long>(getpid()) != owner_pid_ ||
      !owner.try_lock()) {
    // No workers (or a forked child, where they do not exist), or they serve another caller:
    // this caller does it all.
    for (int64_t t = 0; t < tasks; ++t) fn(ctx, t);
    return;
  }
  fn_ = fn;
  ctx_ = ctx;
  tasks_ = tasks;
  next_.store(0);
  done_.store(0);
  open_.store(true);
  {
    std::lock_guard<std::mutex> lock(mu_);  // pairs with the predicate check of sleeping workers
    generation_.fetch_add(1);
  }
  wake_cv_.notify_all();
  drain();
  while (done_.load(std::memory_order_acquire) != tasks) cpu_relax();
  // Close the job, then wait out workers that registered just before the close: they find no
  // task left and leave (seq_cst on both sides: one of them sees the other's store).
  open_.store(false);
  while (active_.load() != 0) cpu_relax();
}

Pool::Hold::Hold(Pool& pool) : pool_(pool) { pool_.held_.fetch_add(1); }

Pool::Hold::~Hold() {
  if (pool_.held_.fetch_sub(1) == 1 && pool_.spin_us_.load() < kHeldSpinUs)
    pool_.parks_.fetch_add(1);
}

void Pool::worker_main() {
  uint64_t seen = 0;
  for (;;) {
    // parks_ before held_: a Hold that ends after held_ was read bumps parks_ after this read
    const uint64_t parks = parks_.load();
    const int configured = spin_us_.load();
    const int spin = held_.load() > 0 ? std::max(configured, kHeldSpinUs) : configured;
    const auto spin_end = Clock::now() + std::chrono::microseconds(spin);
    uint64_t g = generation_.load();
    while (g == seen && Clock::now() < spin_end &&
           (spin == configured || parks_.load(std::memory_order_relaxed) == parks)) {
      for (int i = 0; i < 64 && g == seen; ++i) {
        cpu_relax();
        g = generation_.load();
      }
    }
    if (g == seen) {
      sleeps_.fetch_add(1, std::memory_order_relaxed);
      std::unique_lock<std::mutex> lock(mu_);
      wake_cv_.wait(lock, [&] { return generation_.load() != seen; });
      g = generation_.load();
    }
    seen = g;
    if (stop_.load()) return;
    active_.fetch_add(1);
    if (open_.load()) drain();
    active_.fetch_sub(1);
  }
}

}  // namespace ftdense

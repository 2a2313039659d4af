// A small persistent thread pool in which the CALLING thread takes part in every job.
//
// Dense projections run between torch ops on the Python thread; that thread is already awake,
// so it does a share of the work itself and only `threads - 1` workers are woken. Work is handed
// out by an atomic task counter, so a worker that wakes late (or was descheduled on a shared
// machine) just finds less left to do and nobody waits for it. After a job, workers spin for
// `spin_us` before sleeping: back-to-back projections then start without a futex wake-up.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace ftdense {

class Pool {
 public:
  // Runs task(ctx, i) for every i in [0, tasks); any participant may run any task.
  using TaskFn = void (*)(void* ctx, int64_t task);

  Pool(int threads, int spin_us);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // How long workers spin after a job before sleeping; takes effect from their next job's end.
  void set_spin_us(int us) { spin_us_.store(us); }
  int spin_us() const { return spin_us_.load(); }

  // While a Hold lives (a native decode step: one call from token ids to logits, dozens of
  // jobs with short single-threaded parts between them), idle workers spin at least
  // kHeldSpinUs between jobs, whatever set_spin_us says; when the last Hold ends, workers
  // spinning longer than the configured spin stop and sleep. So a spin kept short for the
  // threads that run between steps (the HTTP daemon's event loop: dense_native.SPIN_US_*)
  // does not cost a wake-up before every job of a step.
  class Hold {
   public:
    explicit Hold(Pool& pool);
    ~Hold();
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;

   private:
    Pool& pool_;
  };
  static constexpr int kHeldSpinUs = 1000;

  // How many times a worker went to sleep (stopped spinning) so far (the tests' view of the
  // spin).
  uint64_t sleeps() const { return sleeps_.load(); }

  // Blocks until every task ran. Safe from several threads: while one job holds the workers,
  // another caller runs its own tasks inline (the GIL is released during jobs, so two engine
  // threads may well call at once).
  void run(TaskFn fn, void* ctx, int64_t tasks);

 private:
  void worker_main();
  void drain();

  std::vector<std::thread> workers_;
  std::atomic<int> spin_us_;
  std::atomic<int> held_{0};         // live Holds
  std::atomic<uint64_t> parks_{0};   // bumped when the last Hold ends: held spins stop
  std::atomic<uint64_t> sleeps_{0};
  const long owner_pid_;

  // The current job; written before open_ is set, read by workers only while open_.
  TaskFn fn_ = nullptr;
  void* ctx_ = nullptr;
  int64_t tasks_ = 0;
  std::atomic<int64_t> next_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<bool> open_{false};
  std::atomic<int> active_{0};  // workers inside drain()
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stop_{false};

  std::mutex run_mu_;  // held by the caller whose job the workers serve
  std::mutex mu_;
  std::condition_variable wake_cv_;
};

}  // namespace ftdense

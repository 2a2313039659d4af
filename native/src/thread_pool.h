// A persistent pool of pinned worker threads that run one job at a time.
//
// Workers are created once and sleep between jobs. `run` publishes a job, wakes the workers and
// returns when the job reports itself finished and no worker is still inside it. Jobs hand out
// their own work (an atomic task counter), so a worker that wakes late simply finds less to do
// and the caller never waits for a worker that has not started. After a job, workers spin for
// `spin_us` before sleeping, so that back-to-back calls wake them in well under a microsecond; a
// sleeping worker is woken through a condition variable (futex). The executor's default is 0:
// in a model its calls are a layer apart, and spinning pinned workers slow the dense projections
// run between them (cpu_executor.CpuExecutor's spin_us).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace ftnative {

class PoolJob {
 public:
  virtual ~PoolJob() = default;
  // Pull and run tasks until none are left; `worker` in [0, pool size).
  virtual void work(int worker) = 0;
  // True once every task has completed.
  virtual bool finished() const = 0;
};

class ThreadPool {
 public:
  // cpus[i % cpus.size()] is the CPU worker i is pinned to (no pinning when empty).
  ThreadPool(int threads, std::vector<int> cpus, int spin_us);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()); }

  // Runs `job` on the workers and blocks until it is finished. Not re-entrant: callers serialise.
  // Throws std::runtime_error in a forked child, which has no workers.
  void run(PoolJob& job);

 private:
  void worker_main(int id, int cpu);
  uint64_t wait_for_job(uint64_t seen);
  void wait_done(const PoolJob& job);

  std::vector<std::thread> workers_;
  const int spin_us_;
  const long owner_pid_;

  std::atomic<PoolJob*> job_{nullptr};
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> open_{false};  // a job is accepting workers
  std::atomic<int> active_{0};     // workers inside job->work()
  std::atomic<bool> stop_{false};

  std::mutex mu_;
  std::condition_variable wake_cv_;  // workers wait here for a new generation
  std::condition_variable done_cv_;  // the caller waits here for the job to finish
};

}  // namespace ftnative

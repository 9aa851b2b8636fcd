// A small fork-join pool for the native kernels.
//
//   parallel_for(n, fn);   // fn(i) for every i in [0, n): the caller and up to T - 1 helpers
//
// T is OpenMP's thread count (torch.set_num_threads sets it). Items are taken from a shared
// counter, and a call returns as soon as every item is done: it never waits for a helper that
// has not woken up yet. An OpenMP parallel region ends in a barrier that every thread must reach,
// so on a loaded machine one helper the OS runs late stalls the call for a whole time slice; a
// decode step makes a few hundred such calls, and we measured steps 10x slower under load. Here
// a late helper finds no work left, and the caller has done it.
//
// Helpers spin for a short while after a call (the next GEMV of a decode step follows within
// microseconds), then sleep on a condition variable. Threads are started on first use and live
// as long as the process. A call from inside a helper runs serially.
#pragma once

#include <omp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "simd.h"

namespace rwkv_native {

class Pool {
 public:
  static Pool& instance() {
    static Pool* pool = new Pool();  // never destroyed: helpers may still be asleep at exit
    return *pool;
  }

  template <class F>
  void run(int64_t n, int threads, const F& fn) {
    if (n <= 0) return;
    if (threads <= 1 || n == 1 || in_helper_) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    auto job = std::make_shared<Job>();
    job->n = n;
    job->ctx = &fn;
    job->call = [](const void* ctx, int64_t i) { (*static_cast<const F*>(ctx))(i); };
    job->helpers = threads - 1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (static_cast<int>(helpers_.size()) < threads - 1) helpers_.emplace_back([this] { helper(); });
      job_ = job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    work(*job);
    // Items other threads claimed: wait for them only (rarely more than one item's time).
    while (job->done.load(std::memory_order_acquire) < n) simd::pause();
    std::lock_guard<std::mutex> lock(mu_);
    if (job_ == job) job_.reset();
  }

 private:
  struct Job {
    std::atomic<int64_t> next{0}, done{0};
    std::atomic<int> joined{0};
    int64_t n = 0;
    int helpers = 0;  // at most this many helpers take part
    const void* ctx = nullptr;
    void (*call)(const void*, int64_t) = nullptr;
  };

  static void work(Job& job) {
    for (;;) {
      const int64_t i = job.next.fetch_add(1, std::memory_order_relaxed);
      if (i >= job.n) return;
      job.call(job.ctx, i);
      job.done.fetch_add(1, std::memory_order_release);
    }
  }

  void helper() {
    in_helper_ = true;
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      // Spin briefly for the next call, then sleep until one comes.
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
      for (int spin = 0; generation_.load(std::memory_order_acquire) == seen; ++spin) {
        simd::pause();
        if ((spin & 63) == 63 && std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
          break;
        }
      }
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lock(mu_);
        seen = generation_.load(std::memory_order_acquire);
        job = job_;
      }
      if (job && job->joined.fetch_add(1, std::memory_order_relaxed) < job->helpers) work(*job);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::shared_ptr<Job> job_;
  std::vector<std::thread> helpers_;
  static inline thread_local bool in_helper_ = false;
};

// fn(i) for i in [0, n) on torch's thread count (see Pool).
template <class F>
void parallel_for(int64_t n, const F& fn) {
  Pool::instance().run(n, omp_get_max_threads(), fn);
}

}  // namespace rwkv_native

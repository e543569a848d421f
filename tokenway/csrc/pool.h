// Helper threads that run a kernel's chunks beside the caller, who never waits for a helper that
// has not started.
//
// OpenMP's team (at::parallel_for) ends each region at a barrier every thread of the team must
// reach. Where the cores are shared (the HTTP server and its clients, other processes), a team
// thread the OS has not scheduled holds the region up until it runs, though the others did all
// the work: on 2 busy cores a 1B model's decode step (~70 regions) took 240-370 ms on 2 threads
// where it takes 30-45 ms on this pool. Here the caller claims chunks from the same counter as the
// helpers and waits only for chunks a helper claimed and has not finished; a helper that wakes
// late finds none left and goes back to waiting.
//
// One pool a process, so that tokenway's kernels share the same helpers instead of each library
// spinning threads of its own: quant.cpp owns it and registers its address as the operator
// tokenway_quant::parallel_pool; the other libraries find it there (find_pool) and run their
// parallel loops on it (parallel_for), or on OpenMP's team where the quant library is not loaded.
// The type is this header's in every library, so one library's object serves the others' calls.
// Needs C++20 (std::atomic wait and notify).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <immintrin.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <thread>

namespace tokenway_native {

class ChunkPool {
 public:
  static constexpr int64_t kMaxChunks = (int64_t(1) << 20) - 1;

  explicit ChunkPool(pid_t owner) : owner_(owner) {}

  pid_t owner() const { return owner_; }

  // fn(chunk) for every chunk in [0, chunks), on the caller and up to threads - 1 helpers, each
  // chunk once; returns when all have run. A second caller while one runs (another Python thread)
  // runs its chunks alone rather than wait for the helpers.
  template <typename Fn>
  void run(int64_t chunks, int threads, Fn& fn) {
    std::unique_lock<std::mutex> lock(caller_, std::try_to_lock);
    if (threads <= 1 || chunks <= 1 || chunks > kMaxChunks || !lock.owns_lock()) {
      for (int64_t chunk = 0; chunk < chunks; ++chunk) fn(chunk);
      return;
    }
    while (num_helpers_ < threads - 1) std::thread(&ChunkPool::helper, this, num_helpers_++).detach();
    call_.store(&invoke<Fn>, std::memory_order_relaxed);
    context_.store(&fn, std::memory_order_relaxed);
    wanted_.store(threads - 1, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    epoch_ = epoch_ % kEpochs + 1;  // never 0: a helper's "no job seen yet"
    word_.store(pack(epoch_, chunks, 0), std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      bell_.fetch_add(1, std::memory_order_seq_cst);
      bell_.notify_all();
    }
    const int64_t mine = work(epoch_);
    for (int64_t done = done_.fetch_add(mine, std::memory_order_acq_rel) + mine; done < chunks;
         done = done_.load(std::memory_order_acquire))
      _mm_pause();  // a helper is inside a chunk it claimed
  }

 private:
  using Call = void (*)(void*, int64_t);
  // The job word: epoch (24 bits), chunks (20), the next chunk to claim (20). One word, so a claim
  // (a compare-exchange) can only take a chunk of the job it read, however late it comes.
  static constexpr uint64_t kEpochs = (uint64_t(1) << 24) - 1;
  static constexpr int kSpinMicros = 200;  // a helper's wait for the next job before it sleeps

  static uint64_t pack(uint64_t epoch, int64_t chunks, int64_t next) {
    return epoch << 40 | uint64_t(chunks) << 20 | uint64_t(next);
  }
  static uint64_t epoch_of(uint64_t w) { return w >> 40; }
  static int64_t chunks_of(uint64_t w) { return int64_t(w >> 20 & kMaxChunks); }
  static int64_t next_of(uint64_t w) { return int64_t(w & kMaxChunks); }

  template <typename Fn>
  static void invoke(void* fn, int64_t chunk) {
    (*static_cast<Fn*>(fn))(chunk);
  }

  // Claims and runs chunks of job `epoch` until none is left; returns how many it ran. The call
  // and its context are read before the claim: a claim that succeeds proves the job was not
  // finished, so its caller had not yet stored the next job's.
  int64_t work(uint64_t epoch) {
    int64_t ran = 0;
    uint64_t w = word_.load(std::memory_order_acquire);
    while (epoch_of(w) == epoch && next_of(w) < chunks_of(w)) {
      const Call call = call_.load(std::memory_order_relaxed);
      void* context = context_.load(std::memory_order_relaxed);
      if (word_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        call(context, next_of(w));
        ++ran;
        w = word_.load(std::memory_order_acquire);
      }
    }
    return ran;
  }

  bool has_job(uint64_t last) const {
    const uint64_t w = word_.load(std::memory_order_seq_cst);
    return epoch_of(w) != last && next_of(w) < chunks_of(w);
  }

  void helper(int index) {
    uint64_t last = 0;  // the last job this helper saw
    for (;;) {
      const uint32_t bell = bell_.load(std::memory_order_seq_cst);
      const uint64_t w = word_.load(std::memory_order_acquire);
      if (epoch_of(w) != last && next_of(w) < chunks_of(w)) {
        last = epoch_of(w);
        if (index < wanted_.load(std::memory_order_relaxed)) {
          const int64_t ran = work(last);
          if (ran) done_.fetch_add(ran, std::memory_order_release);
        }
        continue;
      }
      // Spin a while (a step's next matmul follows within microseconds), then sleep until rung.
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
      bool found = false;
      for (int i = 1; !(found = has_job(last)); ++i) {
        _mm_pause();
        if (i % 64 == 0 && std::chrono::steady_clock::now() > until) break;
      }
      if (found) continue;
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      if (!has_job(last)) bell_.wait(bell, std::memory_order_seq_cst);  // a job stored after this check rings
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  const pid_t owner_;
  std::mutex caller_;  // one job at a time
  int num_helpers_ = 0;
  uint64_t epoch_ = 0;
  std::atomic<uint64_t> word_{0};
  std::atomic<Call> call_{nullptr};
  std::atomic<void*> context_{nullptr};
  std::atomic<int> wanted_{0};  // helpers that take part in the current job (the caller's threads - 1)
  std::atomic<int64_t> done_{0};
  std::atomic<uint32_t> bell_{0};
  std::atomic<int> sleepers_{0};
};

// The process's pool as the quant library registered it, or null where that library is not loaded.
inline ChunkPool* find_pool() {
  static std::mutex finding;
  static std::optional<c10::TypedOperatorHandle<int64_t()>> found;  // kept once found
  std::optional<c10::TypedOperatorHandle<int64_t()>> handle;
  {
    const std::lock_guard<std::mutex> lock(finding);
    if (!found.has_value()) {
      const auto op = c10::Dispatcher::singleton().findSchema({"tokenway_quant::parallel_pool", ""});
      if (op.has_value()) found = op->typed<int64_t()>();
    }
    handle = found;
  }
  return handle.has_value() ? reinterpret_cast<ChunkPool*>(handle->call()) : nullptr;
}

// at::parallel_for's contract, fn(first, last) over pieces of [begin, end) of at least `grain`
// (one piece a thread), on the process's pool (find_pool), or OpenMP's team where it has none.
template <typename Fn>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const Fn& fn) {
  const int64_t n = end - begin, threads = at::get_num_threads(), least = std::max<int64_t>(grain, 1);
  if (n <= 0) return;
  const int64_t parts = std::min(threads, (n + least - 1) / least);
  ChunkPool* pool = parts > 1 && !at::in_parallel_region() ? find_pool() : nullptr;
  if (parts <= 1 || at::in_parallel_region()) {
    fn(begin, end);
  } else if (pool == nullptr) {
    at::parallel_for(begin, end, grain, fn);
  } else {
    const int64_t per_part = (n + parts - 1) / parts;
    auto part = [&](int64_t index) {
      const int64_t first = begin + index * per_part;
      if (first < end) fn(first, std::min(end, first + per_part));
    };
    pool->run(parts, int(threads), part);
  }
}

}  // namespace tokenway_native

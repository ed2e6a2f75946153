// Parallel loops of the CPU handlers on XLA's own intra-op thread pool.
//
// XLA:CPU runs a custom call on one thread and parallelizes its own ops (dots, fusions)
// on its intra-op pool. A handler that starts threads of its own -- OpenBLAS's thread
// server, by default -- competes with that pool for the same cores: on a 2-core machine
// the step with the fused GEMM ran up to 10x slower than XLA's dot (docs/design/cpu_performance.md).
// So the handlers split their work into independent items and run them on the calling
// thread and on the pool that XLA hands to FFI handlers (ffi::ThreadPool).
#ifndef JAX_WGRAD_FFI_PARALLEL_CPU_H_
#define JAX_WGRAD_FFI_PARALLEL_CPU_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace jax_wgrad {

// Threads that work on one call: as many as XLA's pool has (XLA sizes it to the cores
// it may use), counting the calling thread, which is usually not one of them (XLA:CPU
// runs a program's thunks on the thread that launched it). At least 1.
inline int64_t ParallelWidth(ffi::ThreadPool* pool) {
  return pool == nullptr ? 1 : std::max<int64_t>(1, pool->num_threads());
}

// Runs body(i) for every i in [0, n) and returns when all are done. Items are claimed
// from a shared counter by the calling thread and by at most `max_tasks` tasks scheduled
// on `pool`, so the caller only ever waits for items that another thread has started:
// a busy pool, a pool of size 1 or one that runs tasks inline just leaves more items to
// the caller (never slower than a serial loop, never a deadlock). A task that starts
// after every item was claimed returns at once; it keeps the shared counters alive by
// itself, and never touches `body`. `body` must not throw.
template <typename Body>
void ParallelFor(ffi::ThreadPool* pool, int64_t n, int64_t max_tasks, const Body& body) {
  const int64_t tasks = pool == nullptr ? 0 : std::min(n - 1, max_tasks);
  if (tasks <= 0) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    int64_t n = 0;
    const Body* body = nullptr;
    std::mutex mu;
    std::condition_variable cv;

    void Work() {
      for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
        (*body)(i);
        if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
          std::lock_guard<std::mutex> lock(mu);
          cv.notify_all();
        }
      }
    }
  };
  auto state = std::make_shared<State>();
  state->n = n;
  state->body = &body;
  try {
    for (int64_t t = 0; t < tasks; ++t) pool->Schedule([state] { state->Work(); });
  } catch (...) {
    // Out of memory for a task: the caller does the remaining items itself.
  }
  state->Work();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load(std::memory_order_acquire) == n; });
}

// [begin, end) of part p of [0, n) split into `parts` ranges whose inner boundaries are
// multiples of `align` (the last range takes the remainder).
inline std::pair<int64_t, int64_t> SplitRange(int64_t n, int64_t parts, int64_t p,
                                              int64_t align) {
  const int64_t units = (n + align - 1) / align;
  const int64_t begin = std::min(n, units * p / parts * align);
  const int64_t end = p + 1 == parts ? n : std::min(n, units * (p + 1) / parts * align);
  return {begin, end};
}

}  // namespace jax_wgrad

#endif  // JAX_WGRAD_FFI_PARALLEL_CPU_H_

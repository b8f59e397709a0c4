// A team of threads that stays together for a whole decoding step (decoder_step.cpp): one parallel
// region a token instead of one for each product and each attention.
//
// Decoding a token multiplies a few dozen weights of 0.5-3 MB in turn, each product needing the whole
// result of the one before. Opened for each product, a parallel region costs its fork and join, and
// each thread's stream of weights starts cold: on the 2-core AMD EPYC, in the VM's faster memory state,
// a 2-thread product over 48 weights of 1.9 MB one call each read 59 GB/s where the same bytes as one
// weight read 92. In the team every thread runs the step's code: the small serial parts (norms,
// residual adds, the activations' quantization) on copies of their own, the products on their own range
// of each product's tasks (then the others' leftovers, stealing), the attention on their own heads, and
// they meet at a barrier where a result of the others is needed next.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include <immintrin.h>
#include <sched.h>

namespace gencli {

class StepTeam {
 public:
  explicit StepTeam(int64_t threads) : threads_(threads), counters_(2 * threads) {}

  int64_t size() const { return threads_; }

  // every thread of the team waits here until all have arrived; what each wrote before is then visible
  // to all. Spins (the waits are microseconds), yielding the core after a while (a thread held up by
  // the machine).
  void barrier() {
    if (threads_ <= 1) return;
    const int64_t gen = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == threads_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(gen + 1, std::memory_order_release);
      return;
    }
    for (int64_t spins = 0; generation_.load(std::memory_order_acquire) == gen; ++spins) {
      if (spins < kSpins)
        _mm_pause();
      else
        sched_yield();
    }
  }

  // fn(c) for c in [0, count): called by every thread of the team with the same count, as its pass
  // `pass` (the passes numbered alike on every thread). Thread `me` runs its own range of the tasks,
  // then the leftovers of the others' ranges, then waits for the team at the barrier.
  template <typename F>
  void run(int64_t me, int64_t pass, int64_t count, F&& fn) {
    Counter* mine = counters_.data() + (pass & 1) * threads_;
    for (int64_t k = 0; k < threads_; ++k) {
      const int64_t t = (me + k) % threads_, begin = count * t / threads_, end = count * (t + 1) / threads_;
      for (int64_t c = begin + mine[t].next.fetch_add(1, std::memory_order_relaxed); c < end;
           c = begin + mine[t].next.fetch_add(1, std::memory_order_relaxed))
        fn(c);
    }
    // the next pass's counters are the previous pass's (ended at its barrier, untouched until this one's):
    // each thread resets its own
    Counter* next = counters_.data() + ((pass + 1) & 1) * threads_;
    next[me].next.store(0, std::memory_order_relaxed);
    barrier();
  }

 private:
  static constexpr int64_t kSpins = 1 << 16;
  struct alignas(64) Counter {
    std::atomic<int64_t> next{0};
  };
  const int64_t threads_;
  std::vector<Counter> counters_;  // two passes' worth: thread t's range counter of pass p at (p % 2) * threads + t
  alignas(64) std::atomic<int64_t> arrived_{0};
  alignas(64) std::atomic<int64_t> generation_{0};
};

// The calling thread's seat in the team running the current step (none outside a step): the products
// (quant_gemv.cpp) run their tasks through it instead of opening a parallel region of their own.
struct TeamSeat {
  StepTeam* team = nullptr;
  int64_t me = 0;    // this thread's number in the team
  int64_t pass = 0;  // the team passes this thread has run in the current step
};

inline TeamSeat& team_seat() {
  static thread_local TeamSeat seat;
  return seat;
}

}  // namespace gencli

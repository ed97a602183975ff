// common/timing.hpp: timing for the examples: host wall clock (stopwatch) and GPU events (median_gpu_ms).
//
// A decode step that ends by reading its token back to the host (one synchronisation) is timed
// best on the host: push → launch → sync → read is exactly what a serving loop pays. GPU-only time
// is measured with replay::event_timer (replay/event.hpp) instead: median_gpu_ms.
//
//   replay_examples::stopwatch sw;
//   step();
//   double us = sw.elapsed_us();
//   double ms = replay_examples::median_gpu_ms(stream, 20, [&] { exec.launch(stream); });
//
// Guarantees: stopwatch is monotonic (std::chrono::steady_clock) and never throws; median_gpu_ms
// throws replay::cuda_error when an event call fails, and whatever `work` throws.
#pragma once

#include "common/report.hpp"

#include <replay/event.hpp>
#include <replay/stream.hpp>

#include <chrono>
#include <vector>

namespace replay_examples {

/// Starts on construction; restart() resets it.
class stopwatch {
 public:
  using clock = std::chrono::steady_clock;
  stopwatch() noexcept : start_(clock::now()) {}
  void restart() noexcept { start_ = clock::now(); }
  [[nodiscard]] double elapsed_s() const noexcept {
    return std::chrono::duration<double>(clock::now() - start_).count();
  }
  [[nodiscard]] double elapsed_ms() const noexcept { return elapsed_s() * 1e3; }
  [[nodiscard]] double elapsed_us() const noexcept { return elapsed_s() * 1e6; }

 private:
  clock::time_point start_;
};

/// Median GPU time in ms of `work` (which enqueues on s), over `runs` timed runs after 2 untimed ones;
/// each run is bracketed by two events and waited for.
template <class F>
double median_gpu_ms(replay::stream_ref s, int runs, F&& work) {
  std::vector<double> t;
  for (int i = 0; i < runs + 2; ++i) {
    replay::event_timer et;
    et.start(s);
    work();
    et.stop(s);
    if (i >= 2) t.push_back(et.elapsed_ms());
  }
  return median(t);
}

}  // namespace replay_examples

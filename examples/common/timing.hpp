// common/timing.hpp: host wall-clock timing for the examples.
//
// A decode step that ends by reading its token back to the host (one synchronisation) is timed
// best on the host: push → launch → sync → read is exactly what a serving loop pays. GPU-only time
// is measured with replay::event_timer (replay/event.hpp) instead.
//
//   replay_examples::stopwatch sw;
//   step();
//   double us = sw.elapsed_us();
//
// Guarantees: monotonic (std::chrono::steady_clock); never throws.
#pragma once

#include <chrono>

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

}  // namespace replay_examples

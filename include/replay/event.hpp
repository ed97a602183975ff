// replay/event.hpp: an owning CUDA event, a borrowing event_ref, and an event timer.
//
// `event` is move-only with an empty moved-from state. Events are created without timing by default
// (cheapest for synchronisation); `event_flags::timing` enables elapsed-time queries.
// `event_timer` measures GPU time between two points on a stream.
//
// Example:
//   replay::event_timer t;
//   t.start(s); exec.launch(s); t.stop(s);
//   float ms = t.elapsed_ms();   // waits for the stop event
#pragma once

#include <replay/error.hpp>
#include <replay/stream.hpp>

#include <cstddef>
#include <utility>

namespace replay {

enum class event_flags : unsigned {
  sync_only = cudaEventDisableTiming,  ///< no timing: cheapest, for ordering and guards (default)
  timing = cudaEventDefault,           ///< records timestamps for elapsed-time queries
};

/// A borrowing view of an event.
class event_ref {
 public:
  constexpr explicit event_ref(cudaEvent_t e) noexcept : e_(e) {}
  [[nodiscard]] constexpr cudaEvent_t get() const noexcept { return e_; }
  void record(stream_ref s) const { REPLAY_CHECK(cudaEventRecord(e_, s.get())); }
  void synchronize() const { REPLAY_CHECK(cudaEventSynchronize(e_)); }
  /// True once all work captured by the last record() has completed.
  [[nodiscard]] bool ready() const {
    const cudaError_t e = cudaEventQuery(e_);
    if (e == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    REPLAY_CHECK(e);
    return true;
  }
  /// Makes `s` wait for this event (no host blocking).
  void wait_on(stream_ref s) const { REPLAY_CHECK(cudaStreamWaitEvent(s.get(), e_, 0)); }

 private:
  cudaEvent_t e_;
};

/// An owning CUDA event. Move-only; moved-from state is empty.
class event {
 public:
  /// Creates a synchronisation-only event (no timing).
  event() : event(event_flags::sync_only) {}
  /// An empty event: no CUDA event is created (assign one later). Never throws.
  explicit event(std::nullptr_t) noexcept {}
  explicit event(event_flags flags) {
    REPLAY_CHECK(cudaEventCreateWithFlags(&e_, static_cast<unsigned>(flags)));
  }
  event(event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  event& operator=(event&& o) noexcept {
    if (this != &o) reset(std::exchange(o.e_, nullptr));
    return *this;
  }
  event(const event&) = delete;
  event& operator=(const event&) = delete;
  ~event() { reset(); }

  [[nodiscard]] cudaEvent_t get() const noexcept { return e_; }
  [[nodiscard]] cudaEvent_t release() noexcept { return std::exchange(e_, nullptr); }
  void reset(cudaEvent_t e = nullptr) noexcept {
    if (e_ != nullptr) (void)detail::check_noexcept(cudaEventDestroy(e_));
    e_ = e;
  }
  explicit operator bool() const noexcept { return e_ != nullptr; }

  [[nodiscard]] event_ref ref() const {
    if (e_ == nullptr) throw usage_error("replay::event: use of an empty (moved-from) event");
    return event_ref(e_);
  }
  operator event_ref() const { return ref(); }  // NOLINT: implicit borrow

  void record(stream_ref s) const { ref().record(s); }
  void synchronize() const { ref().synchronize(); }
  [[nodiscard]] bool ready() const { return ref().ready(); }
  void wait_on(stream_ref s) const { ref().wait_on(s); }

 private:
  cudaEvent_t e_ = nullptr;
};

/// Milliseconds between two recorded timing events (waits for `stop`).
inline float elapsed_ms(event_ref start, event_ref stop) {
  stop.synchronize();
  float ms = 0.0f;
  REPLAY_CHECK(cudaEventElapsedTime(&ms, start.get(), stop.get()));
  return ms;
}

/// GPU time between start() and stop() on a stream, measured with two timing events.
class event_timer {
 public:
  event_timer() : start_(event_flags::timing), stop_(event_flags::timing) {}
  void start(stream_ref s) { start_.record(s); }
  void stop(stream_ref s) { stop_.record(s); }
  /// Waits for the stop event and returns the elapsed GPU time in milliseconds.
  [[nodiscard]] float elapsed_ms() const { return replay::elapsed_ms(start_, stop_); }

 private:
  event start_;
  event stop_;
};

}  // namespace replay

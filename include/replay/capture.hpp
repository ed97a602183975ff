// replay/capture.hpp: exception-safe stream capture.
//
// `capture_scope` begins capturing a stream in its constructor and `finish()` ends the capture and
// returns the `graph`. If the scope is left without finish() (an exception, an early return), its
// destructor ends the capture, discards the partial graph and clears the capture error, so the
// stream is usable again for eager work. The capture mode is explicit and defaults to
// `capture_mode::thread_local_mode`: capture-unsafe calls (cudaMalloc, synchronisation, ...) made by
// *this* thread fail, other threads are unaffected.
//
// Side streams join a capture with fork() and must come back with join() before finish(); finish()
// names any stream that was forked and not joined.
//
// Guarantees: not copyable or movable (it is a scope). finish() twice throws usage_error. Errors
// raised through REPLAY_CHECK while a scope is active say that the stream was capturing and hint at
// the cause. The destructor never throws.
//
// Example:
//   replay::graph g;
//   {
//     replay::capture_scope scope(s);           // thread-local mode
//     embed<<<1, 64, 0, s.get()>>>(meta.device(), x);
//     REPLAY_CHECK_LAUNCH("embed");
//     g = scope.finish();
//   }
//   // or, in one call:
//   replay::graph g2 = replay::capture(s, [&](replay::stream_ref cs) { step(cs); });
#pragma once

#include <replay/error.hpp>
#include <replay/event.hpp>
#include <replay/graph.hpp>
#include <replay/stream.hpp>

#include <algorithm>
#include <source_location>
#include <string>
#include <utility>
#include <vector>

namespace replay {

/// Which threads' capture-unsafe calls a capture guards against (cudaStreamCaptureMode).
enum class capture_mode {
  global = cudaStreamCaptureModeGlobal,                  ///< unsafe calls from any thread fail
  thread_local_mode = cudaStreamCaptureModeThreadLocal,  ///< only this thread's (default)
  relaxed = cudaStreamCaptureModeRelaxed,                ///< no guard (you promise correctness)
};

/// Captures the work issued to one stream (and to streams forked from it) into a graph.
class capture_scope {
 public:
  explicit capture_scope(stream_ref s, capture_mode mode = capture_mode::thread_local_mode)
      : stream_(s), mode_(mode) {
    if (s.get() == nullptr)
      throw usage_error("replay::capture_scope: the legacy default stream (0) cannot be captured; "
                        "use a replay::stream");
    if (detail::capture_observer* o = detail::capture_observer_slot().load(std::memory_order_acquire))
      o->capture_begins(s.get());
    // Strongly exception-safe: the capture stack grows first (may throw bad_alloc with nothing
    // begun), and a failed begin leaves the stack as it was.
    detail::capturing_streams().push_back(s.get());
    const cudaError_t err = cudaStreamBeginCapture(s.get(), static_cast<cudaStreamCaptureMode>(mode));
    if (err != cudaSuccess) {
      pop();
      detail::throw_cuda_error(err, "cudaStreamBeginCapture", {}, std::source_location::current());
    }
    mark_ = detail::conditional_begin();
    active_ = true;
  }
  capture_scope(const capture_scope&) = delete;
  capture_scope& operator=(const capture_scope&) = delete;

  ~capture_scope() { discard(); }

  [[nodiscard]] stream_ref stream() const noexcept { return stream_; }
  [[nodiscard]] capture_mode mode() const noexcept { return mode_; }
  [[nodiscard]] bool active() const noexcept { return active_; }

  /// Brings `side` into the capture: work issued to it after this call is captured, ordered after
  /// everything captured on the origin stream so far.
  /// Strongly exception-safe: if it throws, `side` did not join the capture.
  void fork(stream_ref side) {
    require_active("fork");
    event e;
    forks_.reserve(forks_.size() + 1);  // the push_back below cannot throw once `side` has joined
    e.record(stream_);
    e.wait_on(side);
    forks_.push_back({side.get(), false, std::move(e)});
  }

  /// Joins `side` back: the origin stream's later work waits for everything issued to `side`.
  void join(stream_ref side) {
    require_active("join");
    auto it = std::find_if(forks_.begin(), forks_.end(),
                           [&](const fork_info& f) { return f.side == side.get() && !f.joined; });
    if (it == forks_.end())
      throw usage_error(fmt::format("replay::capture_scope::join: stream {} was not forked into "
                                    "this capture (or was already joined)",
                                    static_cast<const void*>(side.get())));
    it->done.record(side);
    it->done.wait_on(stream_);
    it->joined = true;
  }

  /// Ends the capture and returns the graph. Throws usage_error if called twice or if a forked
  /// stream was not joined (the capture is then discarded), cuda_error if CUDA invalidated the
  /// capture (e.g. after a capture-unsafe call whose error was ignored).
  [[nodiscard]] graph finish() {
    require_active("finish");
    std::string unjoined;
    for (const auto& f : forks_)
      if (!f.joined) unjoined += fmt::format("{}{}", unjoined.empty() ? "" : ", ",
                                             static_cast<const void*>(f.side));
    if (!unjoined.empty()) {
      discard();
      throw usage_error(fmt::format("replay::capture_scope::finish: forked stream(s) {} were not "
                                    "joined back before finish(); the capture was discarded",
                                    unjoined));
    }
    pop();
    active_ = false;
    cudaGraph_t g = nullptr;
    const cudaError_t err = cudaStreamEndCapture(stream_.get(), &g);
    detail::conditional_table conditionals = detail::conditional_end(mark_, err == cudaSuccess);
    if (err != cudaSuccess) {
      if (g != nullptr) (void)cudaGraphDestroy(g);
      detail::throw_cuda_error(err, "cudaStreamEndCapture",
                               err == cudaErrorStreamCaptureInvalidated
                                   ? "the capture was invalidated by an earlier failed call inside it"
                                   : std::string(),
                               std::source_location::current());
    }
    return graph(g, std::move(conditionals));
  }

  /// Ends the capture now and throws the partial graph away; the stream is usable for eager work.
  /// Does nothing when the capture already ended. Never throws.
  void discard() noexcept {
    if (!active_) return;
    active_ = false;
    pop();
    (void)detail::conditional_end(mark_, false);
    // Join forked streams that never came back so the capture can end, then drop everything.
    for (auto& f : forks_) {
      if (f.joined) continue;
      (void)cudaEventRecord(f.done.get(), f.side);
      (void)cudaStreamWaitEvent(stream_.get(), f.done.get(), 0);
      f.joined = true;
    }
    cudaGraph_t partial = nullptr;
    (void)cudaStreamEndCapture(stream_.get(), &partial);
    if (partial != nullptr) (void)cudaGraphDestroy(partial);
    (void)cudaGetLastError();  // leave no capture error behind for the next eager call
    forks_.clear();
  }

 private:
  struct fork_info {
    cudaStream_t side;
    bool joined;
    event done;
  };

  void require_active(const char* what) const {
    if (!active_)
      throw usage_error(fmt::format("replay::capture_scope::{}: the capture already finished", what));
  }
  void pop() noexcept {
    auto& v = detail::capturing_streams();
    auto it = std::find(v.rbegin(), v.rend(), stream_.get());
    if (it != v.rend()) v.erase(std::next(it).base());
  }

  stream_ref stream_;
  capture_mode mode_;
  bool active_ = false;
  std::vector<fork_info> forks_;
  detail::conditional_mark mark_{};  // where this capture's conditional records start
};

namespace detail {
inline int& warmup_depth() noexcept {
  thread_local int depth = 0;
  return depth;
}
}  // namespace detail

/// True while the calling thread runs a step's eager warm-up (graph_pool does, before a capture).
/// A warm-up exists to run the step's kernels once outside a capture (lazy loading, library
/// handles); work that must not run twice for one request is skipped then: while_loop() and
/// token_loop::capture() on a stream that is not capturing do nothing during a warm-up, so a
/// device loop never decodes for real before its capture.
[[nodiscard]] inline bool warming_up() noexcept { return detail::warmup_depth() > 0; }

/// Marks the calling thread as running a warm-up for the scope's lifetime (see warming_up()).
class warmup_scope {
 public:
  warmup_scope() noexcept { ++detail::warmup_depth(); }
  warmup_scope(const warmup_scope&) = delete;
  warmup_scope& operator=(const warmup_scope&) = delete;
  ~warmup_scope() { --detail::warmup_depth(); }
};

/// Captures `fn(stream)` into a graph. Exception-safe: if `fn` throws, the capture is discarded, the
/// stream is left usable, and the exception propagates.
template <class F>
[[nodiscard]] graph capture(stream_ref s, F&& fn, capture_mode mode = capture_mode::thread_local_mode) {
  capture_scope scope(s, mode);
  std::forward<F>(fn)(s);
  return scope.finish();
}

}  // namespace replay

// replay/cuda_graph_backend.hpp: the CUDA side of a graph pool.
//
// `cuda_graph_backend` is what `graph_pool` (graph_pool.hpp) uses to capture a step with
// capture_scope, instantiate and upload the graph, launch it, and retire evicted execs. The pool's
// logic is a template over its backend; host tests drive the same logic with a fake backend.
//
// Retirement: an evicted exec may still be running. Every launch (and the upload) records the
// slot's completion event right after it, so retiring needs no stream: the exec is destroyed once
// that event has completed. The user may destroy the stream of the last replay at any time. Retired
// execs are polled (cudaEventQuery, never blocking) on every miss, prewarm and explicit collect(),
// and waited for when the backend is destroyed. The cost is one cudaEventRecord per replay.
//
// Device: a backend belongs to the device that was current when it was made (or the one named);
// capturing or launching while another device is current throws usage_error. One pool per GPU is
// the multi-GPU pattern.
//
// Guarantees: move-only; destruction waits for retired execs and never throws. Not thread-safe.
#pragma once

#include <replay/capture.hpp>
#include <replay/error.hpp>
#include <replay/event.hpp>
#include <replay/graph.hpp>
#include <replay/graph_exec.hpp>
#include <replay/nvtx.hpp>
#include <replay/pool_stats.hpp>
#include <replay/stream.hpp>

#include <fmt/format.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace replay {
namespace detail {

/// Calls `step(s, key)` or, for a step that takes only the stream, `step(s)`.
template <class Step, class S, class K>
void call_step(Step& step, S s, const K& key) {
  if constexpr (std::is_invocable_v<Step&, S, const K&>)
    step(s, key);
  else
    step(s);
}

inline double ms_since(std::chrono::steady_clock::time_point t0,
                       std::chrono::steady_clock::time_point t1) noexcept {
  return std::chrono::duration<double, std::milli>(t1 - t0).count();
}

/// Device-wide memory figures for capture_info (never throws; ok = false when unavailable).
struct memory_probe {
  std::size_t free_bytes = 0;
  std::uint64_t graph_used = 0;
  bool ok = false;

  static memory_probe take() noexcept {
    memory_probe p;
    std::size_t total = 0;
    int device = 0;
    if (cudaMemGetInfo(&p.free_bytes, &total) != cudaSuccess || cudaGetDevice(&device) != cudaSuccess) {
      (void)cudaGetLastError();
      return p;
    }
    unsigned long long used = 0;  // NOLINT: the API's type
    if (cudaDeviceGetGraphMemAttribute(device, cudaGraphMemAttrUsedMemCurrent, &used) != cudaSuccess) {
      (void)cudaGetLastError();
      used = 0;
    }
    p.graph_used = used;
    p.ok = true;
    return p;
  }
};

/// The current device, or -1 when it cannot be read.
inline int current_device() noexcept {
  int d = -1;
  if (cudaGetDevice(&d) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return d;
}

}  // namespace detail

/// The pool's CUDA backend: captures with capture_scope, instantiates with upload, launches with
/// cudaGraphLaunch followed by a completion event, and retires evicted execs once that event has
/// completed. Move-only.
class cuda_graph_backend {
 public:
  using exec_type = graph_exec;
  using stream_type = stream_ref;
  /// Per-graph completion marker: an event recorded after the upload and after every launch.
  struct fence_type {
    event done{nullptr};
  };

  /// A backend for the current device.
  cuda_graph_backend() : device_(detail::current_device()) {}
  /// A backend for `device` (the pool then refuses to run while another device is current).
  explicit cuda_graph_backend(int device) : device_(device) {}
  cuda_graph_backend(cuda_graph_backend&& o) noexcept
      : retired_(std::move(o.retired_)), device_(o.device_) {}
  cuda_graph_backend& operator=(cuda_graph_backend&& o) noexcept {
    if (this != &o) {
      drain();
      retired_ = std::move(o.retired_);
      device_ = o.device_;
    }
    return *this;
  }
  cuda_graph_backend(const cuda_graph_backend&) = delete;
  cuda_graph_backend& operator=(const cuda_graph_backend&) = delete;
  /// Waits for every retired exec's last replay, then destroys it.
  ~cuda_graph_backend() { drain(); }

  /// The device this backend (and its pool) belongs to.
  [[nodiscard]] int device() const noexcept { return device_; }

  /// Throws usage_error unless this backend's device is current (the pool calls it before a miss's
  /// warm-up; launch() checks as well).
  void require_device(const char* what) const {
    const int current = detail::current_device();
    if (current != device_) [[unlikely]]
      throw usage_error(fmt::format("replay::graph_pool::{}: the pool belongs to device {} but device "
                                    "{} is current; make one pool per device and use each with its "
                                    "own device current", what, device_, current));
  }

  /// Captures `step` on `s`, instantiates and uploads it into `out`, and records `fence` after the
  /// upload. Updates `phase` as it goes (capture, then instantiate) so a failure can be attributed.
  /// Throws what the step or CUDA throws; a failed capture is discarded by capture_scope and leaves
  /// `s` usable.
  template <class Step, class Key>
  capture_info capture(Step& step, const Key& key, stream_ref s, const pool_options& options,
                       pool_phase& phase, graph_exec& out, fence_type& fence) {
    using clock = std::chrono::steady_clock;
    capture_info info;
    const detail::memory_probe before =
        options.measure_memory ? detail::memory_probe::take() : detail::memory_probe{};
    phase = pool_phase::capture;
    const auto t0 = clock::now();
    graph g;
    {
      const nvtx_range range("capture", key);
      capture_scope scope(s, options.mode);
      detail::call_step(step, s, key);
      g = scope.finish();
    }
    const auto t1 = clock::now();
    phase = pool_phase::instantiate;
    {
      const nvtx_range range("instantiate", key);  // with the upload
      if (!fence.done) fence.done = event();
      graph_exec e = g.instantiate({.upload_stream = s.get()});
      fence.done.record(s);
      out = std::move(e);
    }
    const auto t2 = clock::now();
    info.capture_ms = detail::ms_since(t0, t1);
    info.instantiate_ms = detail::ms_since(t1, t2);
    info.nodes = g.node_count();
    if (options.measure_memory && before.ok) {
      const detail::memory_probe after = detail::memory_probe::take();
      if (after.ok) {
        info.device_bytes =
            static_cast<std::int64_t>(before.free_bytes) - static_cast<std::int64_t>(after.free_bytes);
        info.graph_mem_bytes =
            static_cast<std::int64_t>(after.graph_used) - static_cast<std::int64_t>(before.graph_used);
        info.memory_measured = true;
      }
    }
    return info;
  }

  /// Replays `e` on `s` (one cudaGraphLaunch) and records `fence` after it.
  void launch(const graph_exec& e, fence_type& fence, stream_ref s) const {
    require_device("launch");
    e.launch(s);
    REPLAY_CHECK(cudaEventRecord(fence.done.get(), s.get()));
  }

  /// Takes an evicted exec and its fence: the exec is destroyed once the fence's event has
  /// completed (at once when it never ran). Never throws: if the exec cannot be queued, waits for
  /// the fence instead.
  void retire(graph_exec&& e, fence_type&& fence) noexcept {
    if (!e) return;
    if (!fence.done) {
      e.reset();
      return;
    }
    try {
      retired_.push_back(retired{std::move(e), std::move(fence.done)});
    } catch (...) {
      (void)detail::check_noexcept(cudaEventSynchronize(fence.done.get()));
      e.reset();
    }
  }

  /// Destroys retired execs whose last replay has completed. Never blocks.
  void collect() noexcept {
    std::erase_if(retired_, [](retired& r) {
      const cudaError_t q = cudaEventQuery(r.done.get());
      if (q == cudaErrorNotReady) {
        (void)cudaGetLastError();
        return false;
      }
      if (q != cudaSuccess) {  // an error: don't leak, wait then drop
        (void)cudaGetLastError();
        (void)cudaEventSynchronize(r.done.get());
        (void)cudaGetLastError();
      }
      return true;
    });
  }

  /// Waits for every retired exec and destroys it. Never throws.
  void drain() noexcept {
    for (retired& r : retired_) {
      if (r.done) (void)detail::check_noexcept(cudaEventSynchronize(r.done.get()));
    }
    retired_.clear();
  }

  /// Retired execs not yet destroyed.
  [[nodiscard]] std::size_t retired_pending() const noexcept { return retired_.size(); }

  /// Clears CUDA's last-error slot after a failure (the stream itself is usable again: a failed
  /// capture was ended by capture_scope).
  void clear_error() noexcept { (void)cudaGetLastError(); }

 private:
  struct retired {
    graph_exec exec;
    event done;
  };
  std::vector<retired> retired_;
  int device_ = -1;
};

}  // namespace replay

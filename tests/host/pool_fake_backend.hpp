// A fake graph-pool backend for host tests: no GPU, every call recorded in a shared journal.
//
// "Capturing" calls the step with journal.capturing = true so that a step can tell its eager runs
// from its capture; failures are injected through the journal's flags.
#pragma once

#include <replay/graph_pool.hpp>

#include <fmt/format.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace pool_fake {

/// Everything the fake backend did, shared between the test and the backend inside the pool.
struct journal {
  std::vector<std::string> events;  // "capture <key>", "launch <key> s<stream>", "retire <key> s<stream>"
  bool capturing = false;           // true while the backend "captures" the step
  bool fail_instantiate = false;    // the next captures fail in the instantiate phase
  bool fail_launch = false;         // launches throw
  bool completed = true;            // retired execs count as finished at the next collect()
  int captures = 0;
  int launches = 0;
  int collects = 0;
  int clears = 0;
  std::vector<std::string> pending;    // retired, not yet destroyed
  std::vector<std::string> destroyed;  // retired and destroyed

  /// The events that start with `prefix`.
  [[nodiscard]] std::vector<std::string> only(const std::string& prefix) const {
    std::vector<std::string> out;
    for (const auto& e : events)
      if (e.rfind(prefix, 0) == 0) out.push_back(e);
    return out;
  }
};

/// A fake executable graph: an id and the key it was captured for.
struct fake_exec {
  int id = 0;
  std::string key;
  explicit operator bool() const noexcept { return id != 0; }
};

/// Thrown by the fake backend's injected failures.
struct fake_failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class fake_backend {
 public:
  using exec_type = fake_exec;
  using stream_type = int;
  /// The stream of the graph's last launch or upload (-1: never ran).
  struct fence_type {
    int last = -1;
  };

  explicit fake_backend(std::shared_ptr<journal> j = std::make_shared<journal>()) : j_(std::move(j)) {}

  template <class Step, class Key>
  replay::capture_info capture(Step& step, const Key& key, int s, const replay::pool_options&,
                               replay::pool_phase& phase, fake_exec& out, fence_type& fence) {
    phase = replay::pool_phase::capture;
    j_->capturing = true;
    try {
      replay::detail::call_step(step, s, key);
    } catch (...) {
      j_->capturing = false;
      throw;
    }
    j_->capturing = false;
    if (j_->fail_instantiate) {
      phase = replay::pool_phase::instantiate;
      throw fake_failure("fake instantiate failure");
    }
    out = fake_exec{++next_id_, replay::describe_key(key)};
    fence.last = s;
    ++j_->captures;
    j_->events.push_back(fmt::format("capture {}", out.key));
    replay::capture_info info;
    info.capture_ms = 1.5;
    info.instantiate_ms = 0.5;
    info.nodes = 3;
    info.device_bytes = 1024;
    info.graph_mem_bytes = 0;
    info.memory_measured = true;
    return info;
  }

  void launch(const fake_exec& e, fence_type& fence, int s) {
    if (!e) throw std::logic_error("launch of an empty fake exec");
    if (j_->fail_launch) throw fake_failure("fake launch failure");
    ++j_->launches;
    fence.last = s;
    j_->events.push_back(fmt::format("launch {} s{}", e.key, s));
  }

  void retire(fake_exec&& e, fence_type&& fence) noexcept {
    if (!e) return;
    j_->events.push_back(fence.last >= 0 ? fmt::format("retire {} s{}", e.key, fence.last)
                                         : fmt::format("retire {}", e.key));
    j_->pending.push_back(e.key);
    e = fake_exec{};
  }

  void collect() noexcept {
    ++j_->collects;
    if (!j_->completed) return;
    for (auto& k : j_->pending) j_->destroyed.push_back(k);
    j_->pending.clear();
  }

  [[nodiscard]] std::size_t retired_pending() const noexcept { return j_->pending.size(); }
  void clear_error() noexcept { ++j_->clears; }

  [[nodiscard]] journal& log() const noexcept { return *j_; }

 private:
  std::shared_ptr<journal> j_;
  int next_id_ = 0;
};

template <class Key>
using fake_pool = replay::basic_graph_pool<Key, fake_backend>;

}  // namespace pool_fake

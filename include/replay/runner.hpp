// replay/runner.hpp: the decode-step runner: graphs when possible, eager when not, never a lost step.
//
// `step_runner<Key>` wraps a user step function and a graph pool. `run(key, stream)` replays the
// graph for the key (capturing it on first use, see graph_pool.hpp). When a capture, an
// instantiation or a replay fails, the runner
//   1. writes one warning (fmt) to its warning sink (stderr unless replaced): once per runner, or
//      once per key, and per failure phase;
//   2. turns graphs off for the whole runner (fallback_scope::runner, the default, as mistral.rs
//      does for a pipeline) or for that key only (fallback_scope::key), dropping the graphs it no
//      longer uses;
//   3. runs the step eagerly on the same stream and returns: the request is not lost.
// A step that fails when run eagerly (its warm-up) is not a graph problem: that exception
// propagates.
//
// Kill switch (kill_switch.hpp): REPLAY_CUDA_GRAPHS=0 turns graphs off for every runner.
// `runner_options::use_graphs = false` turns one runner's graphs off; it cannot turn them on
// against the kill switch. Warnings go to a warning_sink (warnings.hpp).
//
// Batches: `run_batch(n, stream, make_key)` pads n with the runner's bucket policy, builds the key
// with `make_key(bucket)` and runs it, counting real vs padded rows. A batch above the largest
// bucket runs eagerly with `make_key(n)` (oversize_policy::eager, counted) or throws usage_error
// (oversize_policy::throw_error).
//
// Guarantees: the graph hit path adds two predictable branches to graph_pool::run and allocates
// nothing. Not thread-safe (one thread drives a runner). Move-constructible.
//
// Example:
//   auto step = [&](replay::stream_ref s, const replay::graph_key& k) { decode_step(s, k.bucket); };
//   replay::step_runner<replay::graph_key> runner(step, {.buckets = replay::bucket_policy::powers_of_two(64)});
//   const std::size_t b = runner.buckets().pad(n).value_or(n);
//   stage_rows(n, b); meta.push(s);                          // per-step values, padded rows too
//   runner.run_batch(n, s, [](std::size_t rows) { return replay::graph_key{.bucket = uint32_t(rows)}; });
#pragma once

#include <replay/bucket.hpp>
#include <replay/error.hpp>
#include <replay/graph_pool.hpp>
#include <replay/kill_switch.hpp>
#include <replay/nvtx.hpp>
#include <replay/warnings.hpp>

#include <fmt/format.h>

#include <atomic>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace replay {

// ------------------------------------------------------------------------------------------------
// The runner
// ------------------------------------------------------------------------------------------------

/// What a failure turns off.
enum class fallback_scope : std::uint8_t {
  runner,  ///< graphs off for the whole runner (default)
  key,     ///< graphs off for the failing key only
};

/// What run_batch does with a batch above the largest bucket.
enum class oversize_policy : std::uint8_t {
  eager,        ///< run it eagerly, unpadded (counted as eager_oversize)
  throw_error,  ///< throw usage_error
};

/// Settings of a step_runner.
struct runner_options {
  pool_options pool{};                        ///< capacity, warm-up runs, capture mode, memory probe
  bucket_policy buckets{};                    ///< for run_batch (default: vllm_default(512))
  fallback_scope fallback = fallback_scope::runner;  ///< what a failure turns off
  oversize_policy oversize = oversize_policy::eager;  ///< batches above the largest bucket
  warning_sink warn{};                        ///< where warnings go (empty: stderr)
  bool use_graphs = true;                     ///< false: this runner always runs eagerly
};

/// Runs a decode step through a graph pool with eager fallback. See the header comment.
template <class Key, class Backend = cuda_graph_backend, class Hash = key_hash<Key>>
class basic_step_runner {
 public:
  using key_type = Key;
  using pool_type = basic_graph_pool<Key, Backend, Hash>;
  using stream_type = typename Backend::stream_type;
  /// The user's step: issues one decode step for `key` (rows = the key's bucket) to the stream.
  using step_function = std::function<void(stream_type, const Key&)>;

  explicit basic_step_runner(step_function step, runner_options options = {}, Backend backend = Backend{})
      : step_(std::move(step)),
        buckets_(std::move(options.buckets)),
        fallback_(options.fallback),
        oversize_(options.oversize),
        warn_(std::move(options.warn)),
        pool_(options.pool, std::move(backend)) {
    if (!step_) throw usage_error("replay::step_runner: the step function is empty");
    detail::warn_unrecognised_graphs_env(warn_);
    if (!graphs_env().enabled) {
      off_ = off_reason::kill_switch;
    } else if (!options.use_graphs) {
      off_ = off_reason::option;
    }
  }

  /// Runs the step for `key` on `s`: replays its graph (capturing it on first use), or runs
  /// eagerly when graphs are off for the runner or the key. A capture or replay failure is
  /// reported once, turns graphs off (runner or key) and the step runs eagerly. `rows` feeds the
  /// real-vs-padded statistics.
  step_path run(const Key& key, stream_type s, batch_rows rows = {}) {
    if (off_ != off_reason::none) [[unlikely]]
      return eager(key, s, rows, off_ == off_reason::failure ? step_path::eager_fallback
                                                             : step_path::eager_disabled);
    if (!key_state_.empty()) [[unlikely]] {
      const auto it = key_state_.find(key);
      if (it != key_state_.end() && (it->second & disabled_bit) != 0)
        return eager(key, s, rows, step_path::eager_fallback);
    }
    try {
      return pool_.run(key, s, step_, rows);
    } catch (const usage_error&) {
      throw;  // misuse is never a graph problem
    } catch (const std::exception& e) {
      return on_failure(key, s, rows, e.what());
    } catch (...) {
      return on_failure(key, s, rows, "an exception not derived from std::exception");
    }
  }

  /// Pads `n` rows to a bucket, builds the key with `make_key(bucket)` and runs it. Above the
  /// largest bucket: eager with `make_key(n)` or usage_error, per the oversize policy.
  template <class MakeKey>
  step_path run_batch(std::size_t n, stream_type s, MakeKey&& make_key) {
    const std::optional<std::size_t> b = buckets_.pad(n);
    if (!b) [[unlikely]] {
      if (oversize_ == oversize_policy::throw_error)
        throw usage_error(fmt::format("replay::step_runner: a batch of {} rows exceeds the largest "
                                      "bucket ({}) and the oversize policy is throw_error",
                                      n, buckets_.largest()));
      return eager(make_key(n), s, {n, n}, step_path::eager_oversize);
    }
    return run(make_key(*b), s, {n, *b});
  }

  /// Runs the step eagerly for `key`, counted as `why` (an eager step_path). Checks, before any
  /// work is issued, that `why` is an eager path and that the pool's device is current (as a
  /// replay does).
  step_path eager(const Key& key, stream_type s, batch_rows rows, step_path why) {
    if (why != step_path::eager_disabled && why != step_path::eager_fallback && why != step_path::eager_oversize)
      throw usage_error("replay::step_runner::eager: the reason must be an eager step_path");
    if constexpr (requires { pool_.backend().require_device("eager step"); })
      pool_.backend().require_device("eager step");
    {
      const nvtx_range range(why == step_path::eager_fallback   ? "eager fallback"
                             : why == step_path::eager_oversize ? "eager oversize"
                                                                : "eager disabled",
                             key);
      step_(s, key);
    }
    switch (why) {
      case step_path::eager_disabled: ++eager_.eager_disabled; break;
      case step_path::eager_fallback: ++eager_.eager_fallbacks; break;
      default: ++eager_.eager_oversize; break;
    }
    detail::add_rows(eager_, rows);
    return why;
  }

  /// Graphs are on for this runner (not switched off, no runner-wide failure).
  [[nodiscard]] bool graphs_enabled() const noexcept { return off_ == off_reason::none; }
  /// Graphs are off for this key after a failure (fallback_scope::key).
  [[nodiscard]] bool key_disabled(const Key& key) const {
    const auto it = key_state_.find(key);
    return it != key_state_.end() && (it->second & disabled_bit) != 0;
  }
  /// Turns graphs back on after failures (not against the kill switch or use_graphs = false).
  /// Warnings already given are not repeated.
  void reenable_graphs() noexcept {
    if (off_ == off_reason::failure) off_ = off_reason::none;
    for (auto& [k, state] : key_state_) state &= static_cast<std::uint8_t>(~disabled_bit);
  }

  /// Replaces the warning sink (empty: stderr).
  void set_warning_sink(warning_sink sink) { warn_ = std::move(sink); }

  [[nodiscard]] const bucket_policy& buckets() const noexcept { return buckets_; }
  [[nodiscard]] pool_type& pool() noexcept { return pool_; }
  [[nodiscard]] const pool_type& pool() const noexcept { return pool_; }
  /// The pool's statistics with this runner's eager runs added (eager paths and their rows).
  [[nodiscard]] pool_stats stats() const {
    pool_stats st = pool_.stats();
    st.eager_disabled += eager_.eager_disabled;
    st.eager_fallbacks += eager_.eager_fallbacks;
    st.eager_oversize += eager_.eager_oversize;
    st.real_rows += eager_.real_rows;
    st.padded_rows += eager_.padded_rows;
    return st;
  }
  /// Zeroes the pool's and the runner's counters; graphs stay cached.
  void reset_stats() noexcept {
    pool_.reset_stats();
    eager_ = {};
  }
  [[nodiscard]] const step_function& step() const noexcept { return step_; }

  /// Captures the graphs of every bucket up front (largest first), keys from `make_key(bucket)`.
  /// A failure is handled as in run(): warned, graphs off, and prewarm stops. Returns how many
  /// graphs were captured.
  template <class MakeKey>
  std::size_t prewarm_buckets(stream_type s, MakeKey&& make_key) {
    std::vector<Key> keys;
    keys.reserve(buckets_.count());
    for (const std::size_t b : buckets_.sizes()) keys.push_back(make_key(b));
    return prewarm(keys, s);
  }
  /// Captures the given keys up front (largest first by key_size). See prewarm_buckets().
  std::size_t prewarm(std::span<const Key> keys, stream_type s) {
    if (off_ != off_reason::none) return 0;
    std::size_t captured = 0;
    // One at a time so that a failing key can be disabled and the others still captured.
    for (const Key* k : pool_.prewarm_order(keys)) {
      if (off_ != off_reason::none) break;
      if (key_disabled(*k)) continue;
      try {
        if (pool_.ensure(*k, s, step_)) ++captured;
      } catch (const usage_error&) {
        throw;
      } catch (const std::exception& e) {
        if (pool_.last_failure() == pool_phase::warmup || pool_.last_failure() == pool_phase::none) throw;
        report_failure(*k, e.what());
      } catch (...) {
        if (pool_.last_failure() == pool_phase::warmup || pool_.last_failure() == pool_phase::none) throw;
        report_failure(*k, "an exception not derived from std::exception");
      }
    }
    return captured;
  }

 private:
  enum class off_reason : std::uint8_t { none, kill_switch, option, failure };
  static constexpr std::uint8_t disabled_bit = 0x80;

  step_path on_failure(const Key& key, stream_type s, batch_rows rows, std::string_view what) {
    const pool_phase phase = pool_.last_failure();
    // The step failed when run eagerly (warm-up), or the failure came from outside the graph
    // machinery: falling back would run the same failing code again. Propagate.
    if (phase == pool_phase::warmup || phase == pool_phase::none) throw;
    report_failure(key, what);
    return eager(key, s, rows, step_path::eager_fallback);
  }

  // Warn (once per runner or key, per phase) and turn graphs off for the runner or the key.
  void report_failure(const Key& key, std::string_view what) {
    pool_.backend().clear_error();
    const pool_phase phase = pool_.last_failure();
    const auto bit = static_cast<std::uint8_t>(1u << static_cast<unsigned>(phase));
    bool first = false;
    if (fallback_ == fallback_scope::runner) {
      first = (warned_ & bit) == 0;
      warned_ |= bit;
      off_ = off_reason::failure;
      pool_.clear();  // the graphs are no longer used; retired safely (deferred destroy)
    } else {
      std::uint8_t& state = key_state_[key];
      first = (state & bit) == 0;
      state = static_cast<std::uint8_t>(state | bit | disabled_bit);
      pool_.evict(key);
    }
    if (first) {
      const std::string msg = fmt::format(
          "CUDA graph {} failed for key {}: {}; {} now run eagerly (the step was not lost)",
          to_string(phase), describe_key(key), what,
          fallback_ == fallback_scope::runner ? "all steps of this runner" : "steps with this key");
      if (warn_) warn_(msg); else stderr_warning_sink(msg);
    }
  }

  step_function step_;
  bucket_policy buckets_;
  fallback_scope fallback_;
  oversize_policy oversize_;
  warning_sink warn_;
  pool_type pool_;
  off_reason off_ = off_reason::none;
  std::uint8_t warned_ = 0;                          // phases already warned (runner scope)
  std::unordered_map<Key, std::uint8_t, Hash> key_state_;  // per key: warned phases | disabled
  // Eager runs are counted here, not in the pool: the pool only sees graph work.
  pool_counters eager_{};
};

/// The CUDA step runner.
template <class Key, class Hash = key_hash<Key>>
using step_runner = basic_step_runner<Key, cuda_graph_backend, Hash>;

}  // namespace replay

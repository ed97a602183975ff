// replay/pool_stats.hpp: the settings, outcomes and statistics of a graph pool.
//
// `pool_options` configures a pool (capacity, warm-up runs, capture mode, memory probe);
// `pool_phase` says where a pool operation failed and `step_path` how a step request was served;
// `pool_counters` are the running counters and `pool_stats` a full snapshot with one `key_stats`
// per key, printable with fmt (`fmt::print("{}", pool.stats())`) and as JSON (`to_json()`).
//
// Guarantees: plain value types; thread-safe as values are. The JSON is written without a JSON
// library (the library target depends only on CUDA and fmt).
#pragma once

#include <replay/capture.hpp>
#include <replay/detail/pool_json.hpp>

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace replay {

/// Settings of a graph pool.
struct pool_options {
  static constexpr std::size_t unlimited = std::numeric_limits<std::size_t>::max();
  /// Most graphs resident at once; beyond it the least recently used is evicted. Unlimited by
  /// default (a pure bucketed pool); at least 1.
  std::size_t capacity = unlimited;
  /// Eager runs of the step before it is captured on a miss (warms caches, lazy init, cuBLAS
  /// workspaces). 0 is allowed: the step then runs only as the replay.
  int warmup = 1;
  /// Capture mode (thread-local: capture-unsafe calls of this thread fail and are reported).
  capture_mode mode = capture_mode::thread_local_mode;
  /// Measure device memory around each capture (cudaMemGetInfo, graph memory attribute).
  bool measure_memory = true;
};

/// Where a pool operation failed (last_failure()).
enum class pool_phase : std::uint8_t {
  none,         ///< no failure recorded
  warmup,       ///< an eager warm-up run of the step threw: the step itself fails
  capture,      ///< the step threw under capture, or CUDA invalidated the capture
  instantiate,  ///< instantiating or uploading the captured graph failed
  replay,       ///< launching the graph failed
};

/// How a step request was served.
enum class step_path : std::uint8_t {
  replayed,        ///< a cached graph was replayed (hit)
  captured,        ///< miss: warm-up, capture, then replay
  eager_disabled,  ///< eager: graphs are off (REPLAY_CUDA_GRAPHS=0 or the runner's option)
  eager_fallback,  ///< eager: a capture or replay failed (now or earlier) for this runner or key
  eager_oversize,  ///< eager: the batch is above the largest bucket
};

[[nodiscard]] constexpr std::string_view to_string(pool_phase p) noexcept {
  switch (p) {
    case pool_phase::none: return "none";
    case pool_phase::warmup: return "warm-up";
    case pool_phase::capture: return "capture";
    case pool_phase::instantiate: return "instantiate";
    case pool_phase::replay: return "replay";
  }
  return "unknown";
}
[[nodiscard]] constexpr std::string_view to_string(step_path p) noexcept {
  switch (p) {
    case step_path::replayed: return "replayed";
    case step_path::captured: return "captured";
    case step_path::eager_disabled: return "eager (graphs disabled)";
    case step_path::eager_fallback: return "eager (fallback after a graph failure)";
    case step_path::eager_oversize: return "eager (batch above the largest bucket)";
  }
  return "unknown";
}
/// True for the eager paths.
[[nodiscard]] constexpr bool is_eager(step_path p) noexcept {
  return p != step_path::replayed && p != step_path::captured;
}

/// Rows of one step, for the real-vs-padded statistics: `real` rows asked for, `bucket` rows
/// computed (the padded batch). Leave both 0 when rows do not apply.
struct batch_rows {
  std::size_t real = 0;
  std::size_t bucket = 0;
};

/// What one capture cost. Host times; memory as deltas of device-wide figures (other allocations
/// made meanwhile, also by other processes, show up too).
struct capture_info {
  double capture_ms = 0.0;      ///< begin capture .. end capture (includes the step's host code)
  double instantiate_ms = 0.0;  ///< instantiate + upload
  std::size_t nodes = 0;        ///< nodes in the captured graph
  /// Drop of cudaMemGetInfo's free memory across capture, instantiate and upload. The driver
  /// reserves memory in large chunks (often 2 MiB), so a single graph often shows 0 or one chunk;
  /// averages over many graphs (bench_pool_capture) are meaningful.
  std::int64_t device_bytes = 0;
  /// Change of cudaGraphMemAttrUsedMemCurrent: memory of graph allocation nodes
  /// (cudaMallocAsync inside the capture).
  std::int64_t graph_mem_bytes = 0;
  bool memory_measured = false;  ///< the two figures above were measured
};

/// Counters of a pool, updated on every operation (cheap to read: pool.counters()).
struct pool_counters {
  std::uint64_t hits = 0;              ///< graph replays of a resident graph
  std::uint64_t misses = 0;            ///< lookups that had to capture
  std::uint64_t captures = 0;          ///< successful captures (misses and prewarm)
  std::uint64_t capture_failures = 0;  ///< captures or instantiations that threw
  std::uint64_t replay_failures = 0;   ///< graph launches that threw
  std::uint64_t evictions = 0;         ///< graphs evicted (capacity or explicit)
  std::uint64_t prewarmed = 0;         ///< captures made by prewarm()
  std::uint64_t eager_fallbacks = 0;   ///< eager runs after a graph failure
  std::uint64_t eager_oversize = 0;    ///< eager runs of batches above the largest bucket
  std::uint64_t eager_disabled = 0;    ///< eager runs because graphs are switched off
  std::uint64_t real_rows = 0;         ///< rows asked for (batch_rows::real), all paths
  std::uint64_t padded_rows = 0;       ///< rows computed (bucket; = real for eager runs)
};

/// Statistics of one key (every key the pool has seen, resident or not).
struct key_stats {
  std::string key;                     ///< describe_key(key)
  bool resident = false;               ///< a graph is cached now
  std::uint64_t hits = 0;              ///< replays of the cached graph
  std::uint64_t misses = 0;
  std::uint64_t captures = 0;
  std::uint64_t capture_failures = 0;
  std::uint64_t replay_failures = 0;
  std::uint64_t evictions = 0;
  capture_info last_capture{};         ///< the most recent successful capture
  double total_capture_ms = 0.0;       ///< capture + instantiate, summed over all captures
};

/// A snapshot of a pool's statistics: counters, derived figures and one entry per key.
struct pool_stats : pool_counters {
  std::size_t resident = 0;                 ///< graphs cached now
  std::size_t capacity = pool_options::unlimited;
  std::size_t retired_pending = 0;          ///< evicted graphs waiting for their last replay
  double total_capture_ms = 0.0;            ///< capture + instantiate, all keys
  std::int64_t resident_device_bytes = 0;   ///< device_bytes summed over resident graphs
  std::int64_t resident_graph_mem_bytes = 0;  ///< graph_mem_bytes summed over resident graphs
  std::vector<key_stats> keys;              ///< in the order keys were first seen

  /// Lookups that went to the pool (hits + misses).
  [[nodiscard]] std::uint64_t lookups() const noexcept { return hits + misses; }
  /// hits / (hits + misses), 0 when nothing was looked up.
  [[nodiscard]] double hit_rate() const noexcept {
    return lookups() == 0 ? 0.0 : static_cast<double>(hits) / static_cast<double>(lookups());
  }
  /// All eager runs.
  [[nodiscard]] std::uint64_t eager_runs() const noexcept {
    return eager_fallbacks + eager_oversize + eager_disabled;
  }
  /// Padding rows computed: padded_rows - real_rows.
  [[nodiscard]] std::uint64_t padding_rows() const noexcept {
    return padded_rows >= real_rows ? padded_rows - real_rows : 0;
  }
  /// Share of computed rows that were padding, 0 when no rows were counted.
  [[nodiscard]] double padding_waste() const noexcept {
    return padded_rows == 0 ? 0.0 : static_cast<double>(padding_rows()) / static_cast<double>(padded_rows);
  }

  /// The statistics as one JSON object (keys as strings, times in ms, memory in bytes).
  [[nodiscard]] std::string to_json() const {
    using detail::json_number;
    using detail::json_string;
    std::string out = fmt::format(
        "{{\"hits\":{},\"misses\":{},\"lookups\":{},\"hit_rate\":{},\"captures\":{},"
        "\"capture_failures\":{},\"replay_failures\":{},\"evictions\":{},\"prewarmed\":{},"
        "\"eager_runs\":{},\"eager_fallbacks\":{},\"eager_oversize\":{},\"eager_disabled\":{},"
        "\"real_rows\":{},\"padded_rows\":{},\"padding_waste\":{},\"resident\":{},\"capacity\":{},"
        "\"retired_pending\":{},\"total_capture_ms\":{},\"resident_device_bytes\":{},"
        "\"resident_graph_mem_bytes\":{},\"keys\":[",
        hits, misses, lookups(), json_number(hit_rate()), captures, capture_failures, replay_failures,
        evictions, prewarmed, eager_runs(), eager_fallbacks, eager_oversize, eager_disabled, real_rows,
        padded_rows, json_number(padding_waste()), resident,
        capacity == pool_options::unlimited ? std::string("null") : fmt::format("{}", capacity),
        retired_pending, json_number(total_capture_ms), resident_device_bytes,
        resident_graph_mem_bytes);
    for (std::size_t i = 0; i < keys.size(); ++i) {
      const key_stats& k = keys[i];
      out += fmt::format(
          "{}{{\"key\":{},\"resident\":{},\"hits\":{},\"misses\":{},\"captures\":{},"
          "\"capture_failures\":{},\"replay_failures\":{},\"evictions\":{},\"capture_ms\":{},"
          "\"instantiate_ms\":{},\"total_capture_ms\":{},\"nodes\":{},\"device_bytes\":{},"
          "\"graph_mem_bytes\":{},\"memory_measured\":{}}}",
          i == 0 ? "" : ",", json_string(k.key), k.resident, k.hits, k.misses, k.captures,
          k.capture_failures, k.replay_failures, k.evictions, json_number(k.last_capture.capture_ms),
          json_number(k.last_capture.instantiate_ms), json_number(k.total_capture_ms),
          k.last_capture.nodes, k.last_capture.device_bytes, k.last_capture.graph_mem_bytes,
          k.last_capture.memory_measured);
    }
    out += "]}";
    return out;
  }
};

namespace detail {

/// Adds one step's rows to `c`: `real` rows asked for, `bucket` rows computed (= real when 0).
constexpr void add_rows(pool_counters& c, const batch_rows& rows) noexcept {
  c.real_rows += rows.real;
  c.padded_rows += rows.bucket != 0 ? rows.bucket : rows.real;
}

/// "1.5 MiB" style byte counts for the human-readable statistics.
inline std::string format_bytes(std::int64_t bytes) {
  const double b = static_cast<double>(bytes < 0 ? -bytes : bytes);
  const char* sign = bytes < 0 ? "-" : "";
  if (b < 1024.0) return fmt::format("{}{} B", sign, static_cast<std::int64_t>(b));
  if (b < 1024.0 * 1024.0) return fmt::format("{}{:.1f} KiB", sign, b / 1024.0);
  if (b < 1024.0 * 1024.0 * 1024.0) return fmt::format("{}{:.1f} MiB", sign, b / (1024.0 * 1024.0));
  return fmt::format("{}{:.2f} GiB", sign, b / (1024.0 * 1024.0 * 1024.0));
}

}  // namespace detail
}  // namespace replay

/// The human-readable statistics: a summary and one line per key.
template <>
struct fmt::formatter<replay::pool_stats> {
  constexpr auto parse(fmt::format_parse_context& ctx) { return ctx.begin(); }
  template <class Ctx>
  auto format(const replay::pool_stats& s, Ctx& ctx) const {
    using replay::detail::format_bytes;
    auto out = ctx.out();
    const std::string cap = s.capacity == replay::pool_options::unlimited
                                ? std::string("unlimited")
                                : fmt::format("{}", s.capacity);
    out = fmt::format_to(out,
                         "graph pool: {} resident (capacity {}), hit rate {:.1f}% ({} hits, {} misses), "
                         "{} captures ({} failed, {} prewarmed), {} evictions ({} pending destroy), "
                         "{} replay failures\n",
                         s.resident, cap, 100.0 * s.hit_rate(), s.hits, s.misses, s.captures,
                         s.capture_failures, s.prewarmed, s.evictions, s.retired_pending,
                         s.replay_failures);
    out = fmt::format_to(out,
                         "  eager runs {} (fallback {}, oversize {}, disabled {}); rows: {} real, {} "
                         "computed, padding {:.1f}%\n",
                         s.eager_runs(), s.eager_fallbacks, s.eager_oversize, s.eager_disabled,
                         s.real_rows, s.padded_rows, 100.0 * s.padding_waste());
    out = fmt::format_to(out, "  capture time {:.2f} ms total; resident graph memory {} device, {} graph pool\n",
                         s.total_capture_ms, format_bytes(s.resident_device_bytes),
                         format_bytes(s.resident_graph_mem_bytes));
    if (!s.keys.empty())
      out = fmt::format_to(out, "  {:<32} {:>3} {:>9} {:>7} {:>8} {:>6} {:>10} {:>8} {:>6} {:>11} {:>10}\n",
                           "key", "res", "hits", "misses", "captures", "evict", "capture ms",
                           "inst ms", "nodes", "device", "graph mem");
    for (const replay::key_stats& k : s.keys) {
      out = fmt::format_to(out, "  {:<32} {:>3} {:>9} {:>7} {:>8} {:>6} {:>10.3f} {:>8.3f} {:>6} {:>11} {:>10}\n",
                           k.key, k.resident ? "yes" : "no", k.hits, k.misses, k.captures, k.evictions,
                           k.last_capture.capture_ms, k.last_capture.instantiate_ms, k.last_capture.nodes,
                           k.last_capture.memory_measured ? format_bytes(k.last_capture.device_bytes) : "-",
                           k.last_capture.memory_measured ? format_bytes(k.last_capture.graph_mem_bytes) : "-");
    }
    return out;
  }
};

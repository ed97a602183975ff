// replay/graph_pool.hpp: a keyed cache of executable graphs with LRU eviction and statistics.
//
// One decode step needs a different graph for every combination of the things that change the
// captured work: bucket (padded batch size), dtype, the shapes of the step metadata, any user
// setting. `graph_pool<Key>` maps such a key to a `graph_exec`:
//
// - `run(key, stream, step)`: on a hit, replays the cached graph. On a miss, runs `step` eagerly
//   `warmup` times, captures it, instantiates and uploads the graph, then replays it.
// - `prewarm(keys, stream, step)`: captures keys up front, largest first (see key_size), so a step
//   whose work buffers grow on first use sizes them once, for the largest bucket, before any graph
//   captures their addresses; every smaller bucket then uses a prefix of the same buffers.
// - capacity with least-recently-used eviction (unlimited by default, as for a pure bucketed pool).
// - `stats()`: hits, misses, captures, evictions, eager runs, real vs padded rows, hit rate,
//   capture time and graph memory per key; printable with fmt and as JSON (`to_json()`).
//
// The key: any copyable type with `operator==` and a hash, either a `hash()` member returning
// std::size_t or a `std::hash<Key>` specialisation. It must include *everything* that changes the
// captured graph: two keys that compare equal share one graph. `replay::graph_key` is a ready-made
// key (bucket, dtype tag, four user fields). Keys that fmt can format are printed as such in the
// statistics; others are printed as their hash.
//
// The step: a callable `step(stream, key)` (or `step(stream)`) that issues the decode step's work
// to the stream. It is called eagerly (warm-up) and under capture, so it must be capture-safe (no
// allocation, synchronisation or host reads; per-step values read through step_meta), and it must
// be safe to run more than once with the same inputs: on a miss the request's step runs `warmup`
// times eagerly and once more as the replay. Use `warmup = 0` for a step that is not (for
// instance one that accumulates in place); then a miss runs it exactly once, as the replay.
//
// Eviction and in-flight replays (cuda_graph_backend): an evicted exec may still be running on the
// stream of its last replay. The backend records an event on that stream and destroys the exec
// only once the event has completed: retired execs are polled (cudaEventQuery, never blocking) on
// every miss, prewarm, explicit collect(), and waited for when the pool is destroyed. The hit path
// never polls. (CUDA's driver documents that destroying an in-flight exec frees it asynchronously
// on completion; deferring the destroy ourselves does not rely on that, keeps the memory
// statistics honest, and keeps the stream running without a synchronisation.)
//
// The logic is a template over a backend (`basic_graph_pool<Key, Backend>`): cuda_graph_backend
// does the CUDA work; host tests drive the same logic with a fake backend, no GPU needed.
//
// Guarantees: the hit path is O(1) (one hash lookup, pointer moves in an intrusive LRU list) and
// allocation-free; a miss evicts before it captures, so the pool never holds more than `capacity`
// graphs. When warm-up, capture, instantiation or replay throws, the exception propagates
// unchanged, the pool stays consistent (the failed key is not resident), `last_failure()` says in
// which phase, and the stream is left usable (capture_scope discards a failed capture; CUDA's
// last-error slot is cleared). step_runner (runner.hpp) turns such failures into an eager fallback.
// Not thread-safe: one thread drives a pool. Move-constructible, not copyable or assignable.
//
// Example:
//   replay::graph_pool<replay::graph_key> pool({.capacity = 32});
//   auto step = [&](replay::stream_ref s, const replay::graph_key& k) { decode(s, k.bucket); };
//   const std::size_t b = *buckets.pad(n);
//   meta.push(s);                                           // per-step values (rows 0..b)
//   pool.run(replay::graph_key{.bucket = b}, s, step, {.real = n, .bucket = b});
//   fmt::print("{}\n", pool.stats());
#pragma once

#include <replay/capture.hpp>
#include <replay/detail/pool_json.hpp>
#include <replay/detail/pool_lru.hpp>
#include <replay/error.hpp>
#include <replay/event.hpp>
#include <replay/graph.hpp>
#include <replay/graph_exec.hpp>
#include <replay/stream.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace replay {

// ------------------------------------------------------------------------------------------------
// Keys and hashing
// ------------------------------------------------------------------------------------------------

/// Mixes `v` into `seed` (64-bit finaliser of splitmix64; good avalanche for small integers).
[[nodiscard]] constexpr std::size_t hash_mix(std::size_t seed, std::uint64_t v) noexcept {
  std::uint64_t x = static_cast<std::uint64_t>(seed) ^ (v + 0x9e3779b97f4a7c15ULL + (seed << 6) + (seed >> 2));
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return static_cast<std::size_t>(x);
}

/// Combined hash of several values, each hashed with std::hash (for writing a key's hash()).
template <class... T>
[[nodiscard]] std::size_t hash_values(const T&... values) noexcept {
  std::size_t seed = 0x51ed2701u;
  ((seed = hash_mix(seed, static_cast<std::uint64_t>(std::hash<T>{}(values)))), ...);
  return seed;
}

/// A key type with a `hash()` member.
template <class K>
concept has_hash_member = requires(const K& k) {
  { k.hash() } -> std::convertible_to<std::size_t>;
};
/// A key type with a std::hash specialisation.
template <class K>
concept has_std_hash = requires(const K& k) {
  { std::hash<K>{}(k) } -> std::convertible_to<std::size_t>;
};
/// What a graph pool key must be: copyable, equality-comparable and hashable (member or std::hash).
template <class K>
concept graph_pool_key =
    std::copy_constructible<K> && std::equality_comparable<K> && (has_hash_member<K> || has_std_hash<K>);

/// The pool's default hasher: `key.hash()` when the key has one, else `std::hash<Key>`.
template <class K>
struct key_hash {
  [[nodiscard]] std::size_t operator()(const K& k) const noexcept {
    if constexpr (has_hash_member<K>)
      return static_cast<std::size_t>(k.hash());
    else
      return std::hash<K>{}(k);
  }
};

/// A ready-made key: bucket, a dtype tag and up to four user fields (metadata shapes, settings).
/// Unused fields stay 0. Everything that changes the captured graph must be in the key.
///
///   replay::graph_key{.bucket = 16, .dtype = 2, .fields = {max_blocks_per_seq, use_top_k}}
struct graph_key {
  std::uint32_t bucket = 0;              ///< padded batch size: rows the graph computes
  std::uint32_t dtype = 0;               ///< data-type tag (cast of a user enum; 0 = default)
  std::array<std::int64_t, 4> fields{};  ///< other graph-changing values (shapes, settings)

  friend constexpr bool operator==(const graph_key&, const graph_key&) noexcept = default;
  /// Hash of all members: each one multiplied by its own odd constant and rotated by its own
  /// amount (independent, so the CPU does them in parallel), then one 64-bit finaliser. About a
  /// quarter of the cost of chaining hash_mix per member on the pool's hit path. (A collision
  /// never selects a wrong graph: the pool compares keys with operator==.)
  [[nodiscard]] constexpr std::size_t hash() const noexcept {
    const auto rotl = [](std::uint64_t x, int r) { return (x << r) | (x >> (64 - r)); };
    std::uint64_t h = ((static_cast<std::uint64_t>(bucket) << 32) | dtype) * 0x9e3779b97f4a7c15ULL;
    h ^= rotl(static_cast<std::uint64_t>(fields[0]) * 0xc2b2ae3d27d4eb4fULL, 13);
    h ^= rotl(static_cast<std::uint64_t>(fields[1]) * 0x165667b19e3779f9ULL, 29);
    h ^= rotl(static_cast<std::uint64_t>(fields[2]) * 0xd6e8feb86659fd93ULL, 41);
    h ^= rotl(static_cast<std::uint64_t>(fields[3]) * 0x9fb21c651e98df25ULL, 53);
    h ^= h >> 32;
    h *= 0xd6e8feb86659fd93ULL;
    h ^= h >> 32;
    return static_cast<std::size_t>(h);
  }
};

/// How a key is named in statistics: fmt's formatting when the key is formattable, else its hash.
template <class K>
[[nodiscard]] std::string describe_key(const K& k) {
  if constexpr (fmt::is_formattable<K>::value)
    return fmt::format("{}", k);
  else
    return fmt::format("key#{:016x}", static_cast<std::uint64_t>(key_hash<K>{}(k)));
}

/// The size a key is sorted by in prewarm() (largest first): `key.bucket` when the key has such a
/// member, the key itself when it converts to std::size_t, else 0 (order kept).
struct key_size {
  template <class K>
  [[nodiscard]] std::size_t operator()(const K& k) const noexcept {
    if constexpr (requires { static_cast<std::size_t>(k.bucket); })
      return static_cast<std::size_t>(k.bucket);
    else if constexpr (std::is_convertible_v<K, std::size_t>)
      return static_cast<std::size_t>(k);
    else
      return 0;
  }
};

// ------------------------------------------------------------------------------------------------
// Options, outcomes, statistics
// ------------------------------------------------------------------------------------------------

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

/// Calls `step(s, key)` or, for a step that takes only the stream, `step(s)`.
template <class Step, class S, class K>
void call_step(Step& step, S s, const K& key) {
  if constexpr (std::is_invocable_v<Step&, S, const K&>)
    step(s, key);
  else
    step(s);
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

}  // namespace detail

// ------------------------------------------------------------------------------------------------
// The CUDA backend
// ------------------------------------------------------------------------------------------------

/// The pool's CUDA backend: captures with capture_scope, instantiates with upload, launches with
/// cudaGraphLaunch, and retires evicted execs once their last replay has completed (an event
/// recorded on the stream of that replay; see the header comment). Move-only.
class cuda_graph_backend {
 public:
  using exec_type = graph_exec;
  using stream_type = stream_ref;

  cuda_graph_backend() = default;
  cuda_graph_backend(cuda_graph_backend&&) noexcept = default;
  cuda_graph_backend& operator=(cuda_graph_backend&& o) noexcept {
    if (this != &o) {
      drain();
      retired_ = std::move(o.retired_);
    }
    return *this;
  }
  cuda_graph_backend(const cuda_graph_backend&) = delete;
  cuda_graph_backend& operator=(const cuda_graph_backend&) = delete;
  /// Waits for every retired exec's last replay, then destroys it.
  ~cuda_graph_backend() { drain(); }

  /// Captures `step` on `s`, instantiates and uploads it into `out`. Updates `phase` as it goes
  /// (capture, then instantiate) so a failure can be attributed. Throws what the step or CUDA
  /// throws; a failed capture is discarded by capture_scope and leaves `s` usable.
  template <class Step, class Key>
  capture_info capture(Step& step, const Key& key, stream_ref s, const pool_options& options,
                       pool_phase& phase, graph_exec& out) {
    using clock = std::chrono::steady_clock;
    capture_info info;
    const detail::memory_probe before =
        options.measure_memory ? detail::memory_probe::take() : detail::memory_probe{};
    phase = pool_phase::capture;
    const auto t0 = clock::now();
    graph g;
    {
      capture_scope scope(s, options.mode);
      detail::call_step(step, s, key);
      g = scope.finish();
    }
    const auto t1 = clock::now();
    phase = pool_phase::instantiate;
    out = g.instantiate({.upload_stream = s.get()});
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

  /// Replays `e` on `s` (one cudaGraphLaunch).
  void launch(const graph_exec& e, stream_ref s) const { e.launch(s); }

  /// Takes an evicted exec. `last` is the stream of its last launch or upload (null when it never
  /// ran): the exec is destroyed once the work issued there so far has completed. Never throws:
  /// if the event cannot be recorded (e.g. the stream was destroyed), waits for the device instead.
  void retire(graph_exec&& e, const stream_ref* last) noexcept {
    if (!e) return;
    if (last == nullptr) {
      e.reset();
      return;
    }
    try {
      event done;
      done.record(*last);
      retired_.push_back(retired{std::move(e), std::move(done)});
    } catch (...) {
      (void)cudaGetLastError();
      (void)cudaDeviceSynchronize();
      (void)cudaGetLastError();
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
};

// ------------------------------------------------------------------------------------------------
// The pool
// ------------------------------------------------------------------------------------------------

/// A cache of executable graphs keyed by `Key`, over a backend (CUDA or, in host tests, a fake).
///
/// Backend requirements: `exec_type` (default-constructible, movable, explicit bool), `stream_type`
/// (copyable), `capture(step, key, stream, options, phase&, exec&) -> capture_info`,
/// `launch(const exec_type&, stream)`, `retire(exec_type&&, const stream_type* last) noexcept`,
/// `collect() noexcept`, `retired_pending()`, `clear_error() noexcept`.
template <class Key, class Backend = cuda_graph_backend, class Hash = key_hash<Key>>
  requires std::copy_constructible<Key> && std::equality_comparable<Key>
class basic_graph_pool {
 public:
  using key_type = Key;
  using backend_type = Backend;
  using exec_type = typename Backend::exec_type;
  using stream_type = typename Backend::stream_type;

  explicit basic_graph_pool(pool_options options = {}, Backend backend = Backend{})
      : backend_(std::move(backend)), options_(options) {
    if (options_.capacity == 0)
      throw usage_error("replay::graph_pool: capacity 0 holds no graph; use pool_options::unlimited "
                        "or at least 1");
    if (options_.warmup < 0)
      throw usage_error(fmt::format("replay::graph_pool: warmup {} is negative", options_.warmup));
  }

  basic_graph_pool(basic_graph_pool&& o) noexcept
      : backend_(std::move(o.backend_)),
        options_(o.options_),
        slots_(std::move(o.slots_)),
        order_(std::move(o.order_)),
        lru_(std::move(o.lru_)),
        counters_(o.counters_),
        last_failure_(o.last_failure_) {
    o.slots_.clear();
    o.order_.clear();
  }
  basic_graph_pool(const basic_graph_pool&) = delete;
  basic_graph_pool& operator=(const basic_graph_pool&) = delete;
  basic_graph_pool& operator=(basic_graph_pool&&) = delete;

  /// Retires every resident graph (destroyed once its last replay completes; the backend waits).
  ~basic_graph_pool() { clear_noexcept(); }

  /// Replays the graph for `key` on `s`, capturing it first on a miss (warm-up, capture,
  /// instantiate + upload, then replay). `rows` feeds the real-vs-padded statistics.
  /// Returns step_path::replayed (hit) or step_path::captured (miss).
  template <class Step>
  step_path run(const Key& key, stream_type s, Step&& step, batch_rows rows = {}) {
    const auto it = slots_.find(key);
    if (it != slots_.end() && it->second.resident) [[likely]] {
      slot& sl = it->second;
      lru_.touch(&sl);
      ++sl.hits;
      ++counters_.hits;
      count_rows(rows);
      launch(sl, s);
      return step_path::replayed;
    }
    return miss(key, s, step, rows);
  }

  /// Captures `key` if it is not resident (warm-up, capture, instantiate + upload; no replay),
  /// counted as prewarmed. Returns true when it captured. Evicts the least recently used graph if
  /// the pool is full.
  template <class Step>
  bool ensure(const Key& key, stream_type s, Step&& step) {
    slot& sl = slot_for(key);
    if (sl.resident) return false;
    last_failure_ = pool_phase::none;
    install(sl, s, step);
    ++counters_.prewarmed;
    return true;
  }

  /// Captures the given keys up front, largest first by `size` (default key_size: `key.bucket`),
  /// so buffers a step sizes on first use are sized for the largest bucket before any capture.
  /// Keys already resident and duplicates are skipped. Returns how many graphs were captured.
  /// Throws usage_error (before capturing anything) when the keys would not fit in the capacity.
  template <class Step, class SizeFn = key_size>
  std::size_t prewarm(std::span<const Key> keys, stream_type s, Step&& step, SizeFn size = {}) {
    std::vector<const Key*> todo;
    std::unordered_set<Key, Hash> seen;
    for (const Key& k : keys) {
      if (contains(k) || !seen.insert(k).second) continue;
      todo.push_back(&k);
    }
    if (options_.capacity != pool_options::unlimited && lru_.size() + todo.size() > options_.capacity)
      throw usage_error(fmt::format("replay::graph_pool::prewarm: {} new graphs and {} resident "
                                    "exceed the capacity of {}", todo.size(), lru_.size(),
                                    options_.capacity));
    std::stable_sort(todo.begin(), todo.end(),
                     [&](const Key* a, const Key* b) { return size(*a) > size(*b); });
    for (const Key* k : todo) {
      slot& sl = slot_for(*k);
      last_failure_ = pool_phase::none;
      install(sl, s, step);
      ++counters_.prewarmed;
    }
    return todo.size();
  }
  template <class Step, class SizeFn = key_size>
  std::size_t prewarm(std::initializer_list<Key> keys, stream_type s, Step&& step, SizeFn size = {}) {
    return prewarm(std::span<const Key>(keys.begin(), keys.size()), s, std::forward<Step>(step), size);
  }

  /// Evicts `key` now (its exec is destroyed once its last replay completes). Returns whether it
  /// was resident.
  bool evict(const Key& key) noexcept {
    const auto it = slots_.find(key);
    if (it == slots_.end() || !it->second.resident) return false;
    evict_slot(it->second);
    return true;
  }

  /// Evicts every resident graph.
  void clear() noexcept { clear_noexcept(); }

  /// Destroys evicted graphs whose last replay has completed (never blocks).
  void collect() noexcept { backend_.collect(); }

  /// True when a graph for `key` is cached.
  [[nodiscard]] bool contains(const Key& key) const {
    const auto it = slots_.find(key);
    return it != slots_.end() && it->second.resident;
  }
  /// The cached exec for `key` or nullptr (does not count as a use).
  [[nodiscard]] const exec_type* find(const Key& key) const {
    const auto it = slots_.find(key);
    return (it != slots_.end() && it->second.resident) ? &it->second.exec : nullptr;
  }
  /// Graphs cached now.
  [[nodiscard]] std::size_t size() const noexcept { return lru_.size(); }
  [[nodiscard]] std::size_t capacity() const noexcept { return options_.capacity; }
  [[nodiscard]] const pool_options& options() const noexcept { return options_; }

  /// Resident keys, most recently used first (the last one is evicted next).
  [[nodiscard]] std::vector<Key> lru_order() const {
    std::vector<Key> out;
    out.reserve(lru_.size());
    for (const detail::lru_hook* h = lru_.front(); h != nullptr; h = h->next)
      out.push_back(*static_cast<const slot*>(h)->key);
    return out;
  }

  /// The running counters (no allocation).
  [[nodiscard]] const pool_counters& counters() const noexcept { return counters_; }

  /// A full snapshot: counters, derived figures and per-key statistics.
  [[nodiscard]] pool_stats stats() const {
    pool_stats st;
    static_cast<pool_counters&>(st) = counters_;
    st.resident = lru_.size();
    st.capacity = options_.capacity;
    st.retired_pending = backend_.retired_pending();
    st.keys.reserve(order_.size());
    for (const slot* sl : order_) {
      key_stats k;
      k.key = describe_key(*sl->key);
      k.resident = sl->resident;
      k.hits = sl->hits;
      k.misses = sl->misses;
      k.captures = sl->captures;
      k.capture_failures = sl->capture_failures;
      k.replay_failures = sl->replay_failures;
      k.evictions = sl->evictions;
      k.last_capture = sl->last_capture;
      k.total_capture_ms = sl->total_capture_ms;
      st.total_capture_ms += sl->total_capture_ms;
      if (sl->resident) {
        st.resident_device_bytes += sl->last_capture.device_bytes;
        st.resident_graph_mem_bytes += sl->last_capture.graph_mem_bytes;
      }
      st.keys.push_back(std::move(k));
    }
    return st;
  }

  /// Zeroes all counters (pool-wide and per key); graphs stay cached.
  void reset_stats() noexcept {
    counters_ = {};
    for (slot* sl : order_) {
      sl->hits = sl->misses = sl->captures = sl->capture_failures = sl->replay_failures = 0;
      sl->evictions = 0;
      sl->total_capture_ms = 0.0;
    }
  }

  /// Counts an eager run made outside the pool (step_runner's fallbacks, oversize batches, graphs
  /// disabled). `why` must be one of the eager paths.
  void note_eager(step_path why, batch_rows rows = {}) noexcept {
    switch (why) {
      case step_path::eager_disabled: ++counters_.eager_disabled; break;
      case step_path::eager_fallback: ++counters_.eager_fallbacks; break;
      case step_path::eager_oversize: ++counters_.eager_oversize; break;
      default: return;
    }
    count_rows(rows);
  }

  /// The phase of the most recent failure of run/ensure/prewarm (none if the last one succeeded).
  [[nodiscard]] pool_phase last_failure() const noexcept { return last_failure_; }

  [[nodiscard]] Backend& backend() noexcept { return backend_; }
  [[nodiscard]] const Backend& backend() const noexcept { return backend_; }

 private:
  struct slot : detail::lru_hook {
    const Key* key = nullptr;  // the map's key (stable)
    exec_type exec{};
    bool resident = false;
    std::optional<stream_type> last_stream{};  // stream of the last launch or upload
    std::uint64_t hits = 0, misses = 0, captures = 0, capture_failures = 0, replay_failures = 0,
                  evictions = 0;
    capture_info last_capture{};
    double total_capture_ms = 0.0;
  };

  slot& slot_for(const Key& key) {
    auto [it, inserted] = slots_.try_emplace(key);
    if (inserted) {
      it->second.key = &it->first;
      try {
        order_.push_back(&it->second);
      } catch (...) {
        slots_.erase(it);
        throw;
      }
    }
    return it->second;
  }

  void count_rows(const batch_rows& rows) noexcept {
    counters_.real_rows += rows.real;
    counters_.padded_rows += rows.bucket != 0 ? rows.bucket : rows.real;
  }

  void launch(slot& sl, stream_type s) {
    try {
      backend_.launch(sl.exec, s);
    } catch (...) {
      ++counters_.replay_failures;
      ++sl.replay_failures;
      last_failure_ = pool_phase::replay;
      backend_.clear_error();
      throw;
    }
    sl.last_stream = s;
  }

  template <class Step>
  step_path miss(const Key& key, stream_type s, Step& step, batch_rows rows) {
    last_failure_ = pool_phase::none;
    ++counters_.misses;
    slot& sl = slot_for(key);
    ++sl.misses;
    install(sl, s, step);
    count_rows(rows);
    launch(sl, s);
    return step_path::captured;
  }

  // Warm-up, make room, capture + instantiate + upload, then make `sl` resident and most recent.
  template <class Step>
  void install(slot& sl, stream_type s, Step& step) {
    backend_.collect();
    pool_phase phase = pool_phase::warmup;
    try {
      for (int i = 0; i < options_.warmup; ++i) detail::call_step(step, s, *sl.key);
      make_room();
      exec_type exec{};
      const capture_info info = backend_.capture(step, *sl.key, s, options_, phase, exec);
      sl.exec = std::move(exec);
      sl.resident = true;
      sl.last_stream = s;  // the upload ran there
      lru_.push_front(&sl);
      ++counters_.captures;
      ++sl.captures;
      sl.last_capture = info;
      sl.total_capture_ms += info.capture_ms + info.instantiate_ms;
    } catch (...) {
      last_failure_ = phase;
      if (phase != pool_phase::warmup) {
        ++counters_.capture_failures;
        ++sl.capture_failures;
      }
      backend_.clear_error();
      throw;
    }
  }

  void make_room() noexcept {
    while (options_.capacity != pool_options::unlimited && lru_.size() >= options_.capacity)
      evict_slot(*static_cast<slot*>(lru_.back()));
  }

  void evict_slot(slot& sl) noexcept {
    lru_.erase(&sl);
    sl.resident = false;
    ++sl.evictions;
    ++counters_.evictions;
    backend_.retire(std::move(sl.exec), sl.last_stream ? &*sl.last_stream : nullptr);
    sl.exec = exec_type{};
  }

  void clear_noexcept() noexcept {
    while (!lru_.empty()) evict_slot(*static_cast<slot*>(lru_.back()));
  }

  Backend backend_;  // declared first: destroyed last, after every exec was handed to it
  pool_options options_;
  std::unordered_map<Key, slot, Hash> slots_;
  std::vector<slot*> order_;  // slots in first-seen order (for stats)
  detail::intrusive_lru lru_;
  pool_counters counters_{};
  pool_phase last_failure_ = pool_phase::none;
};

/// The CUDA graph pool.
template <class Key, class Hash = key_hash<Key>>
using graph_pool = basic_graph_pool<Key, cuda_graph_backend, Hash>;

}  // namespace replay

/// std::hash for graph_key (the pool uses graph_key::hash() directly; this is for users' own maps).
template <>
struct std::hash<replay::graph_key> {
  std::size_t operator()(const replay::graph_key& k) const noexcept { return k.hash(); }
};

/// graph_key prints as "bucket 8, dtype 1, fields [128, 4]" (trailing zero fields omitted).
template <>
struct fmt::formatter<replay::graph_key> : fmt::formatter<std::string_view> {
  template <class Ctx>
  auto format(const replay::graph_key& k, Ctx& ctx) const {
    std::string s = fmt::format("bucket {}", k.bucket);
    if (k.dtype != 0) s += fmt::format(", dtype {}", k.dtype);
    std::size_t used = k.fields.size();
    while (used > 0 && k.fields[used - 1] == 0) --used;
    if (used > 0) {
      s += ", fields [";
      for (std::size_t i = 0; i < used; ++i) s += fmt::format("{}{}", i ? ", " : "", k.fields[i]);
      s += "]";
    }
    return fmt::formatter<std::string_view>::format(std::string_view(s), ctx);
  }
};

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

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
// The key: a `graph_pool_key` (graph_key.hpp): copyable, `operator==`, a hash. It must include
// *everything* that changes the captured graph: two keys that compare equal share one graph. A key
// that does not compare equal to itself (a NaN field) is refused with usage_error.
//
// The step: a callable `step(stream, key)` (or `step(stream)`) that issues the decode step's work
// to the stream. It is called eagerly (warm-up) and under capture, so it must be capture-safe (no
// allocation, synchronisation or host reads; per-step values read through step_meta), and it must
// be safe to run more than once with the same inputs: on a miss the request's step runs `warmup`
// times eagerly and once more as the replay. Use `warmup = 0` for a step that is not (for
// instance one that accumulates in place); then a miss runs it exactly once, as the replay. The
// warm-up runs inside a `warmup_scope` (capture.hpp): while_loop() and token_loop skip their loop
// there, and a step can ask `replay::warming_up()` to skip other work that must run once.
//
// Statistics: a replay counts as a hit, and its rows as served, only once its launch succeeded; a
// replay that fails is counted as a replay failure (the runner then counts its eager run).
//
// Eviction and in-flight replays: an evicted exec may still be running. Every replay records a
// completion event, and the backend destroys an evicted exec only once that event has completed
// (cuda_graph_backend.hpp). The stream of the last replay may be destroyed meanwhile.
//
// Headers: keys in graph_key.hpp, options and statistics in pool_stats.hpp, the CUDA backend in
// cuda_graph_backend.hpp. The logic is a template over a backend (`basic_graph_pool<Key,
// Backend>`); host tests drive the same logic with a fake backend, no GPU needed. Eager runs made
// outside the pool (fallbacks, oversize batches) are counted by step_runner (runner.hpp).
//
// Device: a pool belongs to the device current when it was made; using it while another device is
// current throws usage_error.
//
// Guarantees: the hit path is O(1) (one hash lookup, pointer moves in an intrusive LRU list) and
// allocation-free; a miss evicts before it captures, so the pool never holds more than `capacity`
// graphs. When warm-up, capture, instantiation or replay throws, the exception propagates
// unchanged, the pool stays consistent (the failed key is not resident), `last_failure()` says in
// which phase, and the stream is left usable (capture_scope discards a failed capture; CUDA's
// last-error slot is cleared). step_runner (runner.hpp) turns such failures into an eager fallback.
// A step must not use its own pool (run, ensure or prewarm from inside the warm-up or capture
// throws usage_error), and a pool cannot be moved while it runs a step. Not thread-safe: one
// thread drives a pool. Move-constructible, not copyable or assignable.
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
#include <replay/cuda_graph_backend.hpp>
#include <replay/detail/pool_lru.hpp>
#include <replay/error.hpp>
#include <replay/graph_key.hpp>
#include <replay/nvtx.hpp>
#include <replay/pool_stats.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace replay {

/// A cache of executable graphs keyed by `Key`, over a backend (CUDA or, in host tests, a fake).
///
/// Backend requirements: `exec_type` (default-constructible, movable, explicit bool), `stream_type`
/// (copyable), `fence_type` (default-constructible, movable: marks a graph's last use),
/// `capture(step, key, stream, options, phase&, exec&, fence&) -> capture_info`,
/// `launch(const exec_type&, fence_type&, stream)`, `retire(exec_type&&, fence_type&&) noexcept`,
/// `collect() noexcept`, `retired_pending()`, `clear_error() noexcept`; optionally
/// `require_device(const char*)`, called before a miss's warm-up.
template <graph_pool_key Key, class Backend = cuda_graph_backend, class Hash = key_hash<Key>>
class basic_graph_pool {
 public:
  using key_type = Key;
  using backend_type = Backend;
  using exec_type = typename Backend::exec_type;
  using stream_type = typename Backend::stream_type;
  using fence_type = typename Backend::fence_type;

  explicit basic_graph_pool(pool_options options = {}, Backend backend = Backend{})
      : backend_(std::move(backend)), options_(options) {
    if (options_.capacity == 0)
      throw usage_error("replay::graph_pool: capacity 0 holds no graph; use pool_options::unlimited "
                        "or at least 1");
    if (options_.warmup < 0)
      throw usage_error(fmt::format("replay::graph_pool: warmup {} is negative", options_.warmup));
  }

  /// Moves the pool. Throws usage_error when `o` is running a step (moving a pool from inside its
  /// own capture or warm-up).
  basic_graph_pool(basic_graph_pool&& o)
      : backend_((o.require_idle("move"), std::move(o.backend_))),
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
    if (busy_) [[unlikely]] reentered("run");
    const auto it = slots_.find(key);
    if (it != slots_.end() && it->second.resident) [[likely]] {
      slot& sl = it->second;
      lru_.touch(&sl);
      launch(sl, s);  // counted once it launched: a failed replay is no hit and serves no rows
      ++sl.hits;
      ++counters_.hits;
      detail::add_rows(counters_, rows);
      return step_path::replayed;
    }
    return miss(key, s, step, rows);
  }

  /// Captures `key` if it is not resident (warm-up, capture, instantiate + upload; no replay),
  /// counted as prewarmed. Returns true when it captured. Evicts the least recently used graph if
  /// the pool is full.
  template <class Step>
  bool ensure(const Key& key, stream_type s, Step&& step) {
    require_idle("ensure");
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
    require_idle("prewarm");
    const std::vector<const Key*> todo = prewarm_order(keys, size);
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

  /// The keys prewarm() would capture, in its order: resident keys and duplicates dropped, largest
  /// first by `size`. Throws usage_error when they would not fit in the capacity.
  template <class SizeFn = key_size>
  [[nodiscard]] std::vector<const Key*> prewarm_order(std::span<const Key> keys, SizeFn size = {}) const {
    std::vector<const Key*> todo;
    std::unordered_set<Key, Hash> seen;
    for (const Key& k : keys)
      if (!contains(k) && seen.insert(k).second) todo.push_back(&k);
    if (options_.capacity != pool_options::unlimited && lru_.size() + todo.size() > options_.capacity)
      throw usage_error(fmt::format("replay::graph_pool::prewarm: {} new graphs and {} resident "
                                    "exceed the capacity of {}", todo.size(), lru_.size(),
                                    options_.capacity));
    std::stable_sort(todo.begin(), todo.end(),
                     [&](const Key* a, const Key* b) { return size(*a) > size(*b); });
    return todo;
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

  /// The phase of the most recent failure of run/ensure/prewarm (none if the last one succeeded).
  [[nodiscard]] pool_phase last_failure() const noexcept { return last_failure_; }

  [[nodiscard]] Backend& backend() noexcept { return backend_; }
  [[nodiscard]] const Backend& backend() const noexcept { return backend_; }

 private:
  struct slot : detail::lru_hook {
    const Key* key = nullptr;  // the map's key (stable)
    exec_type exec{};
    bool resident = false;
    fence_type fence{};  // marks the last launch or upload (retirement waits for it)
    std::uint64_t hits = 0, misses = 0, captures = 0, capture_failures = 0, replay_failures = 0,
                  evictions = 0;
    capture_info last_capture{};
    double total_capture_ms = 0.0;
    nvtx_label replay_label;  // "replay <key>", built once
  };

  slot& slot_for(const Key& key) {
    auto [it, inserted] = slots_.try_emplace(key);
    if (inserted) {
      if (!(it->first == it->first)) {  // e.g. a NaN field: it would never be found again
        slots_.erase(it);
        throw usage_error(fmt::format("replay::graph_pool: key {} does not compare equal to itself "
                                      "(a NaN field?); the pool could never find its graph",
                                      describe_key(key)));
      }
      it->second.key = &it->first;
      it->second.replay_label.set("replay", it->first);
      try {
        order_.push_back(&it->second);
      } catch (...) {
        slots_.erase(it);
        throw;
      }
    }
    return it->second;
  }

  void launch(slot& sl, stream_type s) {
    const nvtx_range range(sl.replay_label);
    try {
      backend_.launch(sl.exec, sl.fence, s);
    } catch (...) {
      ++counters_.replay_failures;
      ++sl.replay_failures;
      last_failure_ = pool_phase::replay;
      backend_.clear_error();
      throw;
    }
  }

  template <class Step>
  step_path miss(const Key& key, stream_type s, Step& step, batch_rows rows) {
    last_failure_ = pool_phase::none;
    ++counters_.misses;
    slot& sl = slot_for(key);
    ++sl.misses;
    install(sl, s, step);
    launch(sl, s);
    detail::add_rows(counters_, rows);
    return step_path::captured;
  }

  // Warm-up, make room, capture + instantiate + upload, then make `sl` resident and most recent.
  template <class Step>
  void install(slot& sl, stream_type s, Step& step) {
    if constexpr (requires { backend_.require_device("capture"); }) backend_.require_device("capture");
    backend_.collect();
    pool_phase phase = pool_phase::warmup;
    busy_ = true;
    try {
      if (options_.warmup > 0) {
        const nvtx_range range("warmup", *sl.key);
        const warmup_scope warming;  // replay::warming_up(): device loops do not run
        for (int i = 0; i < options_.warmup; ++i) detail::call_step(step, s, *sl.key);
      }
      make_room();
      exec_type exec{};
      const capture_info info = backend_.capture(step, *sl.key, s, options_, phase, exec, sl.fence);
      busy_ = false;
      sl.exec = std::move(exec);
      sl.resident = true;
      lru_.push_front(&sl);
      ++counters_.captures;
      ++sl.captures;
      sl.last_capture = info;
      sl.total_capture_ms += info.capture_ms + info.instantiate_ms;
    } catch (...) {
      busy_ = false;
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
    const nvtx_range range("evict", *sl.key);
    lru_.erase(&sl);
    sl.resident = false;
    ++sl.evictions;
    ++counters_.evictions;
    backend_.retire(std::move(sl.exec), std::move(sl.fence));
    sl.exec = exec_type{};
    sl.fence = fence_type{};
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
  bool busy_ = false;  // a step is running (warm-up or capture): re-entry and moves are refused

  void require_idle(const char* what) const {
    if (busy_) reentered(what);
  }
  [[noreturn]] static void reentered(const char* what) {
    throw usage_error(fmt::format("replay::graph_pool::{}: called from inside a step this pool is "
                                  "running (warm-up or capture); a step must not use its own pool",
                                  what));
  }
};

/// The CUDA graph pool.
template <class Key, class Hash = key_hash<Key>>
using graph_pool = basic_graph_pool<Key, cuda_graph_backend, Hash>;

}  // namespace replay

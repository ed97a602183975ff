// replay/lockstep.hpp: one decode step per rank, captured in lockstep across tensor-parallel ranks.
//
// Under tensor parallelism every rank runs the same step on its shard and the step contains
// collectives (all-reduce after attention and after the MLP). NCCL makes "is this collective
// graph-captured" a collective property: every rank of a communicator must issue the same
// collectives in the same order, all from a graph derived from the same collective capture, or all
// eagerly. A rank that falls back to eager while another replays its graph, or that picks another
// bucket (another all-reduce size), hangs or corrupts the group.
//
// `lockstep_runner<Key>` is one rank's runner. Each rank (one process per GPU, or one host thread
// per GPU in one process) makes its own, with its own graph pool on its own device, and calls it at
// the same points with the same keys. The runner keeps the ranks together through an injected
// agreement function, `rank_min_function`: every rank calls it with one integer and gets the
// minimum over all ranks (replay/nccl.hpp makes one from an NCCL communicator: `nccl_agreement`;
// tests use threads). The runner calls it only at these collective points, in this order on every
// rank:
//   - the first run/run_batch/prewarm: the kill switch (REPLAY_CUDA_GRAPHS) and
//     `lockstep_options::use_graphs` of every rank; graphs stay on only when on everywhere;
//   - every miss (a key captured for the first time): each rank warms up, captures and
//     instantiates, then the ranks agree. Graphs are kept only when every rank succeeded; otherwise
//     every rank drops its graphs, warns once and runs this step and every later one eagerly;
//   - `plan(n)` with `agree_batch = true`: the largest batch over the ranks, so every rank pads to
//     the same bucket even when their requested batch sizes differ (off by default: it costs a host
//     round-trip per step; the scheduler usually broadcasts one batch size to all ranks).
// A hit (a resident graph) needs no agreement: the ranks' pools hold the same keys, because they
// saw the same keys in the same order and evict by the same rule.
//
// What throws instead of falling back: a step that fails when run eagerly (its warm-up), on any
// rank, throws `lockstep_error` on every rank (the failing rank rethrows its own exception): its
// collectives may already be posted on the other ranks, so the engine must abort the
// communicator (ncclCommAbort) rather than continue. A failed replay of a resident graph is
// rethrown on its rank for the same reason: the other ranks are already inside their graphs.
// usage_error always propagates.
//
// Statistics (`stats()`): a graph captured by run() counts as prewarmed (captured on every rank
// before the agreement) and its first replay as a hit; eager runs count as in step_runner.
//
// Guarantees: the hit path is the graph pool's (no agreement, no allocation, no host sync). Not
// thread-safe: one thread drives one rank's runner; the ranks' threads run concurrently. The
// agreement function must be collective and must not throw on one rank only. Move-constructible.
//
// Example (each rank, on its own thread or process, device already set):
//   replay::nccl_comm agree_comm = comm.split();            // a communicator for agreements only
//   replay::lockstep_runner<replay::graph_key> runner(
//       [&](replay::stream_ref s, const replay::graph_key& k) { decode_step(s, k.bucket, comm); },
//       replay::nccl_agreement(agree_comm),
//       {.rank = rank, .buckets = replay::bucket_policy::powers_of_two(64)});
//   const replay::batch_plan p = runner.plan(n);             // same bucket on every rank
//   stage_rows(n, p.bucket); meta.push(s);
//   runner.run_batch(p, s, [](std::size_t rows) { return replay::graph_key{.bucket = uint32_t(rows)}; });
#pragma once

#include <replay/bucket.hpp>
#include <replay/error.hpp>
#include <replay/graph_pool.hpp>
#include <replay/runner.hpp>

#include <fmt/format.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace replay {

/// The cross-rank primitive: every rank calls it at the same point with one value and receives the
/// minimum over all ranks. Must be collective (all ranks call it, in the same order) and must
/// return the same result on every rank.
using rank_min_function = std::function<std::int64_t(std::int64_t)>;

/// A rank's step failed when run eagerly (here or on another rank): the group cannot continue and
/// the engine must abort its communicators. Thrown on every rank but the failing one, which
/// rethrows its own exception.
class lockstep_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Settings of a lockstep_runner. Must be the same on every rank, except `rank` and `warn`.
struct lockstep_options {
  int rank = 0;                     ///< this rank's index (for messages)
  pool_options pool{};              ///< capacity, warm-up runs, capture mode (thread-local)
  bucket_policy buckets{};          ///< one policy for all ranks (default: vllm_default(512))
  bool agree_batch = false;         ///< plan() agrees on the largest batch (a host round-trip)
  warning_sink warn{};              ///< where warnings go (empty: stderr)
  bool use_graphs = true;           ///< false on any rank: every rank runs eagerly
};

/// The rows a step runs: the batch every rank agreed on and the bucket it pads to (0 when it is
/// above the largest bucket: then the step runs eagerly, unpadded, on every rank).
struct batch_plan {
  std::size_t rows = 0;    ///< the largest requested batch over the ranks (or this rank's)
  std::size_t bucket = 0;  ///< the bucket every rank pads to; 0 = oversize
  std::size_t real = 0;    ///< this rank's requested rows (statistics)
  friend constexpr bool operator==(const batch_plan&, const batch_plan&) noexcept = default;
};

namespace detail {

// Agreement values of a miss: the minimum over ranks decides.
inline constexpr std::int64_t lockstep_step_failed = -1;  // the step failed eagerly: abort
inline constexpr std::int64_t lockstep_graph_failed = 0;  // capture/instantiate failed: eager
inline constexpr std::int64_t lockstep_captured = 1;      // graph ready

}  // namespace detail

/// One rank's lockstep runner over a graph pool. See the header comment.
template <class Key, class Backend = cuda_graph_backend, class Hash = key_hash<Key>>
class basic_lockstep_runner {
 public:
  using key_type = Key;
  using pool_type = basic_graph_pool<Key, Backend, Hash>;
  using stream_type = typename Backend::stream_type;
  /// This rank's step: issues one decode step for `key`, collectives included, to the stream.
  using step_function = std::function<void(stream_type, const Key&)>;

  /// Local only (no agreement yet): the first run/run_batch/prewarm/plan is the first collective.
  basic_lockstep_runner(step_function step, rank_min_function agree, lockstep_options options = {},
                        Backend backend = Backend{})
      : agree_(std::move(agree)),
        agree_batch_(options.agree_batch),
        rank_(options.rank),
        warn_(options.warn),
        local_(std::move(step),
               runner_options{.pool = options.pool,
                              .buckets = std::move(options.buckets),
                              .fallback = fallback_scope::runner,
                              .oversize = oversize_policy::eager,
                              .warn = options.warn,
                              .use_graphs = options.use_graphs},
               std::move(backend)) {
    if (!agree_) throw usage_error("replay::lockstep_runner: the agreement function is empty");
    if (!local_.graphs_enabled()) off_ = off_reason::local;
  }

  /// Collective (with agree_batch): the batch and bucket for this rank's `n` requested rows. Every
  /// rank gets the same `rows` and `bucket`. Without agree_batch it is local and every rank must
  /// pass the same n.
  [[nodiscard]] batch_plan plan(std::size_t n) {
    if (n == 0) throw usage_error("replay::lockstep_runner::plan: a batch of 0 rows has no bucket");
    std::size_t rows = n;
    if (agree_batch_) {
      settle();
      if (n > static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max()))
        throw usage_error(fmt::format("replay::lockstep_runner::plan: a batch of {} rows", n));
      rows = static_cast<std::size_t>(-agree_(-static_cast<std::int64_t>(n)));
    }
    return {rows, buckets().pad(rows).value_or(0), n};
  }

  /// Collective: runs the planned batch with `make_key(bucket)` (or, oversize, eagerly with
  /// `make_key(rows)` on every rank).
  template <class MakeKey>
  step_path run_batch(const batch_plan& p, stream_type s, MakeKey&& make_key) {
    if (p.bucket == 0) {
      settle();
      return eager(make_key(p.rows), s, {p.real, p.rows}, step_path::eager_oversize);
    }
    return run(make_key(p.bucket), s, {p.real, p.bucket});
  }
  /// Collective: plan(n) then run_batch().
  template <class MakeKey>
  step_path run_batch(std::size_t n, stream_type s, MakeKey&& make_key) {
    return run_batch(plan(n), s, std::forward<MakeKey>(make_key));
  }

  /// Collective: runs the step for `key` on every rank, all from graphs or all eagerly. See the
  /// header comment for what is agreed and what throws.
  step_path run(const Key& key, stream_type s, batch_rows rows = {}) {
    settle();
    if (off_ != off_reason::none) [[unlikely]]
      return eager(key, s, rows, off_ == off_reason::failure ? step_path::eager_fallback
                                                             : step_path::eager_disabled);
    if (pool().contains(key)) [[likely]]
      return pool().run(key, s, local_.step(), rows);  // a replay failure propagates: see the header
    if (!install(key, s)) return eager(key, s, rows, step_path::eager_fallback);
    pool().run(key, s, local_.step(), rows);
    return step_path::captured;
  }

  /// Collective: captures the graphs of every bucket up front (largest first), keys from
  /// `make_key(bucket)`; one agreement per key. Returns how many graphs were captured.
  template <class MakeKey>
  std::size_t prewarm_buckets(stream_type s, MakeKey&& make_key) {
    std::vector<Key> keys;
    keys.reserve(buckets().count());
    for (const std::size_t b : buckets().sizes()) keys.push_back(make_key(b));
    return prewarm(keys, s);
  }
  /// Collective: captures the given keys up front (largest first by key_size).
  std::size_t prewarm(std::span<const Key> keys, stream_type s) {
    settle();
    std::size_t captured = 0;
    for (const Key* k : pool().prewarm_order(keys)) {
      if (off_ != off_reason::none) break;
      if (install(*k, s)) ++captured;
    }
    return captured;
  }

  /// Runs the step eagerly on this rank only, counted as `why` (an eager step_path). Not
  /// collective: every rank must make the same call.
  step_path eager(const Key& key, stream_type s, batch_rows rows, step_path why) {
    return local_.eager(key, s, rows, why);
  }

  /// Graphs are on for the group (as far as this rank knows: before the first collective call only
  /// this rank's switch is known).
  [[nodiscard]] bool graphs_enabled() const noexcept { return off_ == off_reason::none; }
  /// True once the first collective call agreed on the kill switch and options.
  [[nodiscard]] bool settled() const noexcept { return settled_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] const bucket_policy& buckets() const noexcept { return local_.buckets(); }
  [[nodiscard]] pool_type& pool() noexcept { return local_.pool(); }
  [[nodiscard]] const pool_type& pool() const noexcept { return local_.pool(); }
  /// The pool's statistics with this rank's eager runs added.
  [[nodiscard]] pool_stats stats() const { return local_.stats(); }

 private:
  enum class off_reason : std::uint8_t { none, local, peer, failure };

  // The first collective point: graphs stay on only if they are on for every rank.
  void settle() {
    if (settled_) [[likely]] return;
    const bool local = off_ == off_reason::none;
    const bool all = agree_(local ? 1 : 0) > 0;
    settled_ = true;
    if (local && !all) {
      off_ = off_reason::peer;
      warn(fmt::format("rank {}: CUDA graphs are off on another rank (REPLAY_CUDA_GRAPHS or "
                       "use_graphs); every rank runs eagerly", rank_));
    }
  }

  // A miss on every rank: warm up, capture, instantiate, agree. True when every rank holds its
  // graph; false when graphs are now off for the group (this rank's graph dropped).
  bool install(const Key& key, stream_type s) {
    std::int64_t local = detail::lockstep_captured;
    std::exception_ptr error;
    std::string what;
    try {
      pool().ensure(key, s, local_.step());
    } catch (const usage_error&) {
      local = detail::lockstep_step_failed;
      error = std::current_exception();
    } catch (const std::exception& e) {
      const pool_phase phase = pool().last_failure();
      local = (phase == pool_phase::warmup || phase == pool_phase::none) ? detail::lockstep_step_failed
                                                                          : detail::lockstep_graph_failed;
      error = std::current_exception();
      what = e.what();
    } catch (...) {
      const pool_phase phase = pool().last_failure();
      local = (phase == pool_phase::warmup || phase == pool_phase::none) ? detail::lockstep_step_failed
                                                                          : detail::lockstep_graph_failed;
      error = std::current_exception();
      what = "an exception not derived from std::exception";
    }
    const std::int64_t all = agree_(local);
    if (all == detail::lockstep_captured) return true;
    if (all <= detail::lockstep_step_failed) {
      if (local == detail::lockstep_step_failed) std::rethrow_exception(error);
      throw lockstep_error(fmt::format(
          "replay::lockstep_runner (rank {}): another rank's step failed when run eagerly for key "
          "{}; collectives of this step may be posted on this rank: abort the communicators",
          rank_, describe_key(key)));
    }
    // Some rank could not capture: everyone drops its graphs and runs eagerly from now on.
    pool().backend().clear_error();
    pool().clear();
    off_ = off_reason::failure;
    if (local == detail::lockstep_graph_failed)
      warn(fmt::format("rank {}: CUDA graph {} failed for key {}: {}; every rank now runs eagerly "
                       "(the step was not lost)",
                       rank_, to_string(pool().last_failure()), describe_key(key), what));
    else
      warn(fmt::format("rank {}: another rank failed to capture key {}; every rank now runs "
                       "eagerly (the step was not lost)",
                       rank_, describe_key(key)));
    return false;
  }

  void warn(const std::string& msg) const {
    if (warn_) warn_(msg); else stderr_warning_sink(msg);
  }

  rank_min_function agree_;
  bool agree_batch_;
  int rank_;
  warning_sink warn_;
  // This rank's step, pool, bucket policy, kill switch and eager counters; its own fallback is
  // never used (graph failures are handled here, across ranks).
  basic_step_runner<Key, Backend, Hash> local_;
  off_reason off_ = off_reason::none;
  bool settled_ = false;
};

/// The CUDA lockstep runner.
template <class Key, class Hash = key_hash<Key>>
using lockstep_runner = basic_lockstep_runner<Key, cuda_graph_backend, Hash>;

}  // namespace replay

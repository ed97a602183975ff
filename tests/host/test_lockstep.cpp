// Host tests of the lockstep runner (tensor-parallel ranks) under a fake backend: two host threads
// stand in for two ranks and agree through a barrier that returns the minimum. Checked: the same
// bucket on every rank from different requested batch sizes, a capture failure on one rank turns
// graphs off on all, a step failing eagerly on one rank stops all, the kill switch and use_graphs
// of one rank apply to all, and hits need no agreement.
#include <doctest/doctest.h>
#include <env_guard.hpp>
#include <replay/lockstep.hpp>

#include "pool_fake_backend.hpp"

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using pool_fake::fake_backend;
using pool_fake::journal;
using replay::step_path;

namespace {

using runner_t = replay::basic_lockstep_runner<replay::graph_key, fake_backend>;

replay::graph_key key_for(std::size_t bucket) {
  return replay::graph_key{.bucket = static_cast<std::uint32_t>(bucket)};
}

/// A reusable barrier over `world` threads that returns the minimum of their values.
class min_barrier {
 public:
  explicit min_barrier(int world) : world_(world) {}
  std::int64_t min(std::int64_t v) {
    std::unique_lock lock(m_);
    const std::uint64_t gen = gen_;
    acc_ = std::min(acc_, v);
    if (++arrived_ == world_) {
      result_ = acc_;
      acc_ = std::numeric_limits<std::int64_t>::max();
      arrived_ = 0;
      ++gen_;
      ++calls_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return gen_ != gen; });
    }
    return result_;
  }
  [[nodiscard]] int calls() const {
    std::lock_guard lock(m_);
    return calls_;
  }

 private:
  mutable std::mutex m_;
  std::condition_variable cv_;
  int world_;
  int arrived_ = 0;
  int calls_ = 0;
  std::uint64_t gen_ = 0;
  std::int64_t acc_ = std::numeric_limits<std::int64_t>::max();
  std::int64_t result_ = 0;
};

/// One fake rank: its journal, its step's record and its warnings.
struct rank_state {
  int rank = 0;
  std::shared_ptr<journal> j = std::make_shared<journal>();
  std::vector<std::string> calls;  // "eager 8" / "captured 8"
  std::vector<std::string> warnings;
  bool throw_in_capture = false;  // the step throws while the backend captures
  bool throw_eager = false;       // the step throws when run eagerly
  std::exception_ptr error;
  std::vector<step_path> paths;
};

runner_t make_runner(rank_state& r, min_barrier& agree, replay::lockstep_options opt = {}) {
  opt.rank = r.rank;
  opt.warn = [&r](std::string_view m) { r.warnings.emplace_back(m); };
  auto step = [&r](int, const replay::graph_key& k) {
    if (r.j->capturing) {
      if (r.throw_in_capture) throw std::runtime_error("capture-illegal call on this rank");
      r.calls.push_back("captured " + std::to_string(k.bucket));
    } else {
      if (r.throw_eager) throw std::runtime_error("step failed eagerly");
      r.calls.push_back("eager " + std::to_string(k.bucket));
    }
  };
  return runner_t(step, [&agree](std::int64_t v) { return agree.min(v); }, std::move(opt),
                  fake_backend(r.j));
}

/// Runs `body(rank, runner)` on one thread per rank; exceptions are kept per rank.
/// `per_rank` may change a rank's options (e.g. use_graphs on one rank only).
void run_ranks(std::vector<rank_state>& ranks, min_barrier& agree, const replay::lockstep_options& opt,
               const std::function<void(rank_state&, runner_t&)>& body,
               const std::function<void(int, replay::lockstep_options&)>& per_rank = {}) {
  std::vector<std::thread> threads;
  for (auto& r : ranks)
    threads.emplace_back([&r, &agree, &opt, &body, &per_rank] {
      try {
        replay::lockstep_options o = opt;
        if (per_rank) per_rank(r.rank, o);
        runner_t runner = make_runner(r, agree, std::move(o));
        body(r, runner);
      } catch (...) {
        r.error = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
}

std::vector<rank_state> make_ranks(int world) {
  std::vector<rank_state> ranks(static_cast<std::size_t>(world));
  for (int i = 0; i < world; ++i) ranks[static_cast<std::size_t>(i)].rank = i;
  return ranks;
}

std::string what(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
}

}  // namespace

TEST_CASE("lockstep: different requested batch sizes pad to the same bucket on every rank") {
  replay_test::env_guard env(nullptr);
  auto ranks = make_ranks(2);
  min_barrier agree(2);
  std::vector<replay::batch_plan> plans(2);
  const replay::lockstep_options opt{.buckets = replay::bucket_policy::powers_of_two(16), .agree_batch = true};
  run_ranks(ranks, agree, opt, [&](rank_state& r, runner_t& run) {
    const std::size_t n = r.rank == 0 ? 3 : 5;
    plans[static_cast<std::size_t>(r.rank)] = run.plan(n);
    r.paths.push_back(run.run_batch(plans[static_cast<std::size_t>(r.rank)], 0, key_for));
    r.paths.push_back(run.run_batch(run.plan(r.rank == 0 ? 6 : 2), 0, key_for));
    r.paths.push_back(run.run_batch(run.plan(r.rank == 0 ? 20 : 1), 0, key_for));  // oversize
  });
  for (auto& r : ranks) REQUIRE_FALSE(r.error);
  CHECK(plans[0] == replay::batch_plan{5, 8, 3});
  CHECK(plans[1] == replay::batch_plan{5, 8, 5});
  for (auto& r : ranks) {
    CHECK(r.paths == std::vector<step_path>{step_path::captured, step_path::replayed,
                                            step_path::eager_oversize});
    CHECK(r.calls == std::vector<std::string>{"eager 8", "captured 8", "eager 20"});
    CHECK(r.j->captures == 1);
    CHECK(r.j->launches == 2);
    CHECK(r.warnings.empty());
  }
}

TEST_CASE("lockstep: without agree_batch plan() is local and hits need no agreement") {
  replay_test::env_guard env(nullptr);
  auto ranks = make_ranks(2);
  min_barrier agree(2);
  const replay::lockstep_options opt{.buckets = replay::bucket_policy::powers_of_two(16)};
  run_ranks(ranks, agree, opt, [&](rank_state& r, runner_t& run) {
    for (int i = 0; i < 5; ++i) r.paths.push_back(run.run_batch(std::size_t{3}, 0, key_for));
  });
  for (auto& r : ranks) {
    REQUIRE_FALSE(r.error);
    CHECK(r.paths.front() == step_path::captured);
    CHECK(std::count(r.paths.begin(), r.paths.end(), step_path::replayed) == 4);
  }
  CHECK(agree.calls() == 2);  // the switch, then the one miss
}

TEST_CASE("lockstep: a capture failure on one rank leaves no graph on any rank; all run eagerly") {
  replay_test::env_guard env(nullptr);
  for (const bool instantiate : {false, true}) {
    CAPTURE(instantiate);
    auto ranks = make_ranks(2);
    if (instantiate) ranks[1].j->fail_instantiate = true;
    else ranks[1].throw_in_capture = true;
    min_barrier agree(2);
    const replay::lockstep_options opt{.buckets = replay::bucket_policy::powers_of_two(16)};
    run_ranks(ranks, agree, opt, [&](rank_state& r, runner_t& run) {
      for (int i = 0; i < 3; ++i) r.paths.push_back(run.run_batch(std::size_t{4}, 0, key_for));
      CHECK_FALSE(run.graphs_enabled());
      CHECK(run.pool().size() == 0);
      CHECK(run.stats().eager_fallbacks == 3);
    });
    for (auto& r : ranks) {
      REQUIRE_FALSE(r.error);
      CHECK(r.paths == std::vector<step_path>(3, step_path::eager_fallback));
      CHECK(r.j->launches == 0);
      REQUIRE(r.warnings.size() == 1);
      CHECK(std::count(r.calls.begin(), r.calls.end(), "eager 4") == 4);  // warm-up + 3 steps
    }
    CHECK(ranks[0].warnings[0].find("another rank failed to capture") != std::string::npos);
    CHECK(ranks[1].warnings[0].find(instantiate ? "instantiate" : "capture-illegal") != std::string::npos);
    CHECK(ranks[0].j->pending.size() + ranks[0].j->destroyed.size() == 1);  // rank 0's graph retired
    CHECK(agree.calls() == 2);  // no agreement after graphs went off
  }
}

TEST_CASE("lockstep: a step that fails eagerly on one rank stops every rank") {
  replay_test::env_guard env(nullptr);
  auto ranks = make_ranks(2);
  ranks[1].throw_eager = true;
  min_barrier agree(2);
  const replay::lockstep_options opt{.buckets = replay::bucket_policy::powers_of_two(16)};
  run_ranks(ranks, agree, opt, [&](rank_state&, runner_t& run) { (void)run.run_batch(std::size_t{2}, 0, key_for); });
  REQUIRE(ranks[0].error);
  REQUIRE(ranks[1].error);
  CHECK_THROWS_AS(std::rethrow_exception(ranks[0].error), replay::lockstep_error);
  CHECK(what(ranks[0].error).find("abort the communicators") != std::string::npos);
  CHECK(what(ranks[1].error) == "step failed eagerly");
}

TEST_CASE("lockstep: graphs off on one rank (use_graphs or the kill switch) are off on all") {
  SUBCASE("use_graphs = false on rank 1") {
    replay_test::env_guard env(nullptr);
    auto ranks = make_ranks(2);
    min_barrier agree(2);
    run_ranks(
        ranks, agree, {.buckets = replay::bucket_policy::powers_of_two(8)},
        [&](rank_state& r, runner_t& run) {
          for (int i = 0; i < 2; ++i) r.paths.push_back(run.run_batch(std::size_t{2}, 0, key_for));
        },
        [](int rank, replay::lockstep_options& o) { o.use_graphs = rank != 1; });
    for (auto& r : ranks) {
      REQUIRE_FALSE(r.error);
      CHECK(r.paths == std::vector<step_path>(2, step_path::eager_disabled));
      CHECK(r.j->captures == 0);
    }
    REQUIRE(ranks[0].warnings.size() == 1);
    CHECK(ranks[0].warnings[0].find("off on another rank") != std::string::npos);
    CHECK(ranks[1].warnings.empty());
  }
  SUBCASE("REPLAY_CUDA_GRAPHS=0") {
    replay_test::env_guard env("0");
    auto ranks = make_ranks(2);
    min_barrier agree(2);
    run_ranks(ranks, agree, {}, [&](rank_state& r, runner_t& run) {
      r.paths.push_back(run.run_batch(std::size_t{5}, 0, key_for));
      r.paths.push_back(run.run(key_for(8), 0));
    });
    for (auto& r : ranks) {
      REQUIRE_FALSE(r.error);
      CHECK(r.paths == std::vector<step_path>(2, step_path::eager_disabled));
      CHECK(r.j->captures == 0);
      CHECK(r.warnings.empty());
    }
  }
}

TEST_CASE("lockstep: prewarm captures every bucket on every rank, one agreement per key") {
  replay_test::env_guard env(nullptr);
  auto ranks = make_ranks(2);
  min_barrier agree(2);
  std::vector<std::size_t> captured(2);
  const replay::lockstep_options opt{.buckets = replay::bucket_policy::powers_of_two(8)};
  run_ranks(ranks, agree, opt, [&](rank_state& r, runner_t& run) {
    captured[static_cast<std::size_t>(r.rank)] = run.prewarm_buckets(0, key_for);
    r.paths.push_back(run.run_batch(std::size_t{3}, 0, key_for));
  });
  for (auto& r : ranks) {
    REQUIRE_FALSE(r.error);
    CHECK(r.paths == std::vector<step_path>{step_path::replayed});
    CHECK(r.j->captures == 4);
  }
  CHECK(captured == std::vector<std::size_t>{4, 4});
  CHECK(agree.calls() == 5);
}

TEST_CASE("lockstep: empty step or agreement is a usage error") {
  CHECK_THROWS_AS(runner_t({}, [](std::int64_t v) { return v; }), replay::usage_error);
  CHECK_THROWS_AS(runner_t([](int, const replay::graph_key&) {}, {}), replay::usage_error);
}

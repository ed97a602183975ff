// Host tests of how the library's pieces compose where no GPU is needed: sizes checked before any
// allocation (buffers, arena, step metadata, token loop), pool and runner statistics around a failed
// replay, the runner's eager path validating before it runs, the device check on every runner
// path, and the audit's report of what it could not compare and of edges found in one capture only.
#include <doctest/doctest.h>
#include <replay/audit.hpp>
#include <replay/buffer.hpp>
#include <replay/device_loop.hpp>
#include <replay/runner.hpp>
#include <replay/step_meta.hpp>

#include "pool_fake_backend.hpp"

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

using pool_fake::fake_backend;
using pool_fake::journal;
using replay::step_path;

namespace {

constexpr std::size_t huge = std::numeric_limits<std::size_t>::max() / 4 + 1;  // * 4 bytes wraps

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

replay::graph_key key_for(std::size_t bucket) {
  return replay::graph_key{.bucket = static_cast<std::uint32_t>(bucket)};
}

/// A fake backend that belongs to a device: require_device() throws unless `current` is true.
class device_fake_backend : public fake_backend {
 public:
  device_fake_backend(std::shared_ptr<journal> j, std::shared_ptr<bool> current)
      : fake_backend(std::move(j)), current_(std::move(current)) {}
  void require_device(const char* what) const {
    if (!*current_) throw replay::usage_error(std::string("wrong device current: ") + what);
  }

 private:
  std::shared_ptr<bool> current_;
};

}  // namespace

TEST_CASE("sizes whose byte count overflows are refused before anything is allocated") {
  // Each of these wrapped to a small allocation (or none) while claiming the huge count.
  CHECK_THROWS_AS(replay::device_buffer<std::int32_t>{huge}, replay::usage_error);
  CHECK_THROWS_AS(replay::pinned_buffer<std::int32_t>{huge}, replay::usage_error);
  replay::static_arena arena;  // capacity 0: only a wrapped size of 0 bytes would fit
  CHECK_THROWS_AS((void)arena.allocate<std::uint64_t>(std::size_t{1} << 61), replay::usage_error);
  CHECK(arena.used() == 0);
  CHECK_THROWS_AS(replay::step_meta_array<std::int32_t>{huge}, replay::usage_error);
  CHECK_THROWS_AS(replay::step_meta_array<std::int32_t>(std::numeric_limits<std::size_t>::max() / 2),
                  replay::usage_error);
  // token_loop checks its capacity before it allocates (without a GPU an allocation would fail
  // with cuda_error, not usage_error).
  CHECK_THROWS_AS(replay::token_loop(std::size_t{1} << 25), replay::usage_error);
  CHECK_THROWS_AS(replay::token_loop(0), replay::usage_error);
  try {
    replay::device_buffer<std::int32_t> b(huge);
    FAIL("no throw");
  } catch (const replay::usage_error& e) {
    CHECK(contains(e.what(), "overflow"));
  }
}

TEST_CASE("a replay that fails is not a hit and its rows are counted once, by the eager run") {
  auto j = std::make_shared<journal>();
  std::vector<std::string> warnings;
  replay::basic_step_runner<replay::graph_key, fake_backend> runner(
      [](int, const replay::graph_key&) {}, {.warn = [&](std::string_view m) { warnings.emplace_back(m); }},
      fake_backend(j));
  CHECK(runner.run(key_for(8), 0, {5, 8}) == step_path::captured);
  j->fail_launch = true;
  CHECK(runner.run(key_for(8), 0, {6, 8}) == step_path::eager_fallback);
  const replay::pool_stats st = runner.stats();
  CHECK(st.hits == 0);
  CHECK(st.misses == 1);
  CHECK(st.replay_failures == 1);
  CHECK(st.eager_fallbacks == 1);
  CHECK(st.real_rows == 5 + 6);
  CHECK(st.padded_rows == 8 + 8);
  CHECK(warnings.size() == 1);
}

TEST_CASE("a miss whose first replay fails serves its rows once, through the eager run") {
  auto j = std::make_shared<journal>();
  replay::basic_step_runner<replay::graph_key, fake_backend> runner([](int, const replay::graph_key&) {},
                                                                    {.warn = [](std::string_view) {}}, fake_backend(j));
  j->fail_launch = true;
  CHECK(runner.run(key_for(4), 0, {3, 4}) == step_path::eager_fallback);
  const replay::pool_stats st = runner.stats();
  CHECK(st.real_rows == 3);
  CHECK(st.padded_rows == 4);
  CHECK(st.eager_fallbacks == 1);
}

TEST_CASE("step_runner::eager validates its reason before it issues any work") {
  int runs = 0;
  replay::basic_step_runner<replay::graph_key, fake_backend> runner([&](int, const replay::graph_key&) { ++runs; });
  CHECK_THROWS_AS(runner.eager(key_for(1), 0, {}, step_path::replayed), replay::usage_error);
  CHECK_THROWS_AS(runner.eager(key_for(1), 0, {}, step_path::captured), replay::usage_error);
  CHECK(runs == 0);
  CHECK(runner.eager(key_for(1), 0, {1, 1}, step_path::eager_disabled) == step_path::eager_disabled);
  CHECK(runs == 1);
}

TEST_CASE("every runner path checks the pool's device: graphs, graphs off, oversize, fallback") {
  auto j = std::make_shared<journal>();
  auto current = std::make_shared<bool>(false);
  using runner_t = replay::basic_step_runner<replay::graph_key, device_fake_backend>;
  int runs = 0;
  const auto step = [&](int, const replay::graph_key&) { ++runs; };
  const auto make_key = [](std::size_t rows) { return key_for(rows); };
  runner_t graphs(step, {.buckets = replay::bucket_policy::powers_of_two(8)}, device_fake_backend(j, current));
  CHECK_THROWS_AS(graphs.run_batch(3, 0, make_key), replay::usage_error);      // graph path
  CHECK_THROWS_AS(graphs.run_batch(100, 0, make_key), replay::usage_error);    // oversize: eager
  runner_t off(step, {.use_graphs = false}, device_fake_backend(j, current));
  CHECK_THROWS_AS(off.run(key_for(2), 0), replay::usage_error);                // graphs off: eager
  CHECK(runs == 0);
  *current = true;
  CHECK(graphs.run_batch(3, 0, make_key) == step_path::captured);
  CHECK(graphs.run_batch(100, 0, make_key) == step_path::eager_oversize);
  CHECK(off.run(key_for(2), 0) == step_path::eager_disabled);
}

namespace {

replay::node_info kernel_node(std::uintptr_t func, std::string name) {
  replay::node_info n;
  n.type = cudaGraphNodeTypeKernel;
  n.func = func;
  n.kernel = std::move(name);
  n.args_known = true;
  return n;
}

replay::graph_summary summary(std::vector<replay::node_info> nodes,
                              std::vector<std::pair<std::size_t, std::size_t>> edges) {
  replay::graph_summary g;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    nodes[i].index = i;
    nodes[i].path = std::to_string(i);
  }
  g.nodes = std::move(nodes);
  for (const auto& [f, t] : edges) g.edges.push_back({f, t, false});
  return g;
}

bool no_address(std::uint64_t) { return false; }

}  // namespace

TEST_CASE("audit: an edge found only in the first capture is reported in the first capture's numbering") {
  // First capture: a, x, b, c with a -> b -> c; second: a, b, c with only a -> b.
  const auto a = kernel_node(1, "a"), x = kernel_node(9, "x"), b = kernel_node(2, "b"), c = kernel_node(3, "c");
  const replay::graph_summary g1 = summary({a, x, b, c}, {{0, 2}, {2, 3}});
  const replay::graph_summary g2 = summary({a, b, c}, {{0, 1}});
  const replay::audit_report r = replay::detail::compare_summaries(g1, g2, &no_address);
  bool found = false;
  for (const auto& t : r.topology) {
    if (!contains(t.description, "edge")) continue;
    found = true;
    CHECK(t.capture == 1);
    CHECK(t.node == 2);
    CHECK(t.path == "2");
    CHECK(contains(t.description, "edge 2 -> 3 (b -> c)"));
  }
  CHECK(found);
}

TEST_CASE("audit: a conditional node whose bodies could not be read is 'not compared', never clean") {
  replay::node_info cond;
  cond.type = cudaGraphNodeTypeConditional;
  cond.bodies_known = false;
  const replay::graph_summary g = summary({kernel_node(1, "reset"), cond}, {{0, 1}});
  const replay::audit_report r = replay::detail::compare_summaries(g, g, &no_address);
  CHECK_FALSE(r.clean());
  REQUIRE(r.not_compared.size() == 1);
  CHECK(contains(r.not_compared[0], "not compared"));
  CHECK(contains(fmt::format("{}", r), "not compared: node 1 (conditional)"));
  CHECK(contains(r.to_json(), "\"not_compared\": [\""));
  // With its bodies read (and identical), the same graph is clean.
  replay::graph_summary known = g;
  known.nodes[1].bodies_known = true;
  CHECK(replay::detail::compare_summaries(known, known, &no_address).clean());
}

TEST_CASE("condition defaults: make_condition's is 0 (CUDA's), while_loop's own is 1, both assigned per launch") {
  constexpr replay::condition_options made{};
  CHECK(made.default_value == 0);
  CHECK(made.assign_default);
  constexpr replay::condition_options looped = replay::condition_options::while_defaults();
  CHECK(looped.default_value == 1);
  CHECK(looped.assign_default);
}

TEST_CASE("warming_up() is true only inside a warmup_scope, which the pool opens around its warm-up") {
  CHECK_FALSE(replay::warming_up());
  {
    const replay::warmup_scope w;
    CHECK(replay::warming_up());
  }
  CHECK_FALSE(replay::warming_up());
  auto j = std::make_shared<journal>();
  std::vector<bool> seen;
  pool_fake::fake_pool<replay::graph_key> pool({.warmup = 2}, fake_backend(j));
  pool.run(key_for(1), 0, [&](int, const replay::graph_key&) { seen.push_back(replay::warming_up()); });
  CHECK(seen == std::vector<bool>{true, true, false});  // two warm-ups, then the capture
}

// GPU tests of step_runner over a real step (pool_toy_model.cuh): run_batch over batch sizes with
// oversize batches, eager fallback with one warning when the step calls cudaMalloc or
// cudaStreamSynchronize during capture (output still correct, no error left behind), and the
// REPLAY_CUDA_GRAPHS=0 kill switch.
#include <doctest/doctest.h>
#include <env_guard.hpp>
#include <gpu_test.hpp>
#include <replay/replay.hpp>

#include "pool_toy_model.cuh"

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

using pool_toy::model;
using replay::step_path;

namespace {

replay::graph_key key_for(std::size_t bucket) {
  return replay::graph_key{.bucket = static_cast<std::uint32_t>(bucket)};
}

using replay_test::env_guard;

/// Runs `steps` decode steps of `n` rows through `runner` (run_batch), checking every output row
/// against the formula; returns the number of wrong values.
template <class Runner>
int drive(Runner& runner, model& m, replay::stream& s, std::size_t n, int steps, int t0,
          std::vector<step_path>* paths = nullptr) {
  int bad = 0;
  for (int i = 0; i < steps; ++i) {
    const int t = t0 + i;
    const std::size_t b = runner.buckets().pad(n).value_or(n);
    m.poison(s);
    m.stage(n, b, t, s);
    const step_path p = runner.run_batch(n, s, key_for);
    if (paths) paths->push_back(p);
    bad += pool_toy::mismatches(m.out_rows(n, s), n, t);
  }
  return bad;
}

}  // namespace

TEST_CASE("step_runner: run_batch over 1..64 replays padded graphs; oversize batches run eagerly") {
  env_guard g(nullptr);
  replay::stream s;
  model m(80);
  replay::step_runner<replay::graph_key> runner(
      [&](replay::stream_ref cs, const replay::graph_key& k) { m.step(cs, k.bucket); },
      {.buckets = replay::bucket_policy::every(8, 64)});
  int bad = 0;
  for (std::size_t n = 1; n <= 64; ++n) bad += drive(runner, m, s, n, 1, static_cast<int>(n));
  for (std::size_t n = 1; n <= 64; n += 3) bad += drive(runner, m, s, n, 1, 500 + static_cast<int>(n));
  std::vector<step_path> paths;
  for (std::size_t n = 65; n <= 80; n += 5) bad += drive(runner, m, s, n, 1, 900, &paths);
  CHECK(bad == 0);
  for (auto p : paths) CHECK(p == step_path::eager_oversize);
  const auto st = runner.stats();
  CHECK(st.captures == 8);
  CHECK(st.eager_oversize == paths.size());
  CHECK(st.eager_fallbacks == 0);
  CHECK(st.hit_rate() > 0.9);
  CHECK(runner.graphs_enabled());
  MESSAGE(fmt::format("{}", st));
}

TEST_SUITE("expected_cuda_errors") {
TEST_CASE("a step that calls cudaMalloc during capture falls back to eager with one warning") {
  env_guard g(nullptr);
  replay::stream s;
  model m(16);
  std::vector<std::string> warnings;
  int allocations = 0;
  replay::step_runner<replay::graph_key> runner(
      [&](replay::stream_ref cs, const replay::graph_key& k) {
        void* scratch = nullptr;
        REPLAY_CHECK(cudaMalloc(&scratch, 4096));  // capture-unsafe: fails under capture
        ++allocations;
        m.step(cs, k.bucket);
        REPLAY_CHECK(cudaFree(scratch));
      },
      {.buckets = replay::bucket_policy::powers_of_two(16),
       .warn = [&](std::string_view w) { warnings.emplace_back(w); }});
  std::vector<step_path> paths;
  const int bad = drive(runner, m, s, 5, 4, 0, &paths) + drive(runner, m, s, 16, 2, 10, &paths);
  CHECK(bad == 0);  // every step computed correctly, eagerly
  REQUIRE(paths.size() == 6);
  for (auto p : paths) CHECK(p == step_path::eager_fallback);
  REQUIRE(warnings.size() == 1);
  MESSAGE(warnings[0]);
  CHECK(warnings[0].find("capture failed") != std::string::npos);
  CHECK(warnings[0].find("cudaMalloc") != std::string::npos);
  CHECK_FALSE(runner.graphs_enabled());
  CHECK(cudaGetLastError() == cudaSuccess);  // no error left behind
  CHECK_FALSE(s.is_capturing());
  const auto st = runner.stats();
  CHECK(st.capture_failures == 1);
  CHECK(st.captures == 0);
  CHECK(st.eager_fallbacks == 6);
  CHECK(allocations == 1 + 6);  // one warm-up, six eager runs
}

TEST_CASE("a step that synchronises during capture falls back to eager with one warning") {
  env_guard g(nullptr);
  replay::stream s;
  model m(16);

  SUBCASE("checked synchronise (throws under capture)") {
    std::vector<std::string> warnings;
    replay::step_runner<replay::graph_key> runner(
        [&](replay::stream_ref cs, const replay::graph_key& k) {
          m.step(cs, k.bucket);
          cs.synchronize();  // capture-unsafe
        },
        {.buckets = replay::bucket_policy::powers_of_two(16),
         .warn = [&](std::string_view w) { warnings.emplace_back(w); }});
    std::vector<step_path> paths;
    CHECK(drive(runner, m, s, 3, 5, 0, &paths) == 0);
    for (auto p : paths) CHECK(p == step_path::eager_fallback);
    REQUIRE(warnings.size() == 1);
    MESSAGE(warnings[0]);
    CHECK(warnings[0].find("cudaStreamSynchronize") != std::string::npos);
    CHECK(cudaGetLastError() == cudaSuccess);
    CHECK_FALSE(s.is_capturing());
  }
  SUBCASE("unchecked synchronise (the capture is invalidated), key scope: other keys keep graphs") {
    std::vector<std::string> warnings;
    replay::step_runner<replay::graph_key> runner(
        [&](replay::stream_ref cs, const replay::graph_key& k) {
          if (k.bucket == 4) (void)cudaStreamSynchronize(cs.get());  // error ignored by the step
          m.step(cs, k.bucket);
        },
        {.buckets = replay::bucket_policy::powers_of_two(16),
         .fallback = replay::fallback_scope::key,
         .warn = [&](std::string_view w) { warnings.emplace_back(w); }});
    std::vector<step_path> bad_paths, good_paths;
    CHECK(drive(runner, m, s, 3, 3, 0, &bad_paths) == 0);   // bucket 4: falls back
    CHECK(drive(runner, m, s, 7, 3, 0, &good_paths) == 0);  // bucket 8: graphs
    CHECK(drive(runner, m, s, 4, 2, 50, &bad_paths) == 0);  // bucket 4 again: eager, no new warning
    for (auto p : bad_paths) CHECK(p == step_path::eager_fallback);
    CHECK(good_paths == std::vector<step_path>{step_path::captured, step_path::replayed, step_path::replayed});
    REQUIRE(warnings.size() == 1);
    MESSAGE(warnings[0]);
    CHECK(runner.key_disabled(key_for(4)));
    CHECK(runner.graphs_enabled());
    CHECK(cudaGetLastError() == cudaSuccess);
    CHECK_FALSE(s.is_capturing());
  }
}
}  // TEST_SUITE

TEST_CASE("REPLAY_CUDA_GRAPHS=0 runs everything eagerly") {
  env_guard g("0");
  replay::stream s;
  model m(64);
  std::vector<std::string> warnings;
  replay::step_runner<replay::graph_key> runner(
      [&](replay::stream_ref cs, const replay::graph_key& k) { m.step(cs, k.bucket); },
      {.buckets = replay::bucket_policy::powers_of_two(64),
       .warn = [&](std::string_view w) { warnings.emplace_back(w); }});
  CHECK_FALSE(runner.graphs_enabled());
  std::vector<step_path> paths;
  int bad = 0;
  for (std::size_t n = 1; n <= 64; n += 7) bad += drive(runner, m, s, n, 2, static_cast<int>(n), &paths);
  CHECK(bad == 0);
  for (auto p : paths) CHECK(p == step_path::eager_disabled);
  const auto st = runner.stats();
  CHECK(st.captures == 0);
  CHECK(st.lookups() == 0);
  CHECK(st.eager_disabled == paths.size());
  CHECK(warnings.empty());

  // The same program with the switch unset uses graphs.
  env_guard on(nullptr);
  replay::step_runner<replay::graph_key> with_graphs(
      [&](replay::stream_ref cs, const replay::graph_key& k) { m.step(cs, k.bucket); },
      {.buckets = replay::bucket_policy::powers_of_two(64)});
  paths.clear();
  CHECK(drive(with_graphs, m, s, 9, 2, 0, &paths) == 0);
  CHECK(paths == std::vector<step_path>{step_path::captured, step_path::replayed});
}
